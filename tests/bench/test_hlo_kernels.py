"""``bench.hlo_kernels`` on a program XLA compiled for an H100 without one
(``tests/golden/hlo/gpu_program.hlo.txt``, written by ``scripts/gpu_compile.py --sample``)."""

from pathlib import Path

from dlrm_jax.bench.hlo_kernels import DEFAULT_COMMAND_BUFFER, command_buffer_types, parse, program, shape_bytes

SAMPLE = Path(__file__).parent.parent / "golden" / "hlo" / "gpu_program.hlo.txt"
TABLE = (1 << 20) * 8 * 4  # the sample's table: 1M rows of 8 floats
ROWS = 4096 * 8 * 4  # what a batch of 4096 ids gathers or adds of it


def _program():
    return program(SAMPLE.read_text())


def test_shape_bytes_counts_every_element_of_arrays_and_tuples():
    assert shape_bytes("f32[1048576,8]{1,0}") == TABLE
    assert shape_bytes("(s32[], pred[10]{0}, bf16[3,4]{1,0})") == 4 + 10 + 24
    assert shape_bytes("s32[]") == 4


def test_the_loop_of_unknown_trip_count_is_read_on_the_host_and_the_switch_of_kernels_is_not():
    """By XLA's defaults a switch whose branches hold only kernels is recorded into a command
    buffer whole (decided on the device); a loop is not. With no command buffers both are read."""
    p = _program()
    assert p.host_reads == ["loop jit(f)/while"] and p.reads_per_step == (1, 2)
    assert p.on_device == ["switch jit(f)/cond"]
    assert sorted(p.loops, key=str) == [("jit(f)/while", 3), ("jit(f)/while", None)]
    bare = program(SAMPLE.read_text(), frozenset())
    assert bare.host_reads == ["loop jit(f)/while", "switch jit(f)/cond"] and not bare.on_device
    assert bare.reads_per_step == (2, 3)
    with_loops = program(SAMPLE.read_text(), command_buffer_types("--xla_gpu_enable_command_buffer=+WHILE"))
    assert not with_loops.host_reads and len(with_loops.on_device) == 3  # both loops and the switch


SWITCHES = """HloModule m

%gather_branch (p: (f32[64])) -> (f32[64]) {
  %p = (f32[64]{0}) parameter(0)
  %x = f32[64]{0} get-tuple-element(%p), index=0
  %a = f32[64]{0} all-to-all(%x), dimensions={0}, metadata={op_name="jit(f)/cond/branch_1_fun/all_to_all"}
  ROOT %t = (f32[64]{0}) tuple(%a)
}

%keep_branch (p: (f32[64])) -> (f32[64]) {
  ROOT %p = (f32[64]{0}) parameter(0)
}

%body (p: (s32[])) -> (s32[]) {
  %p = (s32[]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %one = s32[] constant(1)
  %n = s32[] add(%i, %one), metadata={op_name="jit(g)/while/body/add"}
  ROOT %t = (s32[]) tuple(%n)
}

%cond (p: (s32[])) -> pred[] {
  %p = (s32[]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %k = s32[] constant(10)
  ROOT %lt = pred[] compare(%i, %k), direction=LT
}

%keep_count (p: (s32[])) -> (s32[]) {
  ROOT %p = (s32[]) parameter(0)
}

%loop_branch (p: (s32[])) -> (s32[]) {
  %p = (s32[]) parameter(0)
  ROOT %w = (s32[]) while(%p), condition=%cond, body=%body, metadata={op_name="jit(g)/cond/while"}
}

ENTRY %main (b: pred[], x: f32[64], c: pred[], i: s32[]) -> ((f32[64]), (s32[])) {
  %b = pred[] parameter(0)
  %x = f32[64]{0} parameter(1)
  %c = pred[] parameter(2)
  %i = s32[] parameter(3)
  %tx = (f32[64]{0}) tuple(%x)
  %ti = (s32[]) tuple(%i)
  %s1 = (f32[64]{0}) conditional(%b, %tx, %tx), true_computation=%gather_branch, false_computation=%keep_branch, metadata={op_name="jit(f)/cond"}
  %s2 = (s32[]) conditional(%c, %ti, %ti), true_computation=%loop_branch, false_computation=%keep_count, metadata={op_name="jit(g)/cond"}
  ROOT %r = ((f32[64]{0}), (s32[])) tuple(%s1, %s2)
}
"""


