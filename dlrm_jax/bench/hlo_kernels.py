"""What a compiled GPU program does each step, read from its optimized HLO text (no device).

``scripts/gpu_compile.py`` compiles a train step for a GPU on a machine without one (XLA's
deviceless compilation for a named card); this module reads the program it gives:

- **kernels**: the instructions of the entry computation and of its loops' bodies and switches'
  branches that launch work (fusions, custom calls, sorts, unfused scatters, copies,
  collectives), each with an estimate of the bytes it moves: its operands read and its result
  written, except what it does not touch (a fusion reads of each operand what its results
  need: a slice or a gather of it, that part; a result written in place, a scatter's or a
  dynamic update slice's, counts the updates, not the array; a custom call's operand aliased
  to its result is not counted at all, what it touches there not being in the HLO);
- **host reads**: the loops whose trip count XLA does not know and the switches that XLA's GPU
  runtime decides on the host (it copies the predicate or index back and waits, the device idle
  meanwhile). It records runs of kernels into command buffers (CUDA graphs) at every level, a
  loop's body and a switch's branches included, and records a switch or loop itself, decided
  on the device (CUDA graphs' conditional nodes), where its kind is among the command buffer's
  types (``--xla_gpu_enable_command_buffer``; by default switches, not loops) and everything
  in it can be recorded too: no collective (not among the defaults) and no loop left to the
  host. :func:`command_buffer_types` reads the types from XLA's flags;
- **loops**: each ``while`` with its known trip count, if any;
- **strided gathers**: gathers whose slices are columns of a row-major array (a value read per
  memory sector: criteo_kaggle's interaction pairs took 0.166 ms on an H200 for 0.15 GB).

Each kernel's FLOPs are its matrix products' (a ``dot`` in a fusion or a library GEMM: twice
its result's elements times its contracted size). Given a card's bandwidth and matmul rate,
:func:`program` also sums each kernel's roofline time, the longer of its bytes at the bandwidth
and its FLOPs at the rate: a floor for the step that knows its GEMMs, with no launch or idle
time in it.

The byte estimates are an upper bound on a kernel's traffic where caches serve repeats and a
lower bound where atomics contend; they rank kernels and compare forms of one step, and the
roofline time bounds a step from below; neither times it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4}
_DTYPE_BYTES |= {"s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}
# Instructions that launch nothing of their own.
_FREE = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
    "after-all", "partition-id", "replica-id", "add-dependency", "opt-barrier", "domain", "copy-done",
    "all-reduce-done", "all-gather-done", "collective-permute-done", "async-done", "send-done", "recv-done",
}  # fmt: skip
# What XLA's GPU runtime records into command buffers by default (jaxlib 0.10.2's XLA, as
# ``bench.xla_options`` reads the installed one's): no WHILE, no COLLECTIVES.
DEFAULT_COMMAND_BUFFER = frozenset(
    {"FUSION", "CUBLAS", "CUBLASLT", "CUDNN", "CUSTOM_CALL", "DYNAMIC_SLICE_FUSION", "CONDITIONAL"}
)
_COLLECTIVE = re.compile(
    r"^(all-to-all|ragged-all-to-all|all-reduce|all-gather|reduce-scatter|collective-permute|collective-broadcast"
    r"|send|recv|infeed|outfeed)(-start)?$"
)
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*)$")
_ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def _count(dims: str) -> int:
    return int(np.prod([int(d) for d in dims.split(",") if d]))


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape (a tuple's: every element's), its layouts ignored."""
    return sum(_count(dims) * _DTYPE_BYTES.get(dtype, 4) for dtype, dims in _ARRAY.findall(shape))


@dataclass
class Instruction:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str

    @property
    def bytes(self) -> int:
        return shape_bytes(self.shape)

    def called(self, key: str) -> list[str]:
        """The computations this instruction calls under ``key`` (``calls``, ``body``, ...)."""
        m = re.search(rf"\b{key}=(\{{[^}}]*\}}|%[\w.\-]+)", self.attrs)
        return re.findall(r"%([\w.\-]+)", m.group(1)) if m else []

    @property
    def op_name(self) -> str:
        m = _OP_NAME.search(self.attrs)
        return m.group(1) if m else ""


