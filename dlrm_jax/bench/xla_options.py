"""What the installed XLA compiles with: the command buffer's types (``bench.hlo_kernels``' model
of which switches and loops a GPU decides on the host follows them).

jaxlib does not expose ``DebugOptions.xla_gpu_enable_command_buffer`` by name, but its compile
options serialize to XLA's ``CompileOptionsProto``, whose debug options hold the list (field
258, ``CommandBufferCmdType`` values) after ``XLA_FLAGS`` is applied: read from there, so that
a GPU run records what its own XLA takes (the types changed between XLA versions: CONDITIONAL
joined the defaults in 2026).
"""

from __future__ import annotations

# CompileOptionsProto.executable_build_options -> ExecutableBuildOptionsProto.debug_options ->
# DebugOptions.xla_gpu_enable_command_buffer
_PATH = (3, 3, 258)
_TYPES = {
    1: "FUSION",
    2: "CUBLAS",
    3: "CUDNN",
    4: "COLLECTIVES",
    5: "CONDITIONAL",
    6: "WHILE",
    7: "CUSTOM_CALL",
    8: "CUBLASLT",
    9: "DYNAMIC_SLICE_FUSION",
    11: "CONVOLUTION",
}


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            return value, i


def _fields(buf: bytes):
    """(field number, value) of a serialized protobuf message: an int, or bytes where
    length-delimited."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 2:
            n, i = _varint(buf, i)
            value, i = buf[i : i + n], i + n
        elif wire in (1, 5):
            n = 8 if wire == 1 else 4
            value, i = buf[i : i + n], i + n
        else:
            raise ValueError(f"protobuf wire type {wire}")
        yield number, value


def command_buffer_types_installed() -> frozenset[str] | None:
    """The command buffer's types the installed XLA compiles with (``XLA_FLAGS`` applied), or
    None where its compile options cannot be read so."""
    from jax._src.lib import xla_client

    try:
        message = xla_client.CompileOptions().SerializeAsString()
        for number in _PATH[:-1]:
            message = next(v for n, v in _fields(message) if n == number)
        types, packed = set(), [v for n, v in _fields(message) if n == _PATH[-1]]
        for value in packed:
            if isinstance(value, int):
                types.add(value)
                continue
            i = 0
            while i < len(value):
                kind, i = _varint(value, i)
                types.add(kind)
    except (StopIteration, ValueError, IndexError, AttributeError):
        return None
    return frozenset(_TYPES.get(t, f"TYPE_{t}") for t in types)
