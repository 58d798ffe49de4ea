"""dlrm-jax: train, evaluate and plan DLRM-family models with sharded embedding tables.

Every subcommand and flag, with argparse types so that a malformed value names its flag.
"""

from __future__ import annotations

import argparse

from dlrm_jax.choices import DramPolicy, RowLayout, Strategy


def _bounded(kind: type, low: float, *, strict: bool = False):
    """An argparse type: an integer or number >= ``low`` (> with ``strict``); argparse names the
    flag in its error."""
    what, op = {int: "an integer", float: "a number"}[kind], ">" if strict else ">="

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"expected {what} {op} {low:g}, got {text}")
        return value

    return parse


def _list_of(kind: type, low: float | None = None, empty: bool = False):
    """An argparse type: comma-separated values of ``kind`` (each >= ``low`` if given; none at
    all, ``""``, only when ``empty``)."""
    what = {int: "integers", float: "numbers"}[kind]

    def parse(text: str) -> list:
        try:
            values = [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}") from None
        if not values and not (empty and not text.strip()):
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}")
        if low is not None and min(values) < low:
            raise argparse.ArgumentTypeError(f"expected values >= {low}, got {text!r}")
        return values

    return parse


def _names(*allowed: str):
    """An argparse type: comma-separated names, each one of ``allowed``, at least one; argparse
    names the flag in its error, and the error lists what is allowed."""

    def parse(text: str) -> list[str]:
        values = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in values if v not in allowed]
        if not values or bad:
            got = f"{bad[0]!r} in {text!r}" if bad and bad != [text.strip()] else repr(text)
            raise argparse.ArgumentTypeError(f"expected comma-separated values of {', '.join(allowed)}; got {got}")
        return values

    return parse


STRATEGIES = ("auto", *Strategy)  # auto: the config's own embedding.sharding
HOT_LAYOUTS = ("permuted", "frequency_ordered")  # bench/hot.py's LAYOUTS (a test keeps them equal)
MLP_MODES = ("data", "tensor", "pipeline")  # bench/mlp_parallel.py's MODES (likewise)


POSITIVE, COUNT = _bounded(int, 1), _bounded(int, 0)  # steps and repeats; warmups and caps


def _add_config_args(p: argparse.ArgumentParser, config_required: bool = False) -> None:
    p.add_argument(
        "--config",
        required=config_required,
        help="YAML file (or a name from configs/, e.g. criteo_kaggle); default: the embedded default",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set train.steps=100 (repeatable)",
    )


def _add_distributed_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("multi-process (one process per host)")
    g.add_argument("--coordinator", help="host:port of process 0 for jax.distributed")
    g.add_argument(
        "--coordinator-bind",
        metavar="ADDRESS:PORT",
        help="where process 0's coordination service listens (default: --coordinator's own address, "
        "not every interface; 0.0.0.0:PORT to listen on all)",
    )
    g.add_argument("--num-processes", type=int, help="how many processes take part (every process the same)")
    g.add_argument("--process-id", type=int, help="this process's index, 0 to --num-processes - 1")
    g.add_argument(
        "--join-timeout",
        type=int,
        default=300,
        metavar="S",
        help="seconds to wait for every process to join before exiting with one line (default 300)",
    )