@dataclass
class Computation:
    name: str
    instructions: dict[str, Instruction] = field(default_factory=dict)
    root: str = ""


def _split_operands(rest: str) -> tuple[list[str], str]:
    """The operand names of an instruction's text after its opening parenthesis, and the rest."""
    depth, i = 1, 0
    while i < len(rest) and depth:
        depth += {"(": 1, ")": -1}.get(rest[i], 0)
        i += 1
    return re.findall(r"%([\w.\-]+)", rest[: i - 1]), rest[i:]


def parse(text: str) -> tuple[dict[str, Computation], str]:
    """Every computation of an HLO module's text by name, and the entry's name."""
    comps, entry, current = {}, "", None
    for line in text.splitlines():
        if line.startswith(("%", "ENTRY ")) and line.rstrip().endswith("{"):
            name = re.match(r"(?:ENTRY )?%([\w.\-]+)", line).group(1)
            current = comps.setdefault(name, Computation(name))
            entry = name if line.startswith("ENTRY") else entry
            continue
        m = _INSTRUCTION.match(line) if current is not None else None
        if m:
            operands, attrs = _split_operands(m.group(4))
            inst = Instruction(m.group(1), m.group(2), m.group(3), operands, attrs)
            current.instructions[inst.name] = inst
            if line.lstrip().startswith("ROOT"):
                current.root = inst.name
    return comps, entry


@dataclass
class Kernel:
    name: str
    opcode: str
    bytes: int  # estimated traffic, bytes
    runs: int  # launches a step (a loop's body: its trip count; unknown: 1 a round)
    where: str  # the loops (name[trip count]) and branches around it, outermost first ("" at the top)
    op_name: str
    flops: int = 0  # its matrix products' multiply-adds, twice


def command_buffer_types(xla_flags: str = "") -> frozenset[str]:
    """The command buffer's types after ``xla_flags`` (``--xla_gpu_enable_command_buffer=``:
    a list replaces the defaults, ``+X``/``-X`` items add or take away)."""
    types = set(DEFAULT_COMMAND_BUFFER)
    for value in re.findall(r"--xla_gpu_enable_command_buffer=(\S*)", xla_flags):
        items = [i for i in value.split(",") if i]
        if items and not all(i[0] in "+-" for i in items):
            types = set()
        for item in items:
            (types.discard if item.startswith("-") else types.add)(item.lstrip("+-").upper())
    return frozenset(types)


@dataclass
class Program:
    kernels: list[Kernel]
    host_reads: list[str]  # each loop of unknown trip count and each switch decided on the host, by op name
    loops: list[tuple[str, int | None]]  # (op name, known trip count or None)
    # a step's launches and bytes on its cheapest and its dearest path through the switches
    # (a loop of unknown trip count counted once: a round)
    launches: tuple[int, int] = (0, 0)
    traffic: tuple[int, int] = (0, 0)
    # gathers that read across an array's rows: each slice a column (1 element of the minor
    # dimension, many of the others), so neighbouring threads read a value per memory sector
    strided_gathers: list[str] = field(default_factory=list)
    # switches and loops recorded into command buffers whole: decided on the device, no read
    on_device: list[str] = field(default_factory=list)
    # host reads a step on the cheapest and the dearest path (a loop of unknown trip count that
    # the host decides: none of its rounds on the cheapest, one on the dearest)
    reads_per_step: tuple[int, int] = (0, 0)
    # matrix FLOPs a step, and the kernels' roofline seconds (given a bandwidth and a rate),
    # on the cheapest and the dearest path
    flops: tuple[int, int] = (0, 0)
    roofline_s: tuple[float, float] = (0.0, 0.0)

    def largest(self, n: int = 15) -> list[Kernel]:
        return sorted(self.kernels, key=lambda k: -k.bytes * k.runs)[:n]

    @property
    def loop_launches(self) -> int:
        """Launches a step of kernels inside loops (an unknown trip count: one round), known
        trip count or not: unless the loop is recorded whole, the host drives every round of
        it, launching its body's command buffers and whatever is not in one (a binary search's
        loop of 21 rounds was 44 of criteo_kaggle's 191 kernels a step, and its carry's copies
        43 more)."""
        return sum(k.runs for k in self.kernels if "[" in k.where)


