"""A ``jax.profiler`` trace of training steps as the run takes them (``train.trace_steps``),
read back into where each step's time went: the devices' kernels and copies, the dispatching
thread's calls and waits, and the input threads.

``dlrm-jax profile`` times the compiled step with its inputs ready; this traces the loop
itself, with its input pipeline, so a run that trains slower than its step shows whether the
devices wait for the host (idle between kernels) or the host for the devices. Host threads are
told apart by their operating-system names (:func:`~dlrm_jax.observe.threads.name_os_thread`):
the dispatching thread is the one that launches the train step. Python's own tracer is left
off: it records every call and would slow the threads it measures.
"""

from __future__ import annotations

import glob
from typing import NamedTuple

# Substring of the host events that launch the train step (jaxlib names them after the jitted
# function: "PjitFunction(jit(_train_step))"; on CPU each device's part also logs an execute).
TRAIN_STEP = "_train_step"
EVAL_STEP = "_eval_step"  # evaluations' and the state check's before a save
# Events on a GPU's stream lines that are copies, not kernels.
H2D, D2H = "MemcpyH2D", "MemcpyD2H"


class Event(NamedTuple):
    name: str
    start_ns: float
    duration_ns: float

    @property
    def end_ns(self) -> float:
        return self.start_ns + self.duration_ns


# plane name -> line name -> events (a line is a host thread, or one of a GPU's streams)
Planes = dict[str, dict[str, list[Event]]]


def trace_files(trace_dir: str) -> set[str]:
    """The ``.xplane.pb`` files under ``trace_dir`` (one a trace session: a resumed run's
    sessions share its run dir's folder)."""
    return set(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True))


def read_planes(path: str) -> Planes:
    """The host and GPU planes of the trace file ``path`` (:func:`trace_files`)."""
    from jax._src.lib import _profile_data

    planes: Planes = {}
    for plane in _profile_data.ProfileData.from_file(path).planes:
        if not (plane.name.startswith("/device:GPU") or plane.name == "/host:CPU"):
            continue
        lines = planes.setdefault(plane.name, {})
        for i, line in enumerate(plane.lines):
            name = line.name if line.name not in lines else f"{line.name} #{i}"  # threads may share a name
            lines[name] = [Event(e.name, e.start_ns, e.duration_ns) for e in line.events]
    return planes


