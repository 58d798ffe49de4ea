"""The state's checksums: the same however an array is laid out over devices (a checkpoint
restores onto another device count), equal to a plain NumPy reference, and moved by any one
changed element."""

import jax
import ml_dtypes
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dlrm_jax.train.state_digest import combine, first_mismatch, process_sums
from tests.helpers import examples

DTYPES = [np.float32, ml_dtypes.bfloat16, np.int32, np.uint32, np.uint8, np.bool_]
MESHES = [((1,), ("d",)), ((2,), ("d",)), ((4,), ("d",)), ((8,), ("d",)), ((2, 4), ("a", "b")), ((4, 2), ("a", "b"))]


def reference(a: np.ndarray) -> str:
    """The checksum by its definition, on the whole array in NumPy."""
    if a.dtype == np.bool_:
        words = a.astype(np.uint32)
    else:
        words = a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize]).astype(np.uint32)
    position = np.arange(words.size, dtype=np.uint64)
    terms = (words.ravel().astype(np.uint64) ^ (position * 0x9E3779B9 % 2**32)) * 0x85EBCA6B % 2**32
    return f"{int(terms.sum()) % 2**32:08x}"


def checksum(x) -> str:
    return combine([process_sums({"x": x})])["x"]


@st.composite
def laid_out(draw):
    """(host array, the same on a mesh): any dtype, 0-3 dims, each dim split over mesh axes that
    divide it or replicated."""
    shape_of, names = draw(st.sampled_from(MESHES))
    mesh = Mesh(np.array(jax.devices()[: int(np.prod(shape_of))]).reshape(shape_of), names)
    ndim = draw(st.integers(0, 3))
    free, spec, dims = list(names), [], []
    for _ in range(ndim):
        axes = draw(st.lists(st.sampled_from(free), unique=True, max_size=len(free))) if free else []
        free = [a for a in free if a not in axes]
        split = int(np.prod([mesh.shape[a] for a in axes]))
        dims.append(split * draw(st.integers(1, 3)))
        spec.append(tuple(axes) or None)
    dtype = draw(st.sampled_from(DTYPES))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    size = int(np.prod(dims))
    if dtype == np.bool_:
        host = rng.integers(0, 2, dims).astype(bool)
    else:  # any bits, NaNs' too: a checksum reads bits, not values
        host = np.frombuffer(rng.bytes(size * np.dtype(dtype).itemsize), dtype).reshape(dims).copy()
    return host, jax.device_put(host, NamedSharding(mesh, P(*spec)))


@settings(max_examples=examples(30), deadline=None)
@given(case=laid_out())
def test_a_checksum_is_the_reference_whatever_the_layout(case):
    host, laid = case
    assert checksum(laid) == reference(host)


@settings(max_examples=examples(15), deadline=None)
@given(case=laid_out(), data=st.data())
def test_any_one_changed_element_changes_it(case, data):
    host, laid = case
    if not host.size:
        return
    at = data.draw(st.integers(0, host.size - 1))
    changed = host.copy().reshape(-1)
    changed[at] = (
        ~changed[at]
        if host.dtype == np.bool_
        else np.frombuffer((np.frombuffer(changed[at].tobytes(), np.uint8) ^ 1).tobytes(), host.dtype)[0]
    )
    changed = changed.reshape(host.shape)
    assert checksum(jax.device_put(changed, laid.sharding)) != checksum(laid)


def test_a_mismatch_names_the_array_and_old_checkpoints_pass():
    sums = {"params.a": "00000001", "params.b": "00000002"}
    assert first_mismatch(sums, {"params.a": "00000001", "params.b": "00000003"}) == (
        "params.b's contents differ from the checksum saved with it (00000002 against 00000003)"
    )
    assert first_mismatch(sums, None) == first_mismatch(sums, {"params.c": "0"}) == ""