_IN_PLACE = {"scatter", "dynamic-update-slice"}
_SAME_ELEMENTS = {"bitcast", "reshape", "transpose", "copy", "convert", "reverse"}


def _elements(shape: str) -> int:
    return sum(_count(dims) for _, dims in _ARRAY.findall(shape))


def _roots(body: Computation) -> list[Instruction]:
    """A computation's results: its root, or the elements of its root tuple."""
    root = body.instructions.get(body.root)
    if root is None:
        return []
    return [body.instructions[o] for o in root.operands if o in body.instructions] if root.opcode == "tuple" else [root]


def _demand(body: Computation) -> dict[str, float]:
    """The share of each instruction's elements a fusion's results need (XLA computes a fused
    result element by element, so an operand only sliced or gathered from is read that far):
    from the results back, each operand taking the most any user needs of it."""
    need = {r.name: 1.0 for r in _roots(body)}
    for inst in reversed(list(body.instructions.values())):
        f = need.get(inst.name, 0.0)
        if inst.opcode == "tuple" or not f:
            continue
        out = max(_elements(inst.shape), 1)
        for i, o in enumerate(inst.operands):
            operand = body.instructions.get(o)
            if operand is None:
                continue
            size = max(_elements(operand.shape), 1)
            if inst.opcode in ("slice", "dynamic-slice", "gather") and i == 0:
                share = f * min(1.0, out / size)
            elif inst.opcode in _IN_PLACE and i == 0:
                share = 0.0  # (updated where it lies: ``_fusion_bytes`` counts the updates)
            elif inst.opcode in _SAME_ELEMENTS or size == out:
                share = f
            else:  # broadcasts, reductions, dots, indices: all of it
                share = 1.0
            need[o] = max(need.get(o, 0.0), share)
    return need


def _fusion_bytes(inst: Instruction, comps: dict[str, Computation], shapes: dict[str, str]) -> int:
    """A fusion's traffic: each operand read as far as its results need it (:func:`_demand`;
    nothing of an array updated in place) and its results written (one updated in place: its
    updates only)."""
    body = comps.get((inst.called("calls") or [""])[0])
    if body is None:
        return _call_bytes(inst, comps, shapes)
    need = _demand(body)
    written = 0
    for r in _roots(body):
        update = {"scatter": 2, "dynamic-update-slice": 1}.get(r.opcode)
        if update is not None and len(r.operands) > update and r.operands[update] in body.instructions:
            written += body.instructions[r.operands[update]].bytes
        else:
            written += r.bytes
    params = (i for i in body.instructions.values() if i.opcode == "parameter")
    return written + int(sum(need.get(i.name, 0.0) * i.bytes for i in params))


def _call_bytes(inst: Instruction, comps: dict[str, Computation], shapes: dict[str, str]) -> int:
    """An instruction's operands read and its result written, less what its result aliases (a
    custom call updating an operand in place: what it touches there is not in the HLO)."""
    aliased = set()
    m = re.search(r"output_to_operand_aliasing=\{(.*?\))\}", inst.attrs)
    if m:
        aliased = {int(i) for i in re.findall(r"\((\d+),", m.group(1))}
    operands = [shape_bytes(shapes.get(o, "")) for o in inst.operands]
    kept = sum(b for i, b in enumerate(operands) if i not in aliased)
    return kept + inst.bytes - sum(operands[i] for i in aliased if i < len(operands))


