"""``dlrm-jax bench``: the benchmark suites, one row each in :data:`SUITES` (its arguments and
what it runs); results as JSON."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from dlrm_jax import stopping
from dlrm_jax.choices import DramPolicy, RowLayout, RowLayoutChoice
from dlrm_jax.cli.args import (
    COUNT,
    COUNT_NUMBER,
    HOT_LAYOUTS,
    MLP_MODES,
    POSITIVE,
    SHARE,
    STRATEGIES,
    add_config_args,
    add_json_output,
    add_max_rows,
    add_overrides,
    bounded,
    config_names,
    list_of,
    names,
)
from dlrm_jax.cli.commands import bench_stream
from dlrm_jax.cli.runtime import devices_for, log, start_jax, tighten_cap
from dlrm_jax.config import ConfigError, load_config
from dlrm_jax.files import check_new_folder
from dlrm_jax.parallel.mesh import SIMULATED_DEVICES_DEFAULT

NAME = "bench"
HELP = "benchmarks; results as JSON"


class Suite(NamedTuple):
    """One ``dlrm-jax bench`` suite: its help line, its arguments and what it runs."""

    help: str
    add_arguments: Callable
    run: Callable[..., None]


def add_arguments(p) -> None:
    suites = p.add_subparsers(dest="suite", required=True)
    for name, suite in SUITES.items():
        suite.add_arguments(suites.add_parser(name, help=suite.help))


def run(args) -> int:
    # A stop waits for the case under way (each suite's cases: bench.common.each_case): raised
    # while jaxlib compiles, its exit crashed the process (see dlrm_jax.stopping). A second
    # one ends the process at once.
    with stopping.deferred("the case under way"):
        SUITES[args.suite].run(args)
    return 0


def _train_arguments(p) -> None:
    p.add_argument(
        "--configs", type=config_names, default="default,criteo_kaggle", help="comma-separated config names or files"
    )
    add_overrides(p, "applied to every config")
    p.add_argument("--steps", type=POSITIVE, default=30, help="timed steps per config")
    p.add_argument("--warmup", type=COUNT, default=5, help="untimed steps after compilation")
    p.add_argument(
        "--rounds",
        type=POSITIVE,
        default=1,
        help="time the configs in this many interleaved turns, every config held at once (ratios robust to a "
        "machine whose speed drifts; default 1: one config after another)",
    )
    add_max_rows(p, 200_000)
    add_json_output(p)


def _input_arguments(p) -> None:
    add_config_args(p)
    p.add_argument("--steps", type=POSITIVE, default=30, help="batches timed through the pipeline per case")
    p.add_argument(
        "--step-steps", type=COUNT, default=5, help="timed train steps for the step-only figure (0: no step figure)"
    )
    add_json_output(p)


def _exchange_arguments(p) -> None:
    add_config_args(p)
    p.add_argument(
        "--strategies",
        type=names(*STRATEGIES),
        default=None,
        help=f"comma-separated, of {','.join(STRATEGIES)} (default: each the config's tables can be planned with, "
        "the others listed as skipped); auto: the config's own embedding.sharding",
    )
    add_json_output(p)


def _embedding_arguments(p) -> None:
    add_config_args(p)
    p.add_argument(
        "--strategies",
        type=names(*STRATEGIES),
        default=["replicated", "table", "row", "column", "auto"],
        help=f"comma-separated, of {','.join(STRATEGIES)} (default replicated,table,row,column,auto)",
    )
    p.add_argument("--steps", type=POSITIVE, default=20, help="timed steps per variant")
    add_max_rows(p, 100_000)
    add_json_output(p)


def _tiers_arguments(p) -> None:
    add_config_args(p)
    p.add_argument(
        "--fractions",
        type=list_of(float, empty=True),
        default=[1.0, 0.5, 0.2, 0.1, 0.05],
        help='device cache, fractions of each owner\'s rows (default 1.0,0.5,0.2,0.1,0.05; "": none, '
        "with --large-gb only the large case)",
    )
    p.add_argument(
        "--lookaheads",
        type=list_of(int, 0),
        default=[0, 4],
        help="batches planned ahead, comma-separated (default 0,4)",
    )
    p.add_argument(
        "--policies",
        type=names(*DramPolicy),
        default=["lru"],
        help="the DRAM caches' eviction policies, each a case of its own, comma-separated (lru, lfu, tinylfu; default lru)",
    )
    p.add_argument("--zipf", type=bounded(float, 0), default=1.1, help="the ids' Zipf exponent (default 1.1)")
    p.add_argument(
        "--layout",
        default="frequency_ordered",
        choices=["permuted", "frequency_ordered"],
        help="rows in order of popularity, as preprocess lays them out (default), or shuffled",
    )
    p.add_argument("--warmup", type=COUNT, default=30, help="untimed steps per variant first (the caches fill)")
    p.add_argument("--steps", type=POSITIVE, default=10, help="timed steps per variant and repeat")
    p.add_argument("--repeats", type=POSITIVE, default=3, help="alternating timed chunks per variant")
    p.add_argument(
        "--large-gb",
        type=COUNT_NUMBER,
        default=0.0,
        help="one more case with the tables scaled to about this many GB on disk (0: none)",
    )
    p.add_argument("--large-fraction", type=SHARE, default=0.01, help="the large case's device cache fraction")
    p.add_argument("--large-host-fraction", type=SHARE, default=0.05, help="the large case's DRAM cache fraction")
    p.add_argument("--tier-dir", help="create the disk tiers here (default: a temporary folder)")
    p.add_argument(
        "--disk-probe-mb",
        type=COUNT,
        default=1024,
        help="first measure the tier directory's disk with 4 KiB random reads at queue depth 1 and 32 "
        "on a file of this many MiB (0: skip)",
    )
    add_json_output(p)


def _serving_arguments(p) -> None:
    p.add_argument("--config", default="criteo_kaggle", help="the model trained on the sample (default criteo_kaggle)")
    add_overrides(p, "override a key of the benchmark's training config (repeatable)")
    p.add_argument("--lines", type=POSITIVE, default=200_000, help="sample lines (a tenth held out and scored)")
    p.add_argument(
        "--steps", type=bounded(int, 2), default=100, help="training steps, at least 2 (a checkpoint at half of them)"
    )
    p.add_argument(
        "--workdir", help="keep the sample, run and artifacts here, a new or empty folder (default: a temporary one)"
    )
    add_json_output(p)


def _hot_arguments(p) -> None:
    add_config_args(p)
    p.add_argument(
        "--zipf",
        type=list_of(float, 0),
        default=[1.05, 1.1, 1.2],
        help="Zipf exponents, comma-separated (default 1.05,1.1,1.2)",
    )
    p.add_argument("--layouts", type=names(*HOT_LAYOUTS), default=list(HOT_LAYOUTS), help="id layouts, comma-separated")
    p.add_argument(
        "--row-layouts",
        type=names(*RowLayoutChoice),
        default=list(RowLayout),
        help="comma-separated, of auto, block, cyclic (embedding.row_layout's values; default block,cyclic)",
    )
    p.add_argument("--steps", type=POSITIVE, default=10, help="timed steps per variant and repeat")
    p.add_argument("--repeats", type=POSITIVE, default=3, help="alternating timed chunks per variant")
    add_max_rows(p, 0)
    add_json_output(p)


def _mlp_parallel_arguments(p) -> None:
    p.add_argument(
        "--configs",
        type=config_names,
        default="criteo_kaggle,mlperf_dlrm_v1",
        help="configs whose dense parts are compared",
    )
    p.add_argument("--modes", type=names(*MLP_MODES), default=list(MLP_MODES), help="comma-separated")
    add_overrides(p, "applied to every config (default: mesh.model=2, train.batch_size=2048, data.max_rows=1000)")
    p.add_argument("--steps", type=POSITIVE, default=5, help="timed steps per variant and repeat")
    p.add_argument("--repeats", type=POSITIVE, default=3, help="alternating timed chunks per variant")
    add_json_output(p)


def _collectives_arguments(p) -> None:
    p.add_argument("--devices", type=COUNT, default=0, help="devices in the mesh (0: all; 8 simulated on CPU)")
    p.add_argument(
        "--sizes-kib",
        type=list_of(int, 1),
        default=[64, 1024, 16384],
        help="buffer sizes per device, KiB, comma-separated (default 64,1024,16384)",
    )
    p.add_argument("--repeats", type=POSITIVE, default=10, help="timed calls per size (default 10)")
    add_json_output(p)


def _train(args) -> None:
    configs = {n: tighten_cap(load_config(n, args.overrides), args.max_rows) for n in args.configs}
    start_jax(max(devices_for(c) for c in configs.values()), args)
    from dlrm_jax.bench.train import bench_train

    bench_train(configs, steps=args.steps, warmup=args.warmup, output=args.output, log=log, rounds=args.rounds)


def _input(args) -> None:
    cfg = load_config(args.config, args.overrides)
    start_jax(devices_for(cfg), args)
    from dlrm_jax.bench.input import bench_input

    bench_input(cfg, steps=args.steps, step_steps=args.step_steps, output=args.output, log=log)


def _exchange(args) -> None:
    cfg = load_config(args.config, args.overrides)
    start_jax(devices_for(cfg), args)
    from dlrm_jax.bench.exchange import bench_exchange

    bench_exchange(cfg, args.strategies, output=args.output, log=log)


def _embedding(args) -> None:
    cfg = tighten_cap(load_config(args.config, args.overrides), args.max_rows)
    start_jax(devices_for(cfg), args)
    from dlrm_jax.bench.embedding import bench_embedding

    bench_embedding(cfg, steps=args.steps, strategies=args.strategies, output=args.output, log=log)


def _tiers(args) -> None:
    start_jax(devices_for(load_config(args.config, args.overrides)), args)
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
        log=log,
    )


def _serving(args) -> None:
    cfg = load_config(args.config, args.overrides)
    if args.workdir:  # (bench_serving checks it too, after JAX starts: here at once, naming the flag)
        try:
            check_new_folder(args.workdir, "the benchmark writes its sample, datasets, run and artifacts")
        except FileExistsError as e:
            raise ConfigError(f"--workdir {e}") from None
    trained = args.lines - args.lines // 10  # (a tenth held out)
    if trained < cfg.train.batch_size:
        raise ConfigError(
            f"--lines {args.lines}: {trained} training lines, fewer than a batch (train.batch_size="
            f"{cfg.train.batch_size}); give at least {-(-cfg.train.batch_size * 10 // 9)}"
        )
    start_jax(devices_for(cfg), args)
    from dlrm_jax.bench.serving import bench_serving

    bench_serving(args.lines, args.config, args.overrides, args.steps, args.workdir, args.output, log=log)


def _hot(args) -> None:
    cfg = tighten_cap(load_config(args.config, args.overrides), args.max_rows)
    start_jax(devices_for(cfg), args)
    from dlrm_jax.bench.hot import bench_hot

    bench_hot(
        cfg,
        steps=args.steps,
        repeats=args.repeats,
        zipf=args.zipf,
        layouts=args.layouts,
        row_layouts=args.row_layouts,
        output=args.output,
        log=log,
    )


def _mlp_parallel(args) -> None:
    overrides = ["mesh.model=2", "train.batch_size=2048", "data.max_rows=1000", *args.overrides]
    configs = args.configs
    start_jax(max(devices_for(load_config(c, overrides)) for c in configs), args)
    from dlrm_jax.bench.mlp_parallel import bench_mlp_parallel

    bench_mlp_parallel(
        configs, overrides, modes=args.modes, steps=args.steps, repeats=args.repeats, output=args.output, log=log
    )


def _collectives(args) -> None:
    start_jax(args.devices or SIMULATED_DEVICES_DEFAULT, args)
    from dlrm_jax.bench.collectives import bench_collectives

    bench_collectives(args.devices, args.sizes_kib, args.repeats, args.output, log=log)


# The suites in the order `dlrm-jax bench -h` lists them; a new suite is its two functions and a row.
SUITES = {
    "train": Suite("train-step samples/s of several configs, side by side", _train_arguments, _train),
    "input": Suite("input pipeline samples/s (binary, synthetic) beside the train step's", _input_arguments, _input),
    "exchange": Suite(
        "bytes the compiled train step moves vs the plan's prediction and "
        "the lower bound, per strategy (compile only: full-size tables need no memory)",
        _exchange_arguments,
        _exchange,
    ),
    "embedding": Suite("embedding step of every strategy vs XLA baselines", _embedding_arguments, _embedding),
    "tiers": Suite("tiered tables at several device-cache sizes vs all on the devices", _tiers_arguments, _tiers),
    "serving": Suite(
        "predict from a serving artifact vs preprocess + eval; latency; int8/bfloat16 tables; delta sizes",
        _serving_arguments,
        _serving,
    ),
    "hot": Suite("hot-row replication vs none on skewed ids, both id and row layouts", _hot_arguments, _hot),
    "mlp-parallel": Suite(
        "dense layers data vs tensor vs pipeline parallel, side by side", _mlp_parallel_arguments, _mlp_parallel
    ),
    "collectives": Suite(
        "all-to-all vs all-reduce bandwidth on the current devices", _collectives_arguments, _collectives
    ),
    "stream": Suite(
        "dynamic vs hashed vs first-window vocabulary ids on a drifting stream, progressive validation",
        bench_stream.add_arguments,
        bench_stream.run,
    ),
}
