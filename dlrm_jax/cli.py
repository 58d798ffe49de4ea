"""``dlrm-jax``: argument parsing and dispatch, nothing else.

The config is loaded and validated before JAX is imported, so a bad key fails in milliseconds
and ``mesh.devices`` can still shape the simulated CPU devices.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys
import threading
from pathlib import Path

from dlrm_jax import hostmem
from dlrm_jax.config import Config, ConfigError, load_config
from dlrm_jax.files import check_dir
from dlrm_jax.parallel.mesh import SIMULATED_DEVICES_DEFAULT, request_cpu_devices


def _int_at_least(low: int):
    """An argparse type: an integer >= ``low`` (argparse names the flag in its error)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        return value

    return parse


def _list_of(kind: type, low: float | None = None):
    """An argparse type: comma-separated values of ``kind`` (each >= ``low`` if given)."""
    what = {int: "integers", float: "numbers"}[kind]

    def parse(text: str) -> list:
        try:
            values = [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}") from None
        if not values:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}")
        if low is not None and min(values) < low:
            raise argparse.ArgumentTypeError(f"expected values >= {low}, got {text!r}")
        return values

    return parse


POSITIVE, COUNT = _int_at_least(1), _int_at_least(0)  # steps and repeats; warmups and caps


def _add_config_args(p: argparse.ArgumentParser, config_required: bool = False) -> None:
    p.add_argument("--config", required=config_required,
                   help="YAML file (or a name from configs/, e.g. criteo_kaggle); default: the embedded default")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set train.steps=100 (repeatable)")