def _product_flops(lhs_shape: str, contracted: list[int], out_elements: int) -> int:
    """Twice the product's elements times the left operand's contracted dimensions' sizes."""
    lhs = _ARRAY.search(lhs_shape)
    if lhs is None:
        return 0
    dims = [int(d) for d in lhs.group(2).split(",") if d]
    return 2 * out_elements * int(np.prod([dims[i] for i in contracted]))


def _dot_flops(inst: Instruction, shapes: dict[str, str]) -> int:
    """A ``dot``'s FLOPs (its attribute names the contracted dimensions)."""
    m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", inst.attrs)
    if m is None or not inst.operands:
        return 0
    contracted = [int(i) for i in m.group(1).split(",") if i]
    return _product_flops(shapes.get(inst.operands[0], ""), contracted, _elements(inst.shape))


def _gemm_flops(inst: Instruction, comps: dict[str, Computation], shapes: dict[str, str]) -> int:
    """A kernel's matrix FLOPs: its fused computations' dots (nested fusions included), or a
    library GEMM's (a custom call whose backend config names the contracted dimensions; its
    first result is the product)."""
    if inst.opcode == "custom-call":
        m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', inst.attrs)
        out = _ARRAY.search(inst.shape)
        if m is None or out is None or not inst.operands:
            return 0
        contracted = [int(i) for i in re.findall(r"\d+", m.group(1))]
        return _product_flops(shapes.get(inst.operands[0], ""), contracted, _count(out.group(2)))
    total = 0
    for name in inst.called("calls"):
        body = comps.get(name)
        if body is None:
            continue
        inner = {i.name: i.shape for i in body.instructions.values()}
        for i in body.instructions.values():
            if i.opcode == "dot":
                total += _dot_flops(i, inner)
            elif i.opcode == "fusion":
                total += _gemm_flops(i, comps, inner)
    return total


def program(
    text: str,
    graphs: frozenset[str] = DEFAULT_COMMAND_BUFFER,
    bandwidth: float | None = None,
    flop_rate: float | None = None,
) -> Program:
    """The kernels, host reads and loops of an optimized HLO module (see the module docstring);
    ``graphs``: the command buffer's types (:func:`command_buffer_types`); ``bandwidth``
    (bytes/s) and ``flop_rate`` (FLOP/s), a card's: the kernels' roofline time summed."""
    comps, entry = parse(text)
    kernels, host_reads, loops, on_device = [], [], [], []
    recordable = {}

    def whole(name: str) -> bool:
        """Whether everything computation ``name`` runs can be recorded into a command buffer."""
        if name not in recordable:
            recordable[name] = False  # (no cycles in HLO; this only guards the walk)
            comp = comps.get(name)
            recordable[name] = comp is not None and all(_recorded(i, graphs, whole) for i in comp.instructions.values())
        return recordable[name]

    def walk(name: str, runs: int, where: str) -> tuple[int, ...]:
        """Launches, bytes and host reads of one run of computation ``name`` (each least, most):
        kernels noted."""
        comp = comps[name]
        shapes = {i.name: i.shape for i in comp.instructions.values()}
        # launches least, most; bytes least, most; host reads least, most; FLOPs least, most;
        # roofline seconds least, most
        total = [0] * 10

        def add(part, times=1):
            for i in range(10):
                total[i] += part[i] * times

        for inst in comp.instructions.values():
            if inst.opcode == "while":
                m = _TRIP.search(inst.attrs)
                trip = int(m.group(1)) if m else None
                loops.append((inst.op_name, trip))
                decided = _recorded(inst, graphs, whole)
                host = trip is None and not decided  # its predicate read on the host each round
                if decided:
                    on_device.append(f"loop {inst.op_name}")
                elif host:
                    host_reads.append(f"loop {inst.op_name}")
                label = f"{where}/{inst.name}[{trip if trip is not None else '?'}]"
                # (a condition decided on the host still computes its predicate in a kernel)
                for body in inst.called("body") + ([] if trip else inst.called("condition")):
                    part = walk(body, runs * (trip or 1), label)
                    # (its reads: none with no round on the cheapest path, a round's on the dearest)
                    add((*part[:4], 0, *part[5:]) if host else part, trip or 1)
                if host:
                    add((0, 0, 0, 0, 1, 2, 0, 0, 0, 0))  # the predicate read once with no round, twice with one
            elif inst.opcode == "conditional":
                read = 0 if _recorded(inst, graphs, whole) else 1
                (host_reads if read else on_device).append(f"switch {inst.op_name}")
                parts = [walk(b, runs, f"{where}/branch{i}") for i, b in enumerate(_branches(inst))]
                if parts:
                    add(tuple((min, max)[i % 2](p[i] for p in parts) for i in range(10)))
                add((0, 0, 0, 0, read, read, 0, 0, 0, 0))
            elif inst.opcode == "call":
                for callee in inst.called("to_apply"):
                    add(walk(callee, runs, where))
            elif inst.opcode not in _FREE and not inst.opcode.endswith("-done"):
                moved = (_fusion_bytes if inst.opcode == "fusion" else _call_bytes)(inst, comps, shapes)
                flops = _gemm_flops(inst, comps, shapes) if inst.opcode in ("fusion", "custom-call") else 0
                kernels.append(Kernel(inst.name, inst.opcode, moved, runs, where, inst.op_name, flops))
                t = max(moved / bandwidth, flops / flop_rate) if bandwidth and flop_rate else 0.0
                add((1, 1, moved, moved, 0, 0, flops, flops, t, t))
        return tuple(total)

    totals = walk(entry, 1, "")
    strided = [i.op_name or i.name for c in comps.values() for i in c.instructions.values() if _reads_columns(i, c)]
    launches, traffic, reads, flops, roofline = (tuple(totals[i : i + 2]) for i in range(0, 10, 2))
    return Program(kernels, host_reads, loops, launches, traffic, strided, on_device, reads, flops, roofline)