def _merged(intervals: list[tuple[float, float]]) -> list[list[float]]:
    """``(start, end)`` intervals as disjoint ones, by start."""
    merged: list[list[float]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return merged


def union_ns(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    return sum(max(e - s, 0.0) for s, e in _merged(intervals))


def overlap_ns(intervals: list[tuple[float, float]], busy: list[tuple[float, float]]) -> float:
    """How much of ``intervals`` lies inside the union of ``busy``."""
    merged = _merged(busy)
    total = 0.0
    for s, e in intervals:
        for ms, me in merged:
            if me <= s:
                continue
            if ms >= e:
                break
            total += min(e, me) - max(s, ms)
    return total


def _clip(events: list[Event], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(e.start_ns, lo), min(e.end_ns, hi)) for e in events if e.end_ns > lo and e.start_ns < hi]


def outermost(events: list[Event]) -> list[Event]:
    """``events`` by start, less those inside an earlier one (a launch logs nested events)."""
    out: list[Event] = []
    for e in sorted(events, key=lambda e: e.start_ns):
        if not out or e.start_ns >= out[-1].end_ns:
            out.append(e)
    return out


def _launches_the_step(e: Event) -> bool:
    return TRAIN_STEP in e.name and "PjitFunction" in e.name


def dispatching_line(host: dict[str, list[Event]]) -> str | None:
    """The host thread that launched the most train steps (the trainer's dispatching thread)."""
    counts = {name: sum(map(_launches_the_step, ev)) for name, ev in host.items()}
    best = max(counts, key=counts.get, default=None)
    return best if best is not None and counts[best] else None


def summarize(planes: Planes, steps: int | None = None, threads: tuple[str, ...] = ("input", "hot", "tier")) -> dict:
    """Per step of the traced span (from the first train step's launch to the last's, or to
    the launch after ``steps`` steps, over the steps between; a step whose span holds an
    evaluation's launch, or the state check's before a save, left out): wall time; the dispatching
    thread's time in the step's launch (XLA's part of it); the devices' kernel time and idle
    share (GPUs: the union of each device's kernels, mean over devices), host-to-device copies
    and the share of them under kernels, device-to-host copies; and the time each host thread
    whose name starts with one of ``threads`` spent in traced XLA calls (the input threads'
    transfers: their Python and numpy are not traced)."""
    host = planes.get("/host:CPU", {})
    line = dispatching_line(host)
    if line is None:
        return {}
    outer = outermost([e for e in host[line] if "PjitFunction" in e.name])
    launches = [e for e in outer if _launches_the_step(e)]
    launches = launches if steps is None else launches[: steps + 1]
    if len(launches) < 2:
        return {}
    # A step is the span from its launch to the next; one holding an evaluation's launch (or
    # the state check's before a save) is not a train step's, and is left out.
    others = [e.start_ns for e in outer if EVAL_STEP in e.name]
    pairs = [
        (a, b)
        for a, b in zip(launches, launches[1:], strict=False)
        if not any(a.start_ns < t < b.start_ns for t in others)
    ]
    if not pairs:
        return {}
    spans = [(a.start_ns, b.start_ns) for a, b in pairs]
    wall = sum(hi - lo for lo, hi in spans)
    steps = len(spans)
    per_step = lambda ns: ns / 1e6 / steps
    within = lambda events: [iv for lo, hi in spans for iv in _clip(events, lo, hi)]
    out = {
        "trace_steps": steps,
        "trace_step_ms": per_step(wall),
        "trace_launch_ms": per_step(sum(a.duration_ns for a, _ in pairs)),
    }
    gpus = {p: lines for p, lines in planes.items() if p.startswith("/device:GPU")}
    if gpus:
        busy, h2d, h2d_hidden, d2h = [], [], [], []
        for lines in gpus.values():
            streams = [ev for name, ev in lines.items() if name.startswith("Stream")]
            kernels = [iv for ev in streams for iv in within([e for e in ev if "Memcpy" not in e.name])]
            copies_in = [iv for ev in streams for iv in within([e for e in ev if H2D in e.name])]
            busy.append(union_ns(kernels))
            h2d.append(sum(e - s for s, e in copies_in))
            h2d_hidden.append(overlap_ns(copies_in, kernels))
            d2h.append(
                sum(1 for ev in streams for e in ev if D2H in e.name and any(lo <= e.start_ns < hi for lo, hi in spans))
            )
        n = len(gpus)
        out["trace_device_busy_ms"] = per_step(sum(busy) / n)
        out["trace_device_idle_share"] = 1.0 - sum(busy) / n / wall
        out["trace_h2d_ms"] = per_step(sum(h2d) / n)
        out["trace_h2d_under_kernels_share"] = sum(h2d_hidden) / sum(h2d) if sum(h2d) else 0.0
        out["trace_d2h_per_step"] = sum(d2h) / n / steps
    out["trace_threads_xla_ms"] = {
        name: per_step(union_ns(within(ev)))
        for name, ev in sorted(host.items())
        if name != line and name.startswith(threads)
    }
    return out


def format_summary(summary: dict) -> str:
    """One line for the terminal."""
    if not summary:
        return "trace: no train steps in it"
    s = summary
    text = (
        f"trace of {s['trace_steps']} steps: {s['trace_step_ms']:.2f} ms a step, "
        f"{s['trace_launch_ms']:.2f} of it launching the step"
    )
    if "trace_device_busy_ms" in s:
        text += (
            f"; devices {s['trace_device_busy_ms']:.2f} ms in kernels ({s['trace_device_idle_share']:.0%} idle), "
            f"host-to-device {s['trace_h2d_ms']:.2f} ms ({s['trace_h2d_under_kernels_share']:.0%} under kernels)"
        )
    return text


class LoopTrace:
    """Traces train steps ``first`` to ``first + count - 1`` into ``trace_dir``: started before
    ``first`` is dispatched, stopped once the last traced step's results are read (its kernels
    are then in the trace), read back with :func:`summarize`."""

    def __init__(self, first: int, count: int, trace_dir: str):
        self.first, self.last, self.trace_dir = first, first + count - 1, trace_dir
        self.running, self._earlier = False, set()

    @staticmethod
    def first_step(start: int, end: int, count: int, log_every: int) -> int:
        """The first traced step of a run that trains steps ``start + 1`` to ``end``: the one
        after the first log window (``log_every``, or 10 without one), or as late as leaves
        ``count`` steps, never the first (it compiles)."""
        first = start + (log_every or 10) + 1
        return max(start + 2, min(first, end - count + 1))

    def before(self, step: int) -> None:
        """Before dispatching ``step``."""
        if step == self.first and not self.running:
            import jax

            options = jax.profiler.ProfileOptions()
            options.python_tracer_level = 0  # it records every Python call, slowing what it measures
            self._earlier = trace_files(self.trace_dir)  # (a resumed run's earlier sessions: not this one's)
            jax.profiler.start_trace(self.trace_dir, create_perfetto_trace=True, profiler_options=options)
            self.running = True

    def done(self, read_through: int) -> dict | None:
        """After the results of steps up to ``read_through`` were read: the summary, once the
        last traced step's are (else None)."""
        if not self.running or read_through < self.last:
            return None
        return self.stop()

    def stop(self, read: bool = True) -> dict | None:
        """Ends a running trace (a run that stops early) and reads it unless not ``read`` (a
        failed run: the profiler freed for the next one); None if none ran or unread."""
        if not self.running:
            return None
        import jax

        jax.profiler.stop_trace()
        self.running = False
        if not read:
            return None
        (path,) = trace_files(self.trace_dir) - self._earlier
        return summarize(read_planes(path), self.last - self.first + 1)