def _add_distributed_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("multi-process (one process per host)")
    g.add_argument("--coordinator", help="host:port of process 0 for jax.distributed")
    g.add_argument("--num-processes", type=int)
    g.add_argument("--process-id", type=int)
    g.add_argument("--join-timeout", type=int, default=300, metavar="S",
                   help="seconds to wait for every process to join before exiting with one line (default 300)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dlrm-jax", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a model (resumes from --run-dir's newest checkpoint)")
    _add_config_args(train)
    train.add_argument("--run-dir", help="where config, plan, metrics and checkpoints go (default: runs/<time>)")
    _add_distributed_args(train)

    ev = sub.add_parser("eval", help="evaluate a checkpoint of a run (default: the newest)")
    ev.add_argument("--run-dir", required=True)
    ev.add_argument("--step", type=_step_arg, help="the checkpoint to evaluate: a step, or 'best' (train.keep_best's); "
                    "default: the newest intact")
    ev.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    _add_distributed_args(ev)

    ex = sub.add_parser("export", help="write a run's tables (values and optimizer state) as tensorstore arrays")
    ex.add_argument("--run-dir", required=True)
    ex.add_argument("--output", required=True, help="folder for OUTPUT/<table>/<field> zarr3 arrays")
    ex.add_argument("--step", type=_step_arg,
                    help="the checkpoint to export: a step, or 'best' (train.keep_best's); default: the newest intact")
    ex.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")

    plan = sub.add_parser("plan", help="print the embedding sharding plan without training")
    _add_config_args(plan)

    pre = sub.add_parser("preprocess", help="convert raw data to memory-mappable binary arrays")
    pre_sub = pre.add_subparsers(dest="dataset", required=True)
    criteo = pre_sub.add_parser("criteo", help="Criteo Kaggle / Terabyte TSV")
    criteo.add_argument("--input", nargs="+", required=True, help="raw TSV file(s), plain or .gz, in time order")
    criteo.add_argument("--multi-hot", metavar="SIZES",
                        help="materialise MLPerf DLRM-DCNv2's multi-hot bags: 'mlperf' or 26 comma-separated bag sizes")
    criteo.add_argument("--block-mb", type=float, default=64.0, help="MB of text a worker parses at a time")
    _add_preprocess_args(criteo, chunk_lines=0)
    tab = pre_sub.add_parser("tabular", help="CSV / JSON-lines files described by a schema (MovieLens, Avazu, ...)")
    tab.add_argument("--schema", required=True,
                     help="schema YAML, or a shipped one: movielens_1m, avazu, taobao_ad, yelp_reviews")
    tab.add_argument("--input", nargs="+", required=True, help="the main file(s), in time order (.gz is read too)")
    tab.add_argument("--join", action="append", default=[], metavar="NAME=PATH",
                     help="the side file of the schema's join NAME (repeatable)")
    _add_preprocess_args(tab, chunk_lines=100_000)

    prof = sub.add_parser("profile", help="time per phase of a few train steps, peak memory, and a trace")
    _add_config_args(prof)
    prof.add_argument("--steps", type=POSITIVE, default=10, help="traced steps")
    prof.add_argument("--warmup", type=COUNT, default=3, help="untraced steps after compilation")
    prof.add_argument("--run-dir", help="where profile.json and trace/ go (default: runs/profile-<time>); "
                      "a training run's dir adds its phase bars to `dlrm-jax report`")
    _add_distributed_args(prof)

    rep = sub.add_parser("report", help="PNG plots of runs' metrics.jsonl (and profile.json), on shared axes")
    rep.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    rep.add_argument("--output", help="folder for the PNG files (default: FIRST_RUN_DIR/report)")

    bench = sub.add_parser("bench", help="benchmarks; results as JSON")
    bench_sub = bench.add_subparsers(dest="suite", required=True)
    bt = bench_sub.add_parser("train", help="train-step samples/s of several configs, side by side")
    bt.add_argument("--configs", default="default,criteo_kaggle",
                    help="comma-separated config names or files")
    bt.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="applied to every config")
    bt.add_argument("--steps", type=POSITIVE, default=30, help="timed steps per config")
    bt.add_argument("--warmup", type=COUNT, default=5, help="untimed steps after compilation")
    bt.add_argument("--max-rows", type=COUNT, default=200_000,
                    help="cap tables at this many rows; a config's own tighter cap stays (0: no change)")
    bt.add_argument("--output", help="write the JSON here too")
    bi = bench_sub.add_parser("input", help="input pipeline samples/s (binary, synthetic) beside the train step's")
    _add_config_args(bi)
    bi.add_argument("--steps", type=POSITIVE, default=30, help="batches timed through the pipeline per case")
    bi.add_argument("--step-steps", type=POSITIVE, default=5, help="timed train steps for the step-only figure")
    bi.add_argument("--output", help="write the JSON here too")
    be = bench_sub.add_parser("embedding", help="embedding step of every strategy vs XLA baselines")
    _add_config_args(be)
    be.add_argument("--strategies", default="replicated,table,row,column,auto")
    be.add_argument("--steps", type=POSITIVE, default=20, help="timed steps per variant")
    be.add_argument("--max-rows", type=COUNT, default=100_000,
                    help="cap tables at this many rows; a config's own tighter cap stays (0: no change)")
    be.add_argument("--output", help="write the JSON here too")
    bt2 = bench_sub.add_parser("tiers", help="tiered tables at several device-cache sizes vs all on the devices")
    _add_config_args(bt2)
    bt2.add_argument("--fractions", type=_list_of(float), default=[1.0, 0.5, 0.2, 0.1, 0.05],
                     help="device cache, fractions of each owner's rows (default 1.0,0.5,0.2,0.1,0.05)")
    bt2.add_argument("--lookaheads", type=_list_of(int, 0), default=[0, 4],
                     help="batches planned ahead, comma-separated (default 0,4)")
    bt2.add_argument("--zipf", type=float, default=1.1)
    bt2.add_argument("--layout", default="frequency_ordered", choices=["permuted", "frequency_ordered"])
    bt2.add_argument("--warmup", type=COUNT, default=30, help="untimed steps per variant first (the caches fill)")
    bt2.add_argument("--steps", type=POSITIVE, default=10, help="timed steps per variant and repeat")
    bt2.add_argument("--repeats", type=POSITIVE, default=3, help="alternating timed chunks per variant")
    bt2.add_argument("--large-gb", type=float, default=0.0,
                     help="one more case with the tables scaled to about this many GB on disk (0: none)")
    bt2.add_argument("--large-fraction", type=float, default=0.01, help="the large case's device cache fraction")
    bt2.add_argument("--large-host-fraction", type=float, default=0.05, help="the large case's DRAM cache fraction")
    bt2.add_argument("--tier-dir", help="create the disk tiers here (default: a temporary folder)")
    bt2.add_argument("--output", help="write the JSON here too")
    bh = bench_sub.add_parser("hot", help="hot-row replication vs none on skewed ids, both id and row layouts")
    _add_config_args(bh)
    bh.add_argument("--zipf", type=_list_of(float), default=[1.05, 1.1, 1.2],
                    help="Zipf exponents, comma-separated (default 1.05,1.1,1.2)")
    bh.add_argument("--layouts", default="permuted,frequency_ordered")
    bh.add_argument("--row-layouts", default="block,cyclic")
    bh.add_argument("--steps", type=POSITIVE, default=10, help="timed steps per variant and repeat")
    bh.add_argument("--repeats", type=POSITIVE, default=3, help="alternating timed chunks per variant")
    bh.add_argument("--max-rows", type=COUNT, default=0,
                    help="cap tables at this many rows; a config's own tighter cap stays (0: no change)")
    bh.add_argument("--output", help="write the JSON here too")
    bm = bench_sub.add_parser("mlp-parallel", help="dense layers data vs tensor vs pipeline parallel, side by side")
    bm.add_argument("--configs", default="criteo_kaggle,mlperf_dlrm_v1", help="configs whose dense parts are compared")
    bm.add_argument("--modes", default="data,tensor,pipeline")
    bm.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="applied to every config (default: mesh.model=2, train.batch_size=2048, "
                         "data.max_rows=1000)")
    bm.add_argument("--steps", type=POSITIVE, default=5, help="timed steps per variant and repeat")
    bm.add_argument("--repeats", type=POSITIVE, default=3, help="alternating timed chunks per variant")
    bm.add_argument("--output", help="write the JSON here too")
    bc = bench_sub.add_parser("collectives", help="all-to-all vs all-reduce bandwidth on the current devices")
    bc.add_argument("--devices", type=COUNT, default=0, help="devices in the mesh (0: all; 8 simulated on CPU)")
    bc.add_argument("--sizes-kib", type=_list_of(int, 1), default=[64, 1024, 16384],
                    help="buffer sizes per device, KiB, comma-separated (default 64,1024,16384)")
    bc.add_argument("--repeats", type=POSITIVE, default=10)
    bc.add_argument("--output", help="write the JSON here too")
    return parser


