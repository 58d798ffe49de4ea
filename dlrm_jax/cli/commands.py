"""What each ``dlrm-jax`` subcommand does: load and check the config (before JAX is imported,
so a bad key fails in milliseconds and ``mesh.devices`` can still shape the simulated CPU
devices), then call the library."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from dlrm_jax import stopping
from dlrm_jax.config import Config, ConfigError, load_config
from dlrm_jax.files import check_dir
from dlrm_jax.parallel.mesh import (
    MAX_SIMULATED_DEVICES,
    SIMULATED_DEVICES_DEFAULT,
    request_cpu_devices,
)


def _devices_for(cfg: Config) -> int:
    return cfg.mesh.devices or SIMULATED_DEVICES_DEFAULT


def _start_jax(devices: int, args, mesh_devices: int = 0) -> None:
    """Check the multi-process flags (``mesh_devices``: the config's mesh.devices, which they
    must split), shape the CPU backend and join the distributed runtime; imports JAX."""
    from dlrm_jax.parallel.coordination import check_processes, initialize_distributed

    flags = [getattr(args, k, None) for k in ("coordinator", "num_processes", "process_id")]
    check_processes(*flags, mesh_devices)
    request_cpu_devices(max(1, devices // (flags[1] or 1)))  # simulated devices of this process
    initialize_distributed(
        *flags, join_timeout_s=getattr(args, "join_timeout", 300), bind=getattr(args, "coordinator_bind", None)
    )
    _check_backend()


def _check_backend() -> None:
    """One line when JAX cannot start the platform asked for (JAX_PLATFORMS=cuda with a CPU-only
    jaxlib fails deep inside JAX with a bare AssertionError)."""
    import jax

    try:
        jax.devices()
    except (AssertionError, RuntimeError) as e:
        asked = os.environ.get("JAX_PLATFORMS", "")
        gpu = any(p in asked for p in ("cuda", "gpu"))
        how = (
            'this JAX has no CUDA backend: install the GPU build with `pip install -e ".[cuda12]"` '
            "(or unset JAX_PLATFORMS to train on the CPU)"
            if gpu
            else f"{type(e).__name__} {e}".strip()
        )
        raise ConfigError(f"JAX_PLATFORMS={asked or '(unset)'}: JAX could not start it; {how}") from None


def _library_logs_to(run_dir: Path) -> None:
    """Send the libraries' own logging (orbax's absl logger) to ``run_dir/dlrm-jax.log``: their
    multi-line reports of a failure we already report in one line stay out of the terminal.
    Every command with a run dir calls this (the others use no library that logs through
    absl); a run dir that cannot be written (read-only, another user's) gets no log, and the
    libraries' messages are dropped rather than printed."""
    import jax

    check_dir(run_dir, "run dir")  # a file in the way is named; an unwritable dir only loses the log
    index = jax.process_index()
    handler = _RunDirLog(run_dir / ("dlrm-jax.log" if index == 0 else f"dlrm-jax.{index}.log"))
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in ("absl", "asyncio"):  # asyncio: "Task exception was never retrieved" of a failed restore
        library = logging.getLogger(name)
        library.addHandler(handler)
        library.propagate = False


class _RunDirLog(logging.FileHandler):
    """A log file, and its run dir, made by the first message: a run that logs none leaves
    none, and a run refused before its run dir is made leaves no empty one. A file that cannot
    be written (read-only, another user's dir) loses the messages."""

    def __init__(self, path: Path):
        super().__init__(path, delay=True)

    def emit(self, record) -> None:
        try:
            Path(self.baseFilename).parent.mkdir(parents=True, exist_ok=True)
            super().emit(record)  # opens the file on the first message (delay)
        except OSError:
            pass


def _log(msg: str) -> None:
    print(msg, flush=True)


def cmd_train(args) -> int:
    cfg = load_config(args.config, args.overrides)
    from dlrm_jax.data.sources import check_data_path, resolve_data_config

    check_data_path(cfg)  # before a run dir exists: a mistake leaves nothing behind
    _start_jax(_devices_for(cfg), args, cfg.mesh.devices)
    import jax

    from dlrm_jax.parallel.mesh import check_available
    from dlrm_jax.train.checks import check_runnable
    from dlrm_jax.train.rundir import agree_on_run_dir
    from dlrm_jax.train.trainer import Interrupted, train_and_evaluate

    devices, cpu = cfg.mesh.devices or jax.device_count(), jax.default_backend() == "cpu"
    check_available(devices, jax.device_count(), jax.default_backend())
    cfg = resolve_data_config(cfg)  # binary data's features, checked against the config's
    check_runnable(cfg, devices, jax.process_count(), simulated=cpu)  # the plan command's checks, before a run dir
    run_dir = Path(agree_on_run_dir(args.run_dir))  # every process: the same directory
    _log(f"run dir: {run_dir}")
    _library_logs_to(run_dir)
    try:
        # Planning, restoring, compiling and the final evaluation compile: a stop signal there
        # waits for a point where nothing native is under way (see dlrm_jax.stopping).
        with stopping.deferred("the run's start"):
            summary = train_and_evaluate(cfg, run_dir, log=_log)
    except Interrupted as e:
        again = "re-run the same command" if args.run_dir else f"re-run the command with --run-dir {run_dir}"
        saved = f"checkpoint saved in {run_dir}; {again} to resume" if e.saved else "nothing saved"
        print(f"dlrm-jax: {e}; {saved}", file=sys.stderr, flush=True)
        return 128 + e.signum
    import jax

    if jax.process_index() == 0:  # every process holds the same summary: one copy for the reader
        if summary.best is not None:  # the best evaluation, then the last (the contract's final line)
            print(summary.best_line(), flush=True)
        print(summary.final_line(), flush=True)
    return 0


def cmd_eval(args) -> int:
    cfg_path = Path(args.run_dir) / "config.yaml"
    if not cfg_path.exists():
        raise ConfigError(f"{cfg_path} does not exist: is {args.run_dir} a run directory?")
    cfg = load_config(cfg_path, args.overrides)
    _start_jax(_devices_for(cfg), args, cfg.mesh.devices)
    _library_logs_to(Path(args.run_dir))
    from dlrm_jax.train.saved_run import evaluate_run

    with stopping.deferred("the evaluation"):  # restores and compiles (see dlrm_jax.stopping)
        summary = evaluate_run(args.run_dir, args.overrides, step=args.step, log=_log)
    print(
        f"eval step={summary.step} auc={summary.auc:.6f} logloss={summary.logloss:.6f} samples={summary.eval_samples}",
        flush=True,
    )
    return 0


def cmd_export(args) -> int:
    cfg_path = Path(args.run_dir) / "config.yaml"
    if not cfg_path.exists():
        raise ConfigError(f"{cfg_path} does not exist: is {args.run_dir} a run directory?")
    if not args.serving and (args.since is not None or args.tables != "float32"):
        raise ConfigError("--tables and --since go with --serving (the plain export writes float32 tables whole)")
    _start_jax(_devices_for(load_config(cfg_path, args.overrides)), args)
    _library_logs_to(Path(args.run_dir))
    from dlrm_jax.train.export import export_run
    from dlrm_jax.train.serving_export import export_serving

    with stopping.deferred("the export"):  # restores and compiles (see dlrm_jax.stopping)
        if args.serving:
            step = export_serving(
                args.run_dir, args.output, args.overrides, args.step, args.tables, args.since, log=_log
            )
        else:
            step = export_run(args.run_dir, args.output, args.overrides, args.step, log=_log)
    print(f"exported step={step} to {args.output}", flush=True)
    return 0


def cmd_predict(args) -> int:
    from dlrm_jax.serving import load
    from dlrm_jax.serving.files import predict_files

    with stopping.deferred("scoring the current chunk of lines"), load(args.model, args.delta) as model:
        if args.format and args.format != model.rules.format:
            raise ConfigError(
                f"--format {args.format}: {args.model} was trained on {model.rules.format} files, and reads those"
            )
        report = predict_files(
            model,
            args.input,
            args.output,
            batch_size=args.batch_size,
            skip_bad_lines=args.skip_bad_lines,
            progress=args.progress,
        )
    print(report.summary(args.output), flush=True)
    return 0


def cmd_config(args) -> int:
    """The resolved config as YAML (binary data's features from its meta.json, as training
    takes them), after a comment naming where it came from and the keys that differ from the
    default; every key is checked as train checks it. Touches no device."""
    from dlrm_jax.config import dump_config
    from dlrm_jax.data.sources import resolve_data_config
    from dlrm_jax.train.rundir import config_differences

    cfg = resolve_data_config(load_config(args.config, args.overrides))
    changed = [key for key, _, _ in config_differences(load_config(None), cfg)]
    source = args.config or "the embedded default"
    print(f"# dlrm-jax config of {source}{''.join(f' --set {o}' for o in args.overrides)}")
    print(f"# differs from the default in: {', '.join(changed) if changed else 'nothing'}")
    print(dump_config(cfg), end="")
    return 0


def cmd_plan(args) -> int:
    cfg = load_config(args.config, args.overrides)
    from dlrm_jax.data.sources import cap_note, make_source, resolve_data_config
    from dlrm_jax.train.planning import plan_for_run, run_plan_report

    hosts = cfg.mesh.hosts or 1
    devices = _devices_for(cfg)
    simulated = devices <= MAX_SIMULATED_DEVICES and not _gpu_plugin_installed()
    from dlrm_jax.train.checks import check_runnable

    cfg = resolve_data_config(cfg)  # binary data's features, checked against the config's
    check_runnable(cfg, devices, simulated=simulated)  # train's checks: a plan only for a config that trains
    if cfg.embedding.tables_per_host:
        print(
            f"embedding.sync={cfg.embedding.sync}: every host holds its own set of tables; the plan of one "
            f"host's {devices // hosts} devices (mesh.hosts={hosts}; 0 is one host per process, planned as 1)"
        )
    if cfg.embedding.hot.rows == 0 and not _tiered(cfg):
        # The plan training makes: buckets measured on the same first batches, no devices, no JAX.
        if cap_note(cfg):
            print(cap_note(cfg))
        source = make_source(cfg, trains=True) if cfg.embedding.capacity_from == "measured" else None
        plan = plan_for_run(cfg, devices, hosts, source, simulated)
        print(run_plan_report(cfg, plan, simulated))
        return 0
    # Hot rows are chosen from the data, priced with the engine's own bucket measurement;
    # tiered tables' fill sizes and hit rates are predicted from the first batches.
    _start_jax(devices, args)
    from dlrm_jax.train.build import build, mesh_from_config

    plan, _ = build(cfg, mesh_from_config(cfg), make_source(cfg), log=_log)
    print(run_plan_report(cfg, plan, simulated))
    return 0


def _tiered(cfg) -> bool:
    return cfg.embedding.storage == "tiered" or any(item.endswith("=tiered") for item in cfg.embedding.table_storage)


def _gpu_plugin_installed() -> bool:
    """Whether JAX would find a GPU plugin (cluster.profile=auto prices simulated CPU devices
    otherwise), without importing JAX."""
    import importlib.util

    return any(importlib.util.find_spec(name) for name in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm_plugin"))


def cmd_preprocess(args) -> int:
    val_fraction = args.val_fraction if args.val_fraction is not None else 0.0 if args.val_input else 0.1
    if args.val_input and val_fraction:
        raise ConfigError("--val-input and --val-fraction: give one (the val split is whole files or a fraction)")
    common = dict(
        max_ind_range=args.max_ind_range,
        min_count=args.min_count,
        vocab_from=args.vocab_from,
        val_fraction=val_fraction,
        val_inputs=args.val_input,
        skip_bad_lines=args.skip_bad_lines,
        workers=args.workers,
        shuffle_seed=None if args.no_shuffle else args.seed,
        shard_mb=args.shard_mb,
        progress=not args.no_progress,
        overwrite=args.overwrite,
    )
    if args.dataset == "tabular":
        from dlrm_jax.data.preprocessing.tabular import preprocess_tabular

        joins = dict(j.partition("=")[::2] for j in args.join)
        if any(not name or not path for name, path in joins.items()) or len(joins) < len(args.join):
            raise ConfigError(f"--join: expected distinct NAME=PATH values, got {args.join}")
        report = preprocess_tabular(
            args.schema, args.input, args.output, joins=joins, chunk_lines=args.chunk_lines, **common
        )
    else:
        from dlrm_jax.data.preprocessing.criteo_preprocess import preprocess_criteo

        report = preprocess_criteo(
            args.input, args.output, multi_hot=_bag_sizes(args.multi_hot), block_mb=args.block_mb, **common
        )
    print(report.summary(), flush=True)
    return 0


def _bag_sizes(text: str | None) -> tuple[int, ...] | None:
    """--multi-hot: 'mlperf' or comma-separated bag sizes."""
    if not text:
        return None
    if text == "mlperf":
        from dlrm_jax.data.preprocessing.multihot import MLPERF_DCNV2_BAG_SIZES

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
    _start_jax(_devices_for(cfg), args, cfg.mesh.devices)
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
    from dlrm_jax.observe.report import load_run, run_labels, summary, write_report

    run_dirs = [Path(p) for p in args.run_dirs]
    output = Path(args.output) if args.output else run_dirs[0] / "report"
    for path in write_report(run_dirs, output):
        print(f"wrote {path}", flush=True)
    for run_dir, label in zip(run_dirs, run_labels(run_dirs), strict=True):
        print(summary(load_run(run_dir), label), flush=True)
    return 0


def _tighten_cap(cfg: Config, max_rows: int) -> Config:
    import dataclasses

    own = cfg.row_cap
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

        bench_mlp_parallel(
            configs,
            overrides,
            modes=args.modes,
            steps=args.steps,
            repeats=args.repeats,
            output=args.output,
            log=_log,
        )
        return 0
    if args.suite == "serving":
        cfg = load_config(args.config, args.overrides)
        _start_jax(_devices_for(cfg), args)
        from dlrm_jax.bench.serving import bench_serving

        bench_serving(args.lines, args.config, args.overrides, args.steps, args.workdir, args.output, log=_log)
        return 0
    if args.suite == "hot":
        cfg = _tighten_cap(load_config(args.config, args.overrides), args.max_rows)
        _start_jax(_devices_for(cfg), args)
        from dlrm_jax.bench.hot import bench_hot

        bench_hot(
            cfg,
            steps=args.steps,
            repeats=args.repeats,
            zipf=args.zipf,
            layouts=args.layouts,
            row_layouts=args.row_layouts,
            output=args.output,
            log=_log,
        )
        return 0
    if args.suite == "tiers":
        _start_jax(_devices_for(load_config(args.config, args.overrides)), args)
        from dlrm_jax.bench.tiers import bench_tiers

        bench_tiers(
            args.config,
            args.overrides,
            steps=args.steps,
            repeats=args.repeats,
            fractions=args.fractions,
            lookaheads=args.lookaheads,
            policies=args.policies,
            zipf=args.zipf,
            layout=args.layout,
            warmup=args.warmup,
            output=args.output,
            large_gb=args.large_gb,
            large_fraction=args.large_fraction,
            large_host_fraction=args.large_host_fraction,
            tier_dir=args.tier_dir,
            disk_probe_mb=args.disk_probe_mb,
            log=_log,
        )
        return 0
    if args.suite == "input":
        cfg = load_config(args.config, args.overrides)
        _start_jax(_devices_for(cfg), args)
        from dlrm_jax.bench.input import bench_input

        bench_input(cfg, steps=args.steps, step_steps=args.step_steps, output=args.output, log=_log)
        return 0
    if args.suite == "exchange":
        cfg = load_config(args.config, args.overrides)
        _start_jax(_devices_for(cfg), args)
        from dlrm_jax.bench.exchange import bench_exchange

        bench_exchange(cfg, args.strategies, output=args.output, log=_log)
        return 0
    if args.suite == "embedding":
        cfg = _tighten_cap(load_config(args.config, args.overrides), args.max_rows)
        _start_jax(_devices_for(cfg), args)
        from dlrm_jax.bench.embedding import bench_embedding

        bench_embedding(cfg, steps=args.steps, strategies=args.strategies, output=args.output, log=_log)
        return 0
    names = [n for n in args.configs.split(",") if n]
    configs = [_tighten_cap(load_config(n, args.overrides), args.max_rows) for n in names]
    _start_jax(max(_devices_for(c) for c in configs), args)
    from dlrm_jax.bench.train import bench_train

    bench_train(
        dict(zip(names, configs, strict=True)), steps=args.steps, warmup=args.warmup, output=args.output, log=_log
    )
    return 0


COMMANDS = {
    "train": cmd_train,
    "eval": cmd_eval,
    "export": cmd_export,
    "predict": cmd_predict,
    "plan": cmd_plan,
    "config": cmd_config,
    "preprocess": cmd_preprocess,
    "bench": cmd_bench,
    "report": cmd_report,
    "profile": cmd_profile,
}