def test_a_switch_holding_a_collective_or_a_loop_is_read_on_the_host():
    """XLA records a switch whole only where everything in its branches can be recorded: a
    collective (not among the command buffer's default types) or a loop (idem) keeps it, and
    the loop, on the host; with those types added both are decided on the device."""
    p = program(SWITCHES)
    assert p.host_reads == ["switch jit(f)/cond", "switch jit(g)/cond", "loop jit(g)/cond/while"]
    assert not p.on_device
    # both switches; the loop's predicate only in the branch that holds it, twice for a round
    assert p.reads_per_step == (2, 4)
    flags = "--xla_gpu_enable_command_buffer=+COLLECTIVES,+WHILE"
    assert command_buffer_types(flags) == DEFAULT_COMMAND_BUFFER | {"COLLECTIVES", "WHILE"}
    p = program(SWITCHES, command_buffer_types(flags))
    assert not p.host_reads and len(p.on_device) == 3 and p.reads_per_step == (0, 0)
    assert command_buffer_types("--xla_gpu_enable_command_buffer=FUSION,+WHILE") == {"FUSION", "WHILE"}
    assert "CONDITIONAL" not in command_buffer_types("--xla_gpu_enable_command_buffer=-CONDITIONAL")


def test_a_known_loops_kernels_run_its_trip_count_and_an_unknown_ones_once_a_round():
    p = _program()
    known = [k for k in p.kernels if k.where.endswith("[3]")]
    unknown = [k for k in p.kernels if k.where.endswith("[?]")]
    assert known and all(k.runs == 3 for k in known)
    # the body and the condition's predicate: each a kernel a round
    assert len(unknown) >= 2 and all(k.runs == 1 for k in unknown)
    # what the host drives round by round on a GPU: every round of each loop
    assert p.loop_launches == 3 * len(known) + len(unknown) > 0
    assert p.loop_launches < p.launches[0]


def test_gathers_count_what_they_take_and_in_place_scatters_their_updates_not_the_table():
    p = _program()
    gather = next(k for k in p.kernels if k.op_name == "jit(f)/reduce_sum" and k.bytes > ROWS)
    scatter = next(k for k in p.kernels if k.op_name == "jit(f)/scatter-add")
    assert ROWS <= gather.bytes < 2 * ROWS  # the rows, ids and sums; not 32 MiB
    assert 2 * ROWS <= scatter.bytes < 3 * ROWS  # the updates read and written, with the ids
    assert p.traffic[1] < TABLE // 8


def test_the_switchs_branches_give_a_least_and_a_most_costly_path():
    p = _program()
    branches = {k.where for k in p.kernels if "branch" in k.where}
    assert branches == {"/branch0", "/branch1"}
    assert p.launches[0] < p.launches[1] and p.traffic[0] < p.traffic[1]


def test_a_custom_call_updating_an_operand_in_place_counts_only_its_other_operands():
    text = """HloModule m

ENTRY %main (t: f32[1000,16], g: f32[10,16], i: s32[10]) -> f32[1000,16] {
  %t = f32[1000,16]{1,0} parameter(0)
  %g = f32[10,16]{1,0} parameter(1)
  %i = s32[10]{0} parameter(2)
  ROOT %k = f32[1000,16]{1,0} custom-call(%i, %g, %t), custom_call_target="__gpu$xla.gpu.triton", output_to_operand_aliasing={{}: (2, {})}
}
"""
    comps, entry = parse(text)
    assert entry == "main" and comps["main"].root == "k"
    (k,) = program(text).kernels
    assert k.bytes == 10 * 4 + 10 * 16 * 4


def test_a_fusion_reads_of_each_operand_what_its_results_need():
    """XLA computes a fused result element by element: a slice of a sum reads the slice of each
    addend, a broadcast operand is read whole, and a scatter's target is updated in place."""
    text = """HloModule m

%fused_slice (p0: bf16[1000,64], p1: bf16[1000,64], p2: bf16[64]) -> bf16[1000,8] {
  %p0 = bf16[1000,64]{1,0} parameter(0)
  %p1 = bf16[1000,64]{1,0} parameter(1)
  %p2 = bf16[64]{0} parameter(2)
  %b = bf16[1000,64]{1,0} broadcast(%p2), dimensions={1}
  %s = bf16[1000,64]{1,0} add(%p0, %p1)
  %t = bf16[1000,64]{1,0} multiply(%s, %b)
  ROOT %r = bf16[1000,8]{1,0} slice(%t), slice={[0:1000], [0:8]}
}

ENTRY %main (a: bf16[1000,64], c: bf16[1000,64], d: bf16[64]) -> bf16[1000,8] {
  %a = bf16[1000,64]{1,0} parameter(0)
  %c = bf16[1000,64]{1,0} parameter(1)
  %d = bf16[64]{0} parameter(2)
  ROOT %f = bf16[1000,8]{1,0} fusion(%a, %c, %d), kind=kLoop, calls=%fused_slice
}
"""
    (k,) = program(text).kernels
    assert k.bytes == 2 * (1000 * 8 * 2) + 64 * 2 + 1000 * 8 * 2  # two slices read, the bias, the result