def _step_arg(text: str) -> int | str:
    """--step: a checkpoint's step, or 'best'."""
    if text == "best":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a step number or 'best', got {text!r}") from None


def _add_preprocess_args(p, chunk_lines: int) -> None:
    """What every `preprocess` dataset shares: output, ids, validation split, bad lines."""
    p.add_argument("--output", required=True, help="output directory")
    p.add_argument("--max-ind-range", type=int, default=0,
                   help="hash ids into this many rows per feature (0: build vocabularies)")
    p.add_argument("--min-count", type=int, default=1,
                   help="vocabulary mode: values seen fewer times share id 0 with missing values")
    p.add_argument("--vocab-from", choices=("train", "all"), default="train",
                   help="rows whose values are counted into ids: train (values seen only in validation "
                        "share id 0 with missing ones) or all (MLPerf's Terabyte numbering)")
    p.add_argument("--val-fraction", type=float,
                   help="the last fraction of rows becomes the validation split (default 0.1, or 0 with --val-input)")
    p.add_argument("--val-input", nargs="+", default=[], metavar="FILE",
                   help="whole files for the validation split (MLPerf's Terabyte split: day_23)")
    p.add_argument("--skip-bad-lines", action="store_true", help="skip malformed lines and count them instead of failing")
    p.add_argument("--no-shuffle", action="store_true", help="keep the train rows in input order")
    p.add_argument("--seed", type=int, default=0, help="seed of the global shuffle of the train rows")
    p.add_argument("--shard-mb", type=float, default=1024.0, help="size of an output shard (a host reads its own)")
    p.add_argument("--workers", type=int, default=0, help="worker processes (default: one per core)")
    if chunk_lines:
        p.add_argument("--chunk-lines", type=int, default=chunk_lines)
    p.add_argument("--no-progress", action="store_true")


def _devices_for(cfg: Config) -> int:
    return cfg.mesh.devices or SIMULATED_DEVICES_DEFAULT