def build_parser() -> argparse.ArgumentParser:
    from dlrm_jax import __version__

    parser = argparse.ArgumentParser(prog="dlrm-jax", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"dlrm-jax {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a model (resumes from --run-dir's newest checkpoint)")
    _add_config_args(train)
    train.add_argument("--run-dir", help="where config, plan, metrics and checkpoints go (default: runs/<time>)")
    _add_distributed_args(train)

    ev = sub.add_parser("eval", help="evaluate a checkpoint of a run (default: the newest)")
    ev.add_argument("--run-dir", required=True, help="the training run's folder (its config.yaml and checkpoints)")
    ev.add_argument(
        "--step",
        type=_step_arg,
        help="the checkpoint to evaluate: a step, or 'best' (train.keep_best's); default: the newest intact",
    )
    ev.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a key of the run's config for this evaluation, e.g. --set mesh.devices=4 "
        "or --set train.eval_batches=0 (the whole held-out split; repeatable)",
    )
    _add_distributed_args(ev)

    ex = sub.add_parser(
        "export",
        help="write a run's tables (values and optimizer state) as tensorstore arrays, "
        "or (--serving) a self-contained serving artifact",
    )
    ex.add_argument("--run-dir", required=True, help="the training run's folder (its config.yaml and checkpoints)")
    ex.add_argument(
        "--output",
        required=True,
        help="folder for OUTPUT/<table>/<field> zarr3 arrays, or the serving artifact (a new folder)",
    )
    ex.add_argument(
        "--step",
        type=_step_arg,
        help="the checkpoint to export: a step, or 'best' (train.keep_best's); default: the newest intact",
    )
    ex.add_argument(
        "--serving",
        action="store_true",
        help="write the serving artifact: the dense part as a "
        "jax.export function, the tables, the preprocessing rules and a manifest (docs/serving.md)",
    )
    ex.add_argument(
        "--tables",
        choices=["float32", "bfloat16", "int8"],
        default="float32",
        help="--serving: how the tables are stored (int8: a scale and offset per row)",
    )
    ex.add_argument(
        "--since",
        type=int,
        metavar="STEP",
        help="--serving: a delta, only the rows changed since "
        "the checkpoint of STEP (load it after that step's export)",
    )
    ex.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a key of the run's config for the export, e.g. --set mesh.devices=4 (repeatable)",
    )

    pr = sub.add_parser("predict", help="score raw input lines with a serving artifact (export --serving)")
    pr.add_argument("--model", required=True, help="the serving artifact's folder")
    pr.add_argument(
        "--delta", action="append", default=[], metavar="DIR", help="a delta export to apply, in order (repeatable)"
    )
    pr.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="raw files (plain or .gz), the training files' layout "
        "(Criteo TSV or the model's tabular schema); the label column may be present or absent",
    )
    pr.add_argument("--output", required=True, help="file for the probabilities, one a line, in input order")
    pr.add_argument(
        "--format",
        choices=["criteo", "tabular"],
        help="the input's layout (default and only choice: "
        "the model's training files', Criteo TSV or its tabular schema's)",
    )
    pr.add_argument(
        "--batch-size", type=POSITIVE, default=4096, help="lines scored per call of the model (default 4096)"
    )
    pr.add_argument(
        "--skip-bad-lines",
        action="store_true",
        help="score a malformed line as nan and go on (default: stop at the first, naming file and line)",
    )
    pr.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")

    plan = sub.add_parser("plan", help="print the embedding sharding plan without training")
    _add_config_args(plan)

    show = sub.add_parser(
        "config",
        help="print the resolved config (the default or --config, with every --set applied) as YAML, "
        "as train writes it to RUN_DIR/config.yaml",
    )
    _add_config_args(show)

    pre = sub.add_parser("preprocess", help="convert raw data to memory-mappable binary arrays")
    pre_sub = pre.add_subparsers(dest="dataset", required=True)
    criteo = pre_sub.add_parser("criteo", help="Criteo Kaggle / Terabyte TSV")
    criteo.add_argument("--input", nargs="+", required=True, help="raw TSV file(s), plain or .gz, in time order")
    criteo.add_argument(
        "--multi-hot",
        metavar="SIZES",
        help="materialise MLPerf DLRM-DCNv2's multi-hot bags: 'mlperf' or 26 comma-separated bag sizes",
    )
    criteo.add_argument("--block-mb", type=float, default=64.0, help="MB of text a worker parses at a time")
    _add_preprocess_args(criteo, chunk_lines=0)
    tab = pre_sub.add_parser("tabular", help="CSV / JSON-lines files described by a schema (MovieLens, Avazu, ...)")
    tab.add_argument(
        "--schema", required=True, help="schema YAML, or a shipped one: movielens_1m, avazu, taobao_ad, yelp_reviews"
    )
    tab.add_argument("--input", nargs="+", required=True, help="the main file(s), in time order (.gz is read too)")
    tab.add_argument(
        "--join",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="the side file of the schema's join NAME (repeatable)",
    )
    _add_preprocess_args(tab, chunk_lines=100_000)

    prof = sub.add_parser("profile", help="time per phase of a few train steps, peak memory, and a trace")
    _add_config_args(prof)
    prof.add_argument("--steps", type=POSITIVE, default=10, help="traced steps (default 10)")
    prof.add_argument("--warmup", type=COUNT, default=3, help="untraced steps after compilation (default 3)")
    prof.add_argument(
        "--run-dir",
        help="where profile.json and trace/ go (default: runs/profile-<time>); "
        "a training run's dir adds its phase bars to `dlrm-jax report`",
    )
    _add_distributed_args(prof)

    rep = sub.add_parser("report", help="PNG plots of runs' metrics.jsonl (and profile.json), on shared axes")
    rep.add_argument(
        "run_dirs",
        nargs="+",
        metavar="RUN_DIR",
        help="run folders (train's or profile's --run-dir), plotted together on shared axes",
    )
    rep.add_argument("--output", help="folder for the PNG files (default: FIRST_RUN_DIR/report)")

    bench = sub.add_parser("bench", help="benchmarks; results as JSON")
    bench_sub = bench.add_subparsers(dest="suite", required=True)
    bt = bench_sub.add_parser("train", help="train-step samples/s of several configs, side by side")
    bt.add_argument("--configs", default="default,criteo_kaggle", help="comma-separated config names or files")
    bt.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="applied to every config"
    )
    bt.add_argument("--steps", type=POSITIVE, default=30, help="timed steps per config")
    bt.add_argument("--warmup", type=COUNT, default=5, help="untimed steps after compilation")
    bt.add_argument(
        "--max-rows",
        type=COUNT,
        default=200_000,
        help="cap tables at this many rows; a config's own tighter cap stays (0: no change)",
    )
    bt.add_argument("--output", help="write the JSON here too")
    bi = bench_sub.add_parser("input", help="input pipeline samples/s (binary, synthetic) beside the train step's")
    _add_config_args(bi)
    bi.add_argument("--steps", type=POSITIVE, default=30, help="batches timed through the pipeline per case")
    bi.add_argument("--step-steps", type=POSITIVE, default=5, help="timed train steps for the step-only figure")
    bi.add_argument("--output", help="write the JSON here too")
    bx = bench_sub.add_parser(
        "exchange",
        help="bytes the compiled train step moves vs the plan's prediction and "
        "the lower bound, per strategy (compile only: full-size tables need no memory)",
    )
    _add_config_args(bx)
    bx.add_argument(
        "--strategies",
        type=_names(*STRATEGIES),
        default=list(STRATEGIES),
        help=f"comma-separated, of {','.join(STRATEGIES)} (default: all); auto: the config's own embedding.sharding",
    )
    bx.add_argument("--output", help="write the JSON here too")
    be = bench_sub.add_parser("embedding", help="embedding step of every strategy vs XLA baselines")
    _add_config_args(be)
    be.add_argument(
        "--strategies",
        type=_names(*STRATEGIES),
        default=["replicated", "table", "row", "column", "auto"],
        help=f"comma-separated, of {','.join(STRATEGIES)} (default replicated,table,row,column,auto)",
    )
    be.add_argument("--steps", type=POSITIVE, default=20, help="timed steps per variant")
    be.add_argument(
        "--max-rows",
        type=COUNT,
        default=100_000,
        help="cap tables at this many rows; a config's own tighter cap stays (0: no change)",
    )
    be.add_argument("--output", help="write the JSON here too")
    bt2 = bench_sub.add_parser("tiers", help="tiered tables at several device-cache sizes vs all on the devices")
    _add_config_args(bt2)
    bt2.add_argument(
        "--fractions",
        type=_list_of(float, empty=True),
        default=[1.0, 0.5, 0.2, 0.1, 0.05],
        help='device cache, fractions of each owner\'s rows (default 1.0,0.5,0.2,0.1,0.05; "": none, '
        "with --large-gb only the large case)",
    )
    bt2.add_argument(
        "--lookaheads",
        type=_list_of(int, 0),
        default=[0, 4],
        help="batches planned ahead, comma-separated (default 0,4)",
    )
    bt2.add_argument(
        "--policies",
        type=_names(*DramPolicy),
        default=["lru"],
        help="the DRAM caches' eviction policies, each a case of its own, comma-separated (lru, lfu, tinylfu; default lru)",
    )
    bt2.add_argument("--zipf", type=float, default=1.1, help="the ids' Zipf exponent (default 1.1)")
    bt2.add_argument(
        "--layout",
        default="frequency_ordered",
        choices=["permuted", "frequency_ordered"],
        help="rows in order of popularity, as preprocess lays them out (default), or shuffled",
    )
    bt2.add_argument("--warmup", type=COUNT, default=30, help="untimed steps per variant first (the caches fill)")
    bt2.add_argument("--steps", type=POSITIVE, default=10, help="timed steps per variant and repeat")
    bt2.add_argument("--repeats", type=POSITIVE, default=3, help="alternating timed chunks per variant")
    bt2.add_argument(
        "--large-gb",
        type=float,
        default=0.0,
        help="one more case with the tables scaled to about this many GB on disk (0: none)",
    )
    bt2.add_argument("--large-fraction", type=float, default=0.01, help="the large case's device cache fraction")
    bt2.add_argument("--large-host-fraction", type=float, default=0.05, help="the large case's DRAM cache fraction")
    bt2.add_argument("--tier-dir", help="create the disk tiers here (default: a temporary folder)")
    bt2.add_argument(
        "--disk-probe-mb",
        type=int,
        default=1024,
        help="first measure the tier directory's disk with 4 KiB random reads at queue depth 1 and 32 "
        "on a file of this many MiB (0: skip)",
    )
    bt2.add_argument("--output", help="write the JSON here too")
    bs = bench_sub.add_parser(
        "serving",
        help="predict from a serving artifact vs preprocess + eval; latency; int8/bfloat16 tables; delta sizes",
    )
    bs.add_argument("--config", default="criteo_kaggle", help="the model trained on the sample (default criteo_kaggle)")
    bs.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a key of the benchmark's training config (repeatable)",
    )
    bs.add_argument("--lines", type=POSITIVE, default=200_000, help="sample lines (a tenth held out and scored)")
    bs.add_argument("--steps", type=POSITIVE, default=100, help="training steps (a checkpoint at half of them)")
    bs.add_argument("--workdir", help="keep the sample, run and artifacts here (default: a temporary folder)")
    bs.add_argument("--output", help="write the JSON here too")
    bh = bench_sub.add_parser("hot", help="hot-row replication vs none on skewed ids, both id and row layouts")
    _add_config_args(bh)
    bh.add_argument(
        "--zipf",
        type=_list_of(float),
        default=[1.05, 1.1, 1.2],
        help="Zipf exponents, comma-separated (default 1.05,1.1,1.2)",
    )
    bh.add_argument(
        "--layouts", type=_names(*HOT_LAYOUTS), default=list(HOT_LAYOUTS), help="id layouts, comma-separated"
    )
    bh.add_argument(
        "--row-layouts",
        type=_names(*RowLayout, "auto"),
        default=list(RowLayout),
        help="comma-separated, of block, cyclic, auto (embedding.row_layout's values; default block,cyclic)",
    )
    bh.add_argument("--steps", type=POSITIVE, default=10, help="timed steps per variant and repeat")
    bh.add_argument("--repeats", type=POSITIVE, default=3, help="alternating timed chunks per variant")
    bh.add_argument(
        "--max-rows",
        type=COUNT,
        default=0,
        help="cap tables at this many rows; a config's own tighter cap stays (0: no change)",
    )
    bh.add_argument("--output", help="write the JSON here too")
    bm = bench_sub.add_parser("mlp-parallel", help="dense layers data vs tensor vs pipeline parallel, side by side")
    bm.add_argument("--configs", default="criteo_kaggle,mlperf_dlrm_v1", help="configs whose dense parts are compared")
    bm.add_argument("--modes", type=_names(*MLP_MODES), default=list(MLP_MODES), help="comma-separated")
    bm.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="applied to every config (default: mesh.model=2, train.batch_size=2048, data.max_rows=1000)",
    )
    bm.add_argument("--steps", type=POSITIVE, default=5, help="timed steps per variant and repeat")
    bm.add_argument("--repeats", type=POSITIVE, default=3, help="alternating timed chunks per variant")
    bm.add_argument("--output", help="write the JSON here too")
    bc = bench_sub.add_parser("collectives", help="all-to-all vs all-reduce bandwidth on the current devices")
    bc.add_argument("--devices", type=COUNT, default=0, help="devices in the mesh (0: all; 8 simulated on CPU)")
    bc.add_argument(
        "--sizes-kib",
        type=_list_of(int, 1),
        default=[64, 1024, 16384],
        help="buffer sizes per device, KiB, comma-separated (default 64,1024,16384)",
    )
    bc.add_argument("--repeats", type=POSITIVE, default=10, help="timed calls per size (default 10)")
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
    p.add_argument("--output", required=True, help="output directory: new or empty (see --overwrite)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the dataset --output holds already (runs trained on it resume on other rows); "
        "a folder that holds anything else is never replaced",
    )
    p.add_argument(
        "--max-ind-range",
        type=COUNT,
        default=0,
        help="hash ids into this many rows per feature (0: build vocabularies)",
    )
    p.add_argument(
        "--min-count",
        type=POSITIVE,
        default=1,
        help="vocabulary mode: values seen fewer times share id 1, out of the vocabulary (id 0: missing)",
    )
    p.add_argument(
        "--vocab-from",
        choices=("train", "all"),
        default="train",
        help="rows whose values are counted into ids: train (values seen only in validation "
        "share the out-of-vocabulary id, not the missing values') or all (MLPerf's Terabyte numbering)",
    )
    p.add_argument(
        "--val-fraction",
        type=float,
        help="the last fraction of rows becomes the validation split (default 0.1, or 0 with --val-input)",
    )
    p.add_argument(
        "--val-input",
        nargs="+",
        default=[],
        metavar="FILE",
        help="whole files for the validation split (MLPerf's Terabyte split: day_23)",
    )
    p.add_argument(
        "--skip-bad-lines", action="store_true", help="skip malformed lines and count them instead of failing"
    )
    p.add_argument("--no-shuffle", action="store_true", help="keep the train rows in input order")
    p.add_argument("--seed", type=int, default=0, help="seed of the global shuffle of the train rows")
    p.add_argument(
        "--shard-mb",
        type=_bounded(float, 0.001, strict=True),
        default=1024.0,
        help="size of an output shard in MB (a host reads its own)",
    )
    p.add_argument("--workers", type=COUNT, default=0, help="worker processes (default: one per core)")
    if chunk_lines:
        p.add_argument(
            "--chunk-lines",
            type=int,
            default=chunk_lines,
            help=f"records a worker parses at a time (default {chunk_lines:,})",
        )
    p.add_argument("--no-progress", action="store_true", help="no progress bar (none is drawn off a terminal either)")
