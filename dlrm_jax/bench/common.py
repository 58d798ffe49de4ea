"""What every benchmark shares: the machine's description, JSON reports, step timing, and
the bytes a compiled program's collectives move."""

from __future__ import annotations

import platform
import re
import statistics
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

import jax
import numpy as np

from dlrm_jax import stopping
from dlrm_jax.files import json_text

T = TypeVar("T")


def machine_description() -> dict:
    devices = jax.devices()
    return {
        "backend": jax.default_backend(),
        "device_kind": devices[0].device_kind,
        "device_count": len(devices),
        "host": platform.node(),
        "processor": platform.processor(),
        "python": platform.python_version(),
        "jax": jax.__version__,
    }


def write_report(report: dict, output: str | None) -> str:
    """The report as indented JSON, written to ``output`` too when given; returns the text."""
    text = json_text(report, indent=1)
    if output:
        with open(output, "w") as f:
            f.write(text + "\n")
    return text


_DTYPE_BYTES = {
    "f32": 4,
    "s32": 4,
    "u32": 4,
    "bf16": 2,
    "f16": 2,
    "u16": 2,
    "s16": 2,
    "s8": 1,
    "u8": 1,
    "pred": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "f64": 8,
    "s64": 8,
    "u64": 8,
}
_COLLECTIVE = re.compile(
    r"=\s*(.+?)\s+(all-to-all|all-gather|all-reduce|reduce-scatter|"
    r"collective-permute)(?:-start)?\("
)
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")
_GROUPS = re.compile(r"replica_groups=(?:\{\{([\d,]*)\}|\[\d+,(\d+)\]<=)")


def _group_size(line: str, n: int) -> int:
    """Devices in each of the collective's replica groups (a model group's, or all ``n``)."""
    m = _GROUPS.search(line)
    if not m:
        return n
    return len(m.group(1).split(",")) if m.group(1) is not None else int(m.group(2))


def hlo_replica_groups(hlo_text: str, kind: str) -> list[list[list[int]] | None]:
    """Per ``kind`` collective (e.g. "all-to-all") of the compiled HLO, its replica groups
    (device positions in the mesh, listed or as consecutive runs), or None in a form this
    does not read (XLA's mesh-axis notation)."""
    out = []
    for line in hlo_text.splitlines():
        m = _COLLECTIVE.search(line)
        if not m or m.group(2) != kind:
            continue
        listed = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", line)
        runs = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[(\d+)\](?!T)", line)
        if listed:
            out.append([[int(d) for d in grp.split(",") if d] for grp in re.findall(r"\{([\d,]*)\}", listed.group(1))])
        elif runs:
            count, size = int(runs.group(1)), int(runs.group(2))
            out.append([list(range(i * size, (i + 1) * size)) for i in range(count)])
        else:
            out.append(None)
    return out


def hlo_collective_bytes(hlo_text: str, n: int, skip_scope: str | tuple[str, ...] = ()) -> dict[str, float]:
    """Bytes one device sends to others per collective kind, from the compiled HLO.

    all-to-all / all-gather: (N-1)/N of the result; all-reduce: 2(N-1)/N of it (ring);
    reduce-scatter: (N-1) times the result; N the collective's replica group size (``n`` when
    it spans every device). Collectives traced under the named scopes ``skip_scope`` (the
    overflow rounds; the dynamic tables' resolution, whose paths are branches of which a step
    takes one) are left out.
    """
    skip = (skip_scope,) if isinstance(skip_scope, str) else tuple(skip_scope)
    out: dict[str, float] = {}
    for line in hlo_text.splitlines():
        m = _COLLECTIVE.search(line)
        if not m:
            continue
        shapes = [(t, [int(d) for d in dims.split(",") if d]) for t, dims in _SHAPE.findall(m.group(1))]
        if any(f"/{scope}/" in line for scope in skip):
            continue
        size = sum(_DTYPE_BYTES.get(t, 4) * int(np.prod(s)) for t, s in shapes)
        g = _group_size(line, n)
        factor = {
            "all-to-all": (g - 1) / g,
            "all-gather": (g - 1) / g,
            "all-reduce": 2 * (g - 1) / g,
            "reduce-scatter": g - 1,
            "collective-permute": 1,
        }[m.group(2)]
        out[m.group(2)] = out.get(m.group(2), 0.0) + factor * size
    return out


def time_steps(fn, state, inputs: list[tuple], steps: int, warmup: int = 3) -> tuple[list[float], object, list]:
    """Seconds of each ``state, out, ... = fn(state, *inputs[i % len(inputs)])`` after
    ``warmup`` untimed calls, each call timed to completion; returns (seconds, final state, the
    outs). A train step's third result (the rows it evicted from device caches) is dropped."""
    for i in range(warmup):
        state = fn(state, *inputs[i % len(inputs)])[0]
    jax.block_until_ready(state)
    times, outs = [], []
    for i in range(steps):
        t = time.perf_counter()
        state, out = jax.block_until_ready(fn(state, *inputs[i % len(inputs)]))[:2]
        times.append(time.perf_counter() - t)
        outs.append(out)
    return times, state, outs


def each_case(cases: Iterable[T]) -> Iterator[T]:
    """``cases`` in turn, a suite's cases (or rounds): a stop signal kept while one ran ends
    the suite before the next (``dlrm-jax bench`` keeps a stop until then: raised while jaxlib
    compiles, its exit crashed the process; see :mod:`dlrm_jax.stopping`)."""
    for case in cases:
        stopping.raise_if_stopped()
        yield case


def round_robin(variants: list[dict], steps: int, repeats: int) -> None:
    """Times each variant (``fn``, ``state``, ``inputs``) in ``repeats`` chunks of ``steps``,
    the variants taking turns, so that a machine whose speed drifts slows them alike. Adds
    ``times`` (seconds of every timed step) and ``outs`` to each; ``step_ms``: the median."""
    for v in variants:
        v["times"], v["outs"] = [], []
    for _ in each_case(range(repeats)):
        for v in variants:
            times, v["state"], outs = time_steps(v["fn"], v["state"], v["inputs"], steps, warmup=1)
            v["times"] += times
            v["outs"] += outs
    for v in variants:
        v["step_ms"] = 1e3 * statistics.median(v["times"])
