"""``dlrm-jax bench stream``'s arguments and run (a suite of :mod:`dlrm_jax.cli.commands.bench`,
in a module of its own for its length): dynamic, hashed and first-window vocabulary ids
trained on a drifting stream or Criteo-format text in time order, scored window by window."""

from __future__ import annotations

from pathlib import Path

from dlrm_jax.bench import check_stream_config
from dlrm_jax.cli.args import COUNT, POSITIVE, add_config_args, add_json_output, bounded, names
from dlrm_jax.cli.runtime import devices_for, log, start_jax
from dlrm_jax.config import ConfigError, check_rows_or_fraction, load_config


def add_arguments(p) -> None:
    add_config_args(p)  # the model, the batch, the learning rates, the mesh, embedding.dynamic.*
    s = p.add_argument_group("the drifting stream (data/sources/drifting.py)")
    s.add_argument("--features", type=POSITIVE, default=8, help="categorical features (default 8)")
    s.add_argument("--windows", type=COUNT, default=12, help="time windows (default 12; 0 with --criteo: all)")
    s.add_argument("--window-samples", type=POSITIVE, default=65_536, help="samples per window (default 65536)")
    s.add_argument("--born", type=POSITIVE, default=20_000, help="new ids per feature and window (default 20000)")
    s.add_argument("--lifetime", type=POSITIVE, default=4, help="windows an id is seen in (default 4)")
    s.add_argument("--seed", type=COUNT, default=0, help="the stream's seed: its ids, effects and samples (default 0)")
    s.add_argument(
        "--criteo",
        metavar="FILES",
        help="instead of the synthetic stream, Criteo-format text (comma-separated files) read in order, "
        "--window-samples lines a window",
    )
    p.add_argument(
        "--rows",
        type=bounded(float, 0, strict=True),
        default=8192,
        help="rows per table, every case: a number, or a fraction (< 1) of each feature's distinct ids "
        "(default 8192; the maps' other settings: embedding.dynamic.*)",
    )
    p.add_argument(
        "--cases",
        type=names("dynamic", "hashed", "vocab"),
        default=["dynamic", "hashed", "vocab"],
        help="comma-separated, of dynamic, hashed, vocab (default: all)",
    )
    add_json_output(p)


def run(args) -> None:
    cfg = load_config(args.config or "stream", args.overrides)
    _check_args(args, cfg)
    start_jax(devices_for(cfg), args)
    from dlrm_jax.bench.stream import bench_stream
    from dlrm_jax.data.preprocessing.preprocess import SkipLog
    from dlrm_jax.data.sources import criteo_paths
    from dlrm_jax.data.sources.criteo import CriteoFormatError, criteo_windows
    from dlrm_jax.data.sources.drifting import DriftingStream

    if args.criteo:
        paths = criteo_paths(args.criteo)
        skipped = SkipLog(cfg.data.skip_bad_lines, CriteoFormatError)
        windows = criteo_windows(paths, args.window_samples, args.windows, skipped)
        if skipped.by_reason:
            log(skipped.summary())
        if len(windows) < 2:  # (it trained, then reported nan over no windows)
            raise ConfigError(
                f"--criteo {args.criteo}: holds {len(windows)} window of {args.window_samples:,} lines; the stream "
                f"needs at least 2 (each window is evaluated by the model trained on the ones before it): "
                f"use a smaller --window-samples or more lines"
            )
        if args.windows and len(windows) < args.windows:  # (0: as many as the files hold)
            log(
                f"note: --windows {args.windows}: --criteo holds {len(windows)} windows of {args.window_samples:,} lines"
            )
        about = {"criteo": paths}
    else:
        stream = DriftingStream(
            features=args.features,
            windows=args.windows,
            window_samples=args.window_samples,
            born_per_window=args.born,
            lifetime=args.lifetime,
            seed=args.seed,
        )
        windows = [stream.window(t) for t in range(stream.windows)]
        about = {k: getattr(stream, k) for k in stream.__dataclass_fields__}
    bench_stream(cfg, windows, args.rows, args.cases, output=args.output, about=about, log=log)


def _check_args(args, cfg) -> None:
    """One line for a stream that cannot be measured, before any work."""
    check_stream_config(cfg)
    check_rows_or_fraction(args.rows, f"--rows {args.rows:g}")
    if any(o.split("=")[0].strip() == "embedding.dynamic.rows" for o in args.overrides):  # (it was dropped)
        raise ConfigError(
            "embedding.dynamic.rows: bench stream gives every case's tables --rows rows (equal table memory "
            "for dynamic, hashed and vocabulary ids); pass --rows instead"
        )
    if args.window_samples < cfg.train.batch_size:
        raise ConfigError(
            f"--window-samples {args.window_samples}: a window needs at least one batch "
            f"(train.batch_size={cfg.train.batch_size})"
        )
    if args.windows == 1 or (args.windows == 0 and not args.criteo):
        raise ConfigError(
            f"--windows {args.windows}: at least 2 (each window is evaluated by the model trained on "
            f"the ones before it){'; 0 reads every window of --criteo' if not args.criteo else ''}"
        )
    from dlrm_jax.data.sources import criteo_paths  # (numpy only: no JAX before start_jax)

    for path in criteo_paths(args.criteo or ""):
        if not Path(path).is_file():
            raise ConfigError(f"--criteo {path}: no such file")