def test_a_kernels_matrix_flops_and_its_roofline_time():
    """A dot in a (nested) GEMM fusion and a library GEMM count twice their products' elements
    times the contracted size; a kernel's roofline time is the longer of its bytes at the
    bandwidth and its FLOPs at the rate, summed over the step's kernels."""
    text = """HloModule m

%inner (q0: bf16[4096,512], q1: bf16[512,1024]) -> bf16[4096,1024] {
  %q0 = bf16[4096,512]{1,0} parameter(0)
  %q1 = bf16[512,1024]{1,0} parameter(1)
  ROOT %d = bf16[4096,1024]{1,0} dot(%q0, %q1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%gemm (p0: bf16[4096,512], p1: bf16[512,1024]) -> bf16[4096,1024] {
  %p0 = bf16[4096,512]{1,0} parameter(0)
  %p1 = bf16[512,1024]{1,0} parameter(1)
  ROOT %n = bf16[4096,1024]{1,0} fusion(%p0, %p1), kind=kCustom, calls=%inner
}

%relu (r0: bf16[4096,1024]) -> bf16[4096,1024] {
  %r0 = bf16[4096,1024]{1,0} parameter(0)
  %z = bf16[] constant(0)
  %zb = bf16[4096,1024]{1,0} broadcast(%z), dimensions={}
  ROOT %m = bf16[4096,1024]{1,0} maximum(%r0, %zb)
}

ENTRY %main (x: bf16[4096,512], w: bf16[512,1024], v: bf16[1024,256]) -> (bf16[4096,256], s8[1024]) {
  %x = bf16[4096,512]{1,0} parameter(0)
  %w = bf16[512,1024]{1,0} parameter(1)
  %v = bf16[1024,256]{1,0} parameter(2)
  %g = bf16[4096,1024]{1,0} fusion(%x, %w), kind=kCustom, calls=%gemm
  %a = bf16[4096,1024]{1,0} fusion(%g), kind=kLoop, calls=%relu
  ROOT %c = (bf16[4096,256]{1,0}, s8[1024]{0}) custom-call(%a, %v), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
}
"""
    p = program(text, bandwidth=1e12, flop_rate=1e14)
    g, a, c = p.kernels
    assert (g.flops, a.flops, c.flops) == (2 * 4096 * 1024 * 512, 0, 2 * 4096 * 256 * 1024)
    assert p.flops == (g.flops + c.flops,) * 2
    seconds = [max(k.bytes / 1e12, k.flops / 1e14) for k in (g, a, c)]
    assert g.flops / 1e14 > g.bytes / 1e12 and a.bytes > 0  # the GEMM priced by its FLOPs, the ReLU by bytes
    assert p.roofline_s[0] == p.roofline_s[1] == sum(seconds)
    assert program(text).roofline_s == (0.0, 0.0)  # (no card given)


def test_a_gather_of_columns_of_a_row_major_array_is_strided_and_one_of_rows_is_not():
    """jnp.take(x, idx, axis=1) on a [B, N] row-major array gathers columns: a value per
    memory sector for neighbouring threads (criteo_kaggle's interaction pairs)."""
    text = """HloModule m

%fused_gather (p0: bf16[65536,729], p1: s32[351,1]) -> bf16[351,65536,1] {
  %p0 = bf16[65536,729]{1,0} parameter(0)
  %p1 = s32[351,1]{1,0} parameter(1)
  ROOT %g = bf16[351,65536,1]{2,1,0} gather(%p0, %p1), offset_dims={1,2}, collapsed_slice_dims={}, start_index_map={1}, index_vector_dim=1, slice_sizes={65536,1}, metadata={op_name="columns"}
}

%fused_rows (q0: f32[100000,128], q1: s32[4096,1]) -> f32[4096,1,128] {
  %q0 = f32[100000,128]{1,0} parameter(0)
  %q1 = s32[4096,1]{1,0} parameter(1)
  ROOT %h = f32[4096,1,128]{2,1,0} gather(%q0, %q1), offset_dims={1,2}, collapsed_slice_dims={}, start_index_map={0}, index_vector_dim=1, slice_sizes={1,128}, metadata={op_name="rows"}
}

ENTRY %main (a: bf16[65536,729], i: s32[351,1], t: f32[100000,128], j: s32[4096,1]) -> (bf16[351,65536,1], f32[4096,1,128]) {
  %a = bf16[65536,729]{1,0} parameter(0)
  %i = s32[351,1]{1,0} parameter(1)
  %t = f32[100000,128]{1,0} parameter(2)
  %j = s32[4096,1]{1,0} parameter(3)
  %f = bf16[351,65536,1]{2,1,0} fusion(%a, %i), kind=kLoop, calls=%fused_gather
  %r = f32[4096,1,128]{2,1,0} fusion(%t, %j), kind=kLoop, calls=%fused_rows
  ROOT %out = (bf16[351,65536,1]{2,1,0}, f32[4096,1,128]{2,1,0}) tuple(%f, %r)
}
"""
    assert program(text).strided_gathers == ["columns"]
    assert _program().strided_gathers == []  # the sample's gather takes rows


def test_the_installed_xlas_command_buffer_types_are_read_from_its_compile_options():
    """``bench.xla_options`` reads the types the installed XLA compiles with (no flag sets them
    in the tests): the defaults the model takes, switches among them, loops not."""
    from dlrm_jax.bench.xla_options import command_buffer_types_installed

    assert command_buffer_types_installed() == DEFAULT_COMMAND_BUFFER
