"""Reading a compiled train step and its ``jax.profiler`` trace into per-phase times.

The step wraps its phases in named scopes (:data:`PHASE_SCOPES`); each instruction of the
optimized program carries its scope in its metadata, and the trace has one event per executed
operation (a thunk on CPU, a kernel on GPU) named after its instruction. Collectives are split
off by opcode: the dense gradients' all-reduce from the dense scope, the gradient all-to-all
from the sparse update. Operations fused across scopes count under the scope of the fusion's
root. ``dlrm-jax profile`` (``bench.profile``) runs the steps; this module only reads.
"""

from __future__ import annotations

import collections
import glob
import re

# Scope names of the train step's phases, found again in the compiled program's op metadata.
PHASE_SCOPES = {
    "exchange_forward": "phase_exchange_forward",
    "dense": "phase_dense_fwd_bwd",
    "dense_optimizer": "phase_dense_optimizer",
    "sparse_update": "phase_sparse_update",
    "cache_fill": "phase_cache_fill",
}


HOST_PHASES = ("input pipeline", "host->device")


DEVICE_PHASES = (
    "cache fill",
    "exchange forward",
    "dense forward+backward",
    "gradient all-reduce",
    "exchange backward",
    "sparse update",
    "dense optimizer",
    "other",
)


_COLLECTIVES = (
    "all-reduce",
    "all-reduce-start",
    "all-reduce-done",
    "all-to-all",
    "all-gather",
    "all-gather-start",
    "all-gather-done",
    "reduce-scatter",
    "collective-permute",
)


# Control flow's own events span the operations inside it, which have events of their own.
_CONTAINERS = ("while", "conditional", "call")


# "%name = TYPE opcode(operands), ..., metadata={op_name="..."}"; a tuple TYPE may hold "=".
_INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+) = .*?\s([a-z][a-z\-]*)\((?:.*op_name="([^"]*)")?')


def instruction_phases(hlo_text: str) -> dict[str, str]:
    """Instruction name -> phase, for every instruction of the optimized program (names are
    unique in an HLO module; fused computations' insides never run as events of their own)."""
    scope_phase = {scope: name.replace("_", " ") for name, scope in PHASE_SCOPES.items()}
    out = {}
    for line in hlo_text.splitlines():
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        name, opcode, op_name = m.group(1), m.group(2), m.group(3) or ""
        if opcode in _CONTAINERS:
            out[name] = ""  # skipped: its body's events count
            continue
        # A collective XLA combined from several scopes names them all ("(a/...:b/...)"): one
        # that carries the dense gradients is their all-reduce; otherwise the first one named.
        named = sorted((op_name.find(s), s) for s in scope_phase if s in op_name)
        scope = named[0][1] if named else None
        if opcode in _COLLECTIVES and PHASE_SCOPES["dense"] in op_name:
            scope = PHASE_SCOPES["dense"]
        phase = scope_phase.get(scope, "other")
        if phase == "dense" and opcode in _COLLECTIVES:
            phase = "gradient all-reduce"
        elif phase == "dense":
            phase = "dense forward+backward"
        elif phase == "sparse update" and opcode in _COLLECTIVES:
            phase = "exchange backward"
        out[name] = phase
    return out


def device_phase_ns(trace_dir: str, phases: dict[str, str]) -> collections.Counter:
    """Nanoseconds per phase summed over the traced operations of this process's devices."""
    from jax._src.lib import _profile_data

    (path,) = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    data = _profile_data.ProfileData.from_file(path)
    total = collections.Counter()
    for plane in data.planes:
        on_gpu = plane.name.startswith("/device:GPU")
        if not (on_gpu or plane.name.startswith("/host:CPU")):
            continue
        for line in plane.lines:
            if on_gpu and line.name != "XLA Ops":
                continue
            for ev in line.events:
                phase = phases.get(ev.name)
                if phase:
                    total[phase] += ev.duration_ns
    return total


def format_profile(result: dict) -> list[str]:
    """The table ``profile`` prints."""
    device_ms = sum(r["ms"] for r in result["phases"] if r["how"] == "trace")
    lines = [
        f"{result['steps']} train steps of batch {result['batch_size']} on {result['devices']} "
        f"{result['backend']} devices in {result['processes']} process(es); step wall time "
        f"{result['step_wall_ms']:.2f} ms (median, blocking)",
        f"{'phase':<24}{'ms/step':>10}{'share':>8}  timed",
    ]
    total = device_ms + sum(r["ms"] for r in result["phases"] if r["how"] != "trace")
    for r in result["phases"]:
        lines.append(f"{r['name']:<24}{r['ms']:>10.3f}{r['ms'] / total:>8.1%}  {r['how']}")
    lines.append(
        f"device phases: mean per device{' of process 0' if result['processes'] > 1 else ''} of the traced "
        "operations' time (jax.profiler trace of "
        "the compiled step, phases from its named scopes); host phases: timed alone"
        + ("; tier rows: the dispatching thread's host work, timed in the run" if result.get("tiered") else "")
    )
    mem = result["memory_per_device"]
    if mem:
        mib = {k: v / 2**20 for k, v in mem.items()}
        lines.append(
            f"per-device memory of the compiled step: {mib['peak']:.1f} MiB (arguments "
            f"{mib['arguments']:.1f}, temp {mib['temp']:.1f}, outputs {mib['outputs']:.1f}, "
            f"aliased {mib['aliased']:.1f})"
        )
    lines.append(
        f"trace: {result['trace_dir']} (tensorboard --logdir {result['trace_dir']}, profile tab, after "
        f"pip install 'dlrm-jax[tensorboard]'; or open the .trace.json.gz in ui.perfetto.dev)"
    )
    return lines
