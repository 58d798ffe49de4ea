"""``dlrm-jax report``: PNG plots of one or more runs' ``metrics.jsonl``, on shared axes.

Every figure draws each run as one line (or one bar group), so a single-host and a multi-host
run, or two strategies, compare at a glance. The plotted numbers are metrics.jsonl's own:
:func:`figures` returns the matplotlib figures, which tests read back.
"""

from __future__ import annotations

import json
from pathlib import Path

from dlrm_jax.files import make_dir

FIGURES = ("loss", "eval", "throughput", "phases", "divergence")


def load_run(run_dir: Path) -> dict:
    """``{"events": [...], "profile": {...} | None}`` of a run dir; a clear error without metrics
    (no file, an empty one without a profile.json, or a line that is not a JSON object)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a run directory?")
    events = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                event = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not a JSON object ({e.msg})") from None
            if not isinstance(event, dict):
                raise ValueError(f"{path}:{number}: not a JSON object (got {line.strip()[:40]})")
            events.append(event)
    profile = run_dir / "profile.json"
    if not events and not profile.exists():
        raise ValueError(f"{path} is empty: the run logged no events yet (the first comes after train.log_every "
                         f"steps); nothing to plot")
    return {"events": events, "profile": json.loads(profile.read_text()) if profile.exists() else None}


def run_labels(run_dirs: list[Path]) -> list[str]:
    """Each run's folder name, or its path where names repeat."""
    names = [p.name for p in run_dirs]
    return [n if names.count(n) == 1 else str(p) for n, p in zip(names, run_dirs, strict=True)]


def series(events: list[dict], y: str, x: str = "step", kind: str | None = None) -> tuple[list, list]:
    """(xs, ys) of the events that have ``y`` (of event type ``kind`` if given), one point per x
    (the last one logged there: a train and an eval event share a step)."""
    points = {}
    for e in events:
        if e.get(y) is not None and e.get(x) is not None and (kind is None or e.get("event") == kind):
            points[e[x]] = e[y]
    xs = sorted(points)
    return xs, [points[v] for v in xs]


def figures(run_dirs: list[Path]) -> dict:
    """name -> matplotlib Figure, for the figures that any of the runs has data for."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [load_run(Path(p)) for p in run_dirs]
    labels = run_labels([Path(p) for p in run_dirs])
    out = {}

    def lines(name: str, panels: list[tuple[str, str, str | None]], title: str):
        """One figure of side-by-side panels, each (y, x, event kind)."""
        if not any(series(r["events"], y, x, k)[0] for r in runs for y, x, k in panels):
            return
        fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2), squeeze=False)
        for ax, (y, x, kind) in zip(axes[0], panels, strict=True):
            for run, label in zip(runs, labels, strict=True):
                xs, ys = series(run["events"], y, x, kind)
                if xs:
                    ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=label)
            ax.set_xlabel({"step": "step", "wall_s": "wall time (s)"}[x])
            ax.set_ylabel(y)
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=8)
        fig.suptitle(title)
        fig.tight_layout()
        out[name] = fig

    lines("loss", [("loss", "step", None), ("loss", "wall_s", None)], "training loss (mean over each log window)")
    lines("eval", [("auc", "step", "eval"), ("auc", "wall_s", "eval"), ("logloss", "step", "eval")],
          "evaluation")
    lines("throughput", [("samples_per_s", "step", None)], "training throughput")
    lines("divergence", [("table_divergence", "step", None)],
          "per-host tables: relative norm of their difference")
    profiled = [(r["profile"], label) for r, label in zip(runs, labels, strict=True) if r["profile"]]
    if profiled:
        out["phases"] = _phase_bars(plt, profiled)
    return out


def _phase_bars(plt, profiled: list[tuple[dict, str]]):
    """Grouped horizontal bars: ms per step of each phase, one bar per profiled run."""
    phases = [p["name"] for p in profiled[0][0]["phases"]]
    for profile, _ in profiled[1:]:
        phases += [p["name"] for p in profile["phases"] if p["name"] not in phases]
    fig, ax = plt.subplots(figsize=(9, 0.5 + 0.45 * len(phases) * max(1, len(profiled) / 2)))
    height = 0.8 / len(profiled)
    for i, (profile, label) in enumerate(profiled):
        ms = {p["name"]: p["ms"] for p in profile["phases"]}
        ys = [j + i * height for j in range(len(phases))]
        ax.barh(ys, [ms.get(name, 0.0) for name in phases], height=height, label=label)
    ax.set_yticks([j + 0.4 - height / 2 for j in range(len(phases))], phases)
    ax.invert_yaxis()
    ax.set_xlabel("ms per step")
    ax.legend(fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    ax.set_title("time per phase (dlrm-jax profile)")
    fig.tight_layout()
    return fig


def write_report(run_dirs: list[Path], output: Path) -> list[Path]:
    """Draw :func:`figures` into ``output/<name>.png``; returns the files written (a ValueError
    when no run has anything to plot)."""
    import matplotlib.pyplot as plt

    drawn = figures(run_dirs)
    if not drawn:
        raise ValueError(f"nothing to plot: no loss, eval, throughput or profile figures in "
                         f"{', '.join(str(p) for p in run_dirs)}")
    make_dir(output, "report folder")
    written = []
    for name, fig in drawn.items():
        path = output / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
