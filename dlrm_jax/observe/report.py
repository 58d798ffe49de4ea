"""``dlrm-jax report``: PNG plots of one or more runs' ``metrics.jsonl``, on shared axes.

Every figure draws each run as one line (or one bar group), so a single-host and a multi-host
run, or two strategies, compare at a glance. The plotted numbers are metrics.jsonl's own:
:func:`figures` returns the matplotlib figures, which tests read back.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from dlrm_jax.files import make_dir

FIGURES = ("loss", "eval", "throughput", "phases", "divergence")


def load_run(run_dir: Path) -> dict:
    """``{"events": [...], "profile": {...} | None, "batch": int | None}`` of a run dir (a
    training run's, or a ``dlrm-jax profile`` dir with only profile.json); a clear error
    without anything to read (neither file, an empty metrics.jsonl without a profile.json, or a
    line that is not a JSON object). ``batch``: train.batch_size from its config.yaml."""
    path, profile = run_dir / "metrics.jsonl", run_dir / "profile.json"
    if not path.exists() and not profile.exists():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a run directory (or a profile's)?")
    events = []
    text = path.read_text(encoding="utf-8-sig") if path.exists() else ""
    lines = text.splitlines()
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                event = json.loads(line)
            except json.JSONDecodeError as e:
                if number == len(lines) and not text.endswith("\n"):
                    break  # a last line cut by a crash, or still being written: the run goes on
                raise ValueError(f"{path}:{number}: not a JSON object ({e.msg})") from None
            if not isinstance(event, dict):
                raise ValueError(f"{path}:{number}: not a JSON object (got {line.strip()[:40]})")
            events.append(event)
    if not events and not profile.exists():
        raise ValueError(
            f"{path} is empty: the run logged no events yet (the first comes after train.log_every "
            f"steps); nothing to plot"
        )
    batch = None
    config = run_dir / "config.yaml"
    if config.exists():
        import yaml

        try:
            batch = int(yaml.safe_load(config.read_text())["train"]["batch_size"])
        except (yaml.YAMLError, KeyError, TypeError, ValueError):
            batch = None
    # Samples seen, so that runs of different batch sizes compare on one axis: each log event
    # gives the batch size of the steps it covers (a resumed run may have changed it; events
    # written before they said so: the config's).
    seen, last = 0, 0
    for e in events:
        size = e.get("batch_size") or batch
        if not size or not isinstance(e.get("step"), int):
            continue
        if e["step"] > last:
            seen, last = seen + (e["step"] - last) * size, e["step"]
        e.setdefault("samples", seen)
    batch = batch or next((e["batch_size"] for e in events if e.get("batch_size")), None)
    return {"events": events, "profile": json.loads(profile.read_text()) if profile.exists() else None, "batch": batch}


def summary(run: dict, label: str) -> str:
    """One line per run: its best evaluation (AUC, its step), its median samples/s and, with
    progressive validation, the mean AUC of the last half of its windows."""
    evals = [e for e in run["events"] if e.get("event") == "eval" and e.get("auc") is not None]
    rates = sorted(e["samples_per_s"] for e in run["events"] if e.get("samples_per_s"))
    best = max(evals, key=lambda e: e["auc"]) if evals else None
    parts = [f"{label}:"]
    if best:
        logloss = best.get("logloss")  # (null where it was not finite)
        parts.append(
            f"best AUC {best['auc']:.4f} at step {best['step']:,} (logloss "
            + (f"{logloss:.4f})" if logloss is not None else "not finite)")
        )
    else:
        parts.append("no evaluation with an AUC")
    if rates:
        parts.append(
            f"median {statistics.median(rates):,.0f} samples/s over {len(rates)} window{'s' * (len(rates) > 1)}"
        )
    windows = [e["progressive_auc"] for e in run["events"] if e.get("event") == "progressive"]
    if windows:  # train.progressive_window: each window scored before training on it
        last = windows[len(windows) // 2 :]
        scored = [a for a in last if a is not None]  # (null: a window of one class has no AUC)
        unscored = f"; {len(last) - len(scored)} without an AUC, of one class only" if len(scored) < len(last) else ""
        mean = f"{sum(scored) / len(scored):.4f}" if scored else "none"
        parts.append(f"progressive AUC {mean} (mean of the last {len(last)} of {len(windows)} windows{unscored})")
    return f"{parts[0]} {'; '.join(parts[1:])}"


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


AXIS_LABELS = {
    "step": "step",
    "samples": "samples seen",
    "wall_s": "wall time (s)",
    "loss": "loss",
    "auc": "AUC",
    "logloss": "logloss",
    "samples_per_s": "samples/s",
    "table_divergence": "relative norm of the hosts' difference",
}


def _at(x: str, value: float) -> str:
    """Where on the x axis, in words: 'step 1,000', '512,000 samples', '93 s'."""
    if x == "wall_s":
        return f"{value:,.0f} s"
    return f"{value:,} samples" if x == "samples" else f"{AXIS_LABELS.get(x, x)} {value:,}"


def figures(run_dirs: list[Path]) -> dict:
    """name -> matplotlib Figure, for the figures that any of the runs has data for. Curves
    run along samples seen when every run's config gives its batch size (else steps); the best
    evaluation of each run is marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dirs = list({Path(p).resolve(): Path(p) for p in run_dirs}.values())  # each run once
    runs = [load_run(p) for p in run_dirs]
    labels = run_labels(run_dirs)
    along = "samples" if all(r["batch"] for r in runs if r["events"]) else "step"  # (a profile has no events)
    out = {}

    def lines(
        name: str, panels: list[tuple[str, str, str | None]], title: str, columns: int = 2, from_zero: bool = False
    ):
        """One figure of the panels (y, x, event kind) some run has data for, in a grid; a
        legend in every panel."""
        panels = [(y, x, k) for y, x, k in panels if any(series(r["events"], y, x, k)[0] for r in runs)]
        if not panels:
            return
        rows = -(-len(panels) // columns)
        cols = min(columns, len(panels))
        fig, axes = plt.subplots(rows, cols, figsize=(6.2 * cols, 4.4 * rows), squeeze=False)
        for ax, (y, x, kind) in zip(axes.flat, panels, strict=False):
            for run, label in zip(runs, labels, strict=True):
                xs, ys = series(run["events"], y, x, kind)
                if not xs:
                    continue
                (line,) = ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=label)
                if y in ("auc", "logloss"):  # the best evaluation (by AUC), where keep-best would keep it
                    at, aucs = series(run["events"], "auc", x, kind)  # (an AUC may be null: not a point)
                    best = at[max(range(len(aucs)), key=aucs.__getitem__)] if aucs else None
                    if best not in xs:
                        continue
                    i = xs.index(best)
                    ax.plot(
                        [xs[i]],
                        [ys[i]],
                        marker="*",
                        markersize=13,
                        color=line.get_color(),
                        label=f"{label} best (at {_at(x, xs[i])})",
                    )
            ax.set_xlabel(AXIS_LABELS.get(x, x))
            ax.set_ylabel(AXIS_LABELS.get(y, y))
            if from_zero:
                ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        for ax in list(axes.flat)[len(panels) :]:
            ax.set_visible(False)
        fig.suptitle(title)
        fig.tight_layout()
        out[name] = fig

    lines("loss", [("loss", along, None), ("loss", "wall_s", None)], "training loss (mean over each log window)")
    evals = [
        ("auc", along, "eval"),
        ("logloss", along, "eval"),
        ("auc", "wall_s", "eval"),
        ("logloss", "wall_s", "eval"),
    ]
    lines("eval", evals, "evaluation")  # a full 2 x 2 grid: no empty panel
    lines("throughput", [("samples_per_s", along, None)], "training throughput", from_zero=True)
    lines("divergence", [("table_divergence", along, None)], "per-host tables: relative norm of their difference")
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
        raise ValueError(
            f"nothing to plot: no loss, eval, throughput or profile figures in {', '.join(str(p) for p in run_dirs)}"
        )
    make_dir(output, "report folder")
    written = []
    for name, fig in drawn.items():
        path = output / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