def _start_jax(devices: int, args) -> None:
    """Shape the CPU backend and join the distributed runtime; imports JAX."""
    processes = getattr(args, "num_processes", None) or 1
    request_cpu_devices(max(1, devices // processes))  # simulated devices of this process
    from dlrm_jax.parallel.mesh import initialize_distributed

    initialize_distributed(getattr(args, "coordinator", None), getattr(args, "num_processes", None),
                           getattr(args, "process_id", None), join_timeout_s=getattr(args, "join_timeout", 300))


def _library_logs_to(run_dir: Path) -> None:
    """Send the libraries' own logging (orbax's absl logger) to ``run_dir/dlrm-jax.log``: their
    multi-line reports of a failure we already report in one line stay out of the terminal.
    Every command with a run dir calls this (the others use no library that logs through
    absl); a run dir that cannot be written (read-only, another user's) gets no log, and the
    libraries' messages are dropped rather than printed."""
    import logging

    import jax

    check_dir(run_dir, "run dir")  # a file in the way is named; an unwritable dir only loses the log
    index = jax.process_index()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(run_dir / ("dlrm-jax.log" if index == 0 else f"dlrm-jax.{index}.log"))
    except OSError:
        handler = logging.NullHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    absl = logging.getLogger("absl")
    absl.addHandler(handler)
    absl.propagate = False


def _log(msg: str) -> None:
    print(msg, flush=True)


def cmd_train(args) -> int:
    cfg = load_config(args.config, args.overrides)
    _start_jax(_devices_for(cfg), args)
    from dlrm_jax.train.rundir import agree_on_run_dir
    from dlrm_jax.train.trainer import Interrupted, train_and_evaluate

    run_dir = Path(agree_on_run_dir(args.run_dir))  # every process: the same directory
    _log(f"run dir: {run_dir}")
    _library_logs_to(run_dir)
    try:
        summary = train_and_evaluate(cfg, run_dir, log=_log)
    except Interrupted as e:
        saved = f"checkpoint saved in {run_dir}; re-run the same command to resume" if e.saved else "nothing saved"
        print(f"dlrm-jax: {e}; {saved}", file=sys.stderr, flush=True)
        return 128 + e.signum
    if summary.best is not None:  # the best evaluation, then the last (the contract's final line)
        print(summary.best_line(), flush=True)
    print(summary.final_line(), flush=True)
    return 0


def cmd_eval(args) -> int:
    cfg_path = Path(args.run_dir) / "config.yaml"
    if not cfg_path.exists():
        raise ConfigError(f"{cfg_path} does not exist: is {args.run_dir} a run directory?")
    cfg = load_config(cfg_path, args.overrides)
    _start_jax(_devices_for(cfg), args)
    _library_logs_to(Path(args.run_dir))
    from dlrm_jax.train.trainer import evaluate_run

    summary = evaluate_run(args.run_dir, args.overrides, step=args.step, log=_log)
    print(f"eval step={summary.step} auc={summary.auc:.6f} logloss={summary.logloss:.6f}", flush=True)
    return 0


def cmd_export(args) -> int:
    cfg_path = Path(args.run_dir) / "config.yaml"
    if not cfg_path.exists():
        raise ConfigError(f"{cfg_path} does not exist: is {args.run_dir} a run directory?")
    _start_jax(_devices_for(load_config(cfg_path, args.overrides)), args)
    _library_logs_to(Path(args.run_dir))
    from dlrm_jax.train.export import export_run

    step = export_run(args.run_dir, args.output, args.overrides, args.step, log=_log)
    print(f"exported step={step} to {args.output}", flush=True)
    return 0


def cmd_plan(args) -> int:
    cfg = load_config(args.config, args.overrides)
    from dlrm_jax.embedding.plan.planner import (
        config_plan_report,
        host_plan_from_config,
    )

    hosts = cfg.mesh.hosts or 1
    plan = host_plan_from_config(cfg, _devices_for(cfg), hosts)
    if cfg.embedding.tables_per_host:
        print(f"embedding.sync={cfg.embedding.sync}: every host holds its own set of tables; the plan of one "
              f"host's {plan.num_devices} devices (mesh.hosts={hosts}; 0 is one host per process, planned as 1)")
    if cfg.embedding.hot.rows == 0 and not plan.tiered_tables:
        # Planning needs only the config: no devices, no arrays, no JAX.
        print(config_plan_report(cfg, plan))
        return 0
    # Hot rows are chosen from the data, priced with the engine's own bucket measurement;
    # tiered tables' fill sizes and hit rates are predicted from the first batches.
    _start_jax(_devices_for(cfg), args)
    from dlrm_jax.data.sources import make_source, resolve_data_config
    from dlrm_jax.train.build import build, mesh_from_config

    cfg = resolve_data_config(cfg)
    plan, _ = build(cfg, mesh_from_config(cfg), make_source(cfg), log=_log)
    print(config_plan_report(cfg, plan))
    return 0


def cmd_preprocess(args) -> int:
    val_fraction = args.val_fraction if args.val_fraction is not None else 0.0 if args.val_input else 0.1
    if args.val_input and val_fraction:
        raise ConfigError("--val-input and --val-fraction: give one (the val split is whole files or a fraction)")
    common = dict(max_ind_range=args.max_ind_range, min_count=args.min_count, vocab_from=args.vocab_from,
                  val_fraction=val_fraction, val_inputs=args.val_input, skip_bad_lines=args.skip_bad_lines,
                  workers=args.workers,
                  shuffle_seed=None if args.no_shuffle else args.seed, shard_mb=args.shard_mb,
                  progress=not args.no_progress)
    if args.dataset == "tabular":
        from dlrm_jax.data.tabular import preprocess_tabular

        joins = dict(j.partition("=")[::2] for j in args.join)
        if any(not name or not path for name, path in joins.items()) or len(joins) < len(args.join):
            raise ConfigError(f"--join: expected distinct NAME=PATH values, got {args.join}")
        report = preprocess_tabular(args.schema, args.input, args.output, joins=joins,
                                    chunk_lines=args.chunk_lines, **common)
    else:
        from dlrm_jax.data.criteo_preprocess import preprocess_criteo

        report = preprocess_criteo(args.input, args.output, multi_hot=_bag_sizes(args.multi_hot),
                                   block_mb=args.block_mb, **common)
    print(report.summary(), flush=True)
    return 0


def _bag_sizes(text: str | None) -> tuple[int, ...] | None:
    """--multi-hot: 'mlperf' or comma-separated bag sizes."""
    if not text:
        return None
    if text == "mlperf":
        from dlrm_jax.data.multihot import MLPERF_DCNV2_BAG_SIZES

        return MLPERF_DCNV2_BAG_SIZES
    try:
        sizes = tuple(int(b) for b in text.split(","))
    except ValueError:
        raise ConfigError(f"--multi-hot: expected 'mlperf' or comma-separated integers, got {text!r}") from None
    if len(sizes) != 26 or min(sizes) < 1:
        raise ConfigError(f"--multi-hot: expected 26 bag sizes >= 1, got {len(sizes)}: {text!r}")
    return sizes


def cmd_profile(args) -> int:
    cfg = load_config(args.config, args.overrides)
    # XLA:CPU records one trace event per executed operation only when asked, before it starts.
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_cpu_enable_xprof_traceme=true".strip()
    _start_jax(_devices_for(cfg), args)
    from dlrm_jax.bench.profile import profile
    from dlrm_jax.train.rundir import agree_on_run_dir

    if args.run_dir:
        run_dir = Path(args.run_dir)
    else:  # runs/profile-<time>, the same on every process
        agreed = Path(agree_on_run_dir(None))
        run_dir = agreed.with_name(f"profile-{agreed.name}")
    _library_logs_to(run_dir)
    profile(cfg, run_dir, steps=args.steps, warmup=args.warmup, log=_log)
    return 0


def cmd_report(args) -> int:
    from dlrm_jax.observe.report import write_report

    run_dirs = [Path(p) for p in args.run_dirs]
    output = Path(args.output) if args.output else run_dirs[0] / "report"
    for path in write_report(run_dirs, output):
        print(f"wrote {path}", flush=True)
    return 0


def _tighten_cap(cfg: Config, max_rows: int) -> Config:
    import dataclasses

    own = cfg.data.max_rows
    cap = own if not max_rows else (min(own, max_rows) if own else max_rows)
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, max_rows=cap))


