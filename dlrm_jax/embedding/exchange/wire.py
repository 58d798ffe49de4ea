"""How vectors and gradients travel: the exchange's wire precision (``embedding.exchange_dtype``).

``float32`` and ``bfloat16`` send the values as they are (bfloat16: rounded to nearest); the
owners and requesters always add in float32. ``float8`` sends each vector (a row of W values)
as float8_e4m3fn scaled by its own float32 factor, max |x| / 448 (e4m3's largest finite value):
W + 4 bytes a vector, about a quarter of float32's at W >= 16, each value within 2**-4 of
itself relative to the vector's largest (3 mantissa bits, rounded to nearest), and no vector
ever overflows or underflows as a whole.

Every encoded part is bit-cast to an unsigned integer of its width before the collective, so it
moves as many bytes as it holds whatever the backend (XLA:CPU otherwise widens bfloat16 and
float8 collectives to 32 and 16 bits).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

WIRE_DTYPES = ("float32", "bfloat16", "float8")
E4M3_MAX = 448.0
_CARRIER = {2: jnp.uint16, 1: jnp.uint8}


class Wire:
    """Encodes [..., W] float32 for a collective and decodes what arrives, for one precision."""

    def __init__(self, name: str):
        if name not in WIRE_DTYPES:
            raise ValueError(f"exchange precision {name!r}: one of {', '.join(WIRE_DTYPES)}")
        self.name = name

    def send(self, x, collective):
        """``collective`` (e.g. an all_to_all) applied to ``x`` at this precision; float32 out."""
        return self.decode(tuple(collective(p) for p in self.encode(x)))

    def encode(self, x) -> tuple:
        x = x.astype(jnp.float32)
        if self.name == "float32":
            return (x,)
        if self.name == "bfloat16":
            return (_carry(x.astype(jnp.bfloat16)),)
        largest = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
        scale = jnp.where(largest > 0, largest / E4M3_MAX, 1.0)
        return _carry((x / scale).astype(jnp.float8_e4m3fn)), scale

    def decode(self, parts: tuple):
        if self.name == "float32":
            return parts[0]
        if self.name == "bfloat16":
            return lax.bitcast_convert_type(parts[0], jnp.bfloat16).astype(jnp.float32)
        values, scale = parts
        return lax.bitcast_convert_type(values, jnp.float8_e4m3fn).astype(jnp.float32) * scale


def _carry(x):
    return lax.bitcast_convert_type(x, _CARRIER[x.dtype.itemsize])