def _branches(inst: Instruction) -> list[str]:
    """A switch's branch computations (an index's list, or a predicate's true and false)."""
    return inst.called("branch_computations") or inst.called("true_computation") + inst.called("false_computation")


def _recorded(inst: Instruction, graphs: frozenset[str], whole) -> bool:
    """Whether XLA records ``inst`` into a command buffer: a switch or loop whole only where its
    kind is among ``graphs`` and ``whole`` says so of every computation it runs; a collective
    where ``COLLECTIVES`` is; anything else (kernels, library calls, copies) always."""
    if inst.opcode == "while":
        return "WHILE" in graphs and all(whole(c) for c in inst.called("body") + inst.called("condition"))
    if inst.opcode == "conditional":
        return "CONDITIONAL" in graphs and all(whole(c) for c in _branches(inst))
    if inst.opcode == "call":
        return all(whole(c) for c in inst.called("to_apply"))
    if inst.opcode == "async-start":  # (what it starts is in the computation it calls)
        return all(whole(c) for c in inst.called("calls"))
    if _COLLECTIVE.match(inst.opcode):
        return "COLLECTIVES" in graphs
    return True


_LAYOUT = re.compile(r"\[([\d,]*)\]\{([\d,]+)")


def _reads_columns(inst: Instruction, comp: Computation, least: int = 1024) -> bool:
    """Whether a gather's slices are columns of its operand: one element along the operand's
    minor dimension and at least ``least`` along the others."""
    if inst.opcode != "gather" or not inst.operands or inst.operands[0] not in comp.instructions:
        return False
    sizes = re.search(r"slice_sizes=\{([\d,]+)\}", inst.attrs)
    layout = _LAYOUT.search(comp.instructions[inst.operands[0]].shape)
    if sizes is None or layout is None:
        return False
    sizes = [int(x) for x in sizes.group(1).split(",")]
    minor = int(layout.group(2).split(",")[0])
    others = int(np.prod([n for d, n in enumerate(sizes) if d != minor]))
    return sizes[minor] == 1 and others >= least