def cmd_bench(args) -> int:
    if args.suite == "collectives":
        _start_jax(args.devices or SIMULATED_DEVICES_DEFAULT, args)
        from dlrm_jax.bench.collectives import bench_collectives

        bench_collectives(args.devices, args.sizes_kib, args.repeats, args.output, log=_log)
        return 0
    if args.suite == "mlp-parallel":
        overrides = ["mesh.model=2", "train.batch_size=2048", "data.max_rows=1000", *args.overrides]
        configs = [c for c in args.configs.split(",") if c]
        _start_jax(max(_devices_for(load_config(c, overrides)) for c in configs), args)
        from dlrm_jax.bench.mlp_parallel import bench_mlp_parallel

        bench_mlp_parallel(configs, overrides, modes=[m for m in args.modes.split(",") if m], steps=args.steps,
                           repeats=args.repeats, output=args.output, log=_log)
        return 0
    if args.suite == "hot":
        cfg = _tighten_cap(load_config(args.config, args.overrides), args.max_rows)
        _start_jax(_devices_for(cfg), args)
        from dlrm_jax.bench.hot import bench_hot

        bench_hot(cfg, steps=args.steps, repeats=args.repeats, zipf=args.zipf,
                  layouts=[s for s in args.layouts.split(",") if s],
                  row_layouts=[s for s in args.row_layouts.split(",") if s], output=args.output, log=_log)
        return 0
    if args.suite == "tiers":
        _start_jax(_devices_for(load_config(args.config, args.overrides)), args)
        from dlrm_jax.bench.tiers import bench_tiers

        bench_tiers(args.config, args.overrides, steps=args.steps, repeats=args.repeats,
                    fractions=args.fractions, lookaheads=args.lookaheads, zipf=args.zipf,
                    layout=args.layout, warmup=args.warmup, output=args.output, large_gb=args.large_gb,
                    large_fraction=args.large_fraction, large_host_fraction=args.large_host_fraction,
                    tier_dir=args.tier_dir, log=_log)
        return 0
    if args.suite == "input":
        cfg = load_config(args.config, args.overrides)
        _start_jax(_devices_for(cfg), args)
        from dlrm_jax.bench.input import bench_input

        bench_input(cfg, steps=args.steps, step_steps=args.step_steps, output=args.output, log=_log)
        return 0
    if args.suite == "embedding":
        cfg = _tighten_cap(load_config(args.config, args.overrides), args.max_rows)
        _start_jax(_devices_for(cfg), args)
        from dlrm_jax.bench.embedding import bench_embedding

        bench_embedding(cfg, steps=args.steps, strategies=[s for s in args.strategies.split(",") if s],
                        output=args.output, log=_log)
        return 0
    names = [n for n in args.configs.split(",") if n]
    configs = [_tighten_cap(load_config(n, args.overrides), args.max_rows) for n in names]
    _start_jax(max(_devices_for(c) for c in configs), args)
    from dlrm_jax.bench.train import bench_train

    bench_train(dict(zip(names, configs, strict=True)), steps=args.steps, warmup=args.warmup,
                output=args.output, log=_log)
    return 0


COMMANDS = {"train": cmd_train, "eval": cmd_eval, "export": cmd_export, "plan": cmd_plan, "preprocess": cmd_preprocess,
            "bench": cmd_bench, "report": cmd_report,
            "profile": cmd_profile}


def run() -> int:
    """The ``dlrm-jax`` program: restarts itself once so that host memory (tables, and every
    buffer of simulated devices) gets transparent huge pages (:mod:`dlrm_jax.hostmem`), then
    runs :func:`main`. ``DLRM_JAX_HUGE_PAGES=0`` skips the restart."""
    env = hostmem.huge_pages_environment(dict(os.environ))
    if env is not None:
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, "-m", "dlrm_jax", *sys.argv[1:]], env)
    return main()


class _Stopped(KeyboardInterrupt):
    """SIGINT or SIGTERM outside the training loop (whose own handlers finish the step and save)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _stop(signum, frame):
    raise _Stopped(signum)


def _stop_on_signals() -> dict:
    """SIGTERM as SIGINT from the start (loading, compiling, restoring): one line and exit
    status 128 + signal, where SIGTERM's default action would end the process without a word.
    Returns the handlers to put back."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, _stop) for sig in (signal.SIGINT, signal.SIGTERM)}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # `kill -USR1 PID` prints every thread's Python stack to stderr: where a stuck run waits.
    try:
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    except (AttributeError, ValueError):  # no stderr file (main() called in an embedding process)
        pass
    handlers = _stop_on_signals()
    try:
        return COMMANDS[args.command](args)
    except ConfigError as e:
        print(f"dlrm-jax: config error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        signum = getattr(e, "signum", signal.SIGINT)
        print(f"dlrm-jax: stopped by {signal.Signals(signum).name}", file=sys.stderr)
        return 128 + signum
    except (ValueError, OSError, NotImplementedError, FloatingPointError) as e:
        if os.environ.get("DLRM_JAX_DEBUG"):
            raise
        print(f"dlrm-jax: error: {e}", file=sys.stderr)
        return 1
    except Exception as e:
        if type(e).__name__ != "JaxRuntimeError" or os.environ.get("DLRM_JAX_DEBUG"):
            raise
        # A collective failed under us: in a multi-process run, a peer died or disconnected.
        first = str(e).strip().splitlines()[0][:300]
        print(f"dlrm-jax: error: {first}; if another process died, the newest checkpoint is intact: "
              f"restart every process with the same command to resume", file=sys.stderr)
        return 1
    finally:
        for sig, old in handlers.items():
            signal.signal(sig, old)


if __name__ == "__main__":
    sys.exit(main())
