"""``dlrm-jax preprocess``: raw data (Criteo TSV, tabular files) to a binary dataset."""

from __future__ import annotations

from pathlib import Path

from dlrm_jax.cli.args import COUNT, FRACTION, POSITIVE, bounded
from dlrm_jax.config import ConfigError

NAME = "preprocess"
HELP = "convert raw data to memory-mappable binary arrays"


def add_arguments(p) -> None:
    pre_sub = p.add_subparsers(dest="dataset", required=True)
    criteo = pre_sub.add_parser("criteo", help="Criteo Kaggle / Terabyte TSV")
    criteo.add_argument("--input", nargs="+", required=True, help="raw TSV file(s), plain or .gz, in time order")
    criteo.add_argument(
        "--multi-hot",
        metavar="SIZES",
        help="materialise MLPerf DLRM-DCNv2's multi-hot bags: 'mlperf' or 26 comma-separated bag sizes",
    )
    criteo.add_argument(
        "--block-mb", type=bounded(float, 0, strict=True), default=64.0, help="MB of text a worker parses at a time"
    )
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


def run(args) -> int:
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
        raw_values=args.raw_values,
        window_seconds=getattr(args, "window_seconds", 0.0),
        progress=not args.no_progress,
        overwrite=args.overwrite,
    )
    if args.dataset == "tabular":
        from dlrm_jax.data.preprocessing.tabular import preprocess_tabular

        joins = dict(j.partition("=")[::2] for j in args.join)
        if any(not name or not path for name, path in joins.items()) or len(joins) < len(args.join):
            raise ConfigError(f"--join: expected distinct NAME=PATH values, got {args.join}")
        missing = [f"{name}={path}" for name, path in joins.items() if not Path(path).is_file()]
        if missing:
            raise ConfigError(f"--join {missing[0]}: no such file")
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


def _add_preprocess_args(p, chunk_lines: int) -> None:
    """What every `preprocess` dataset shares: output, ids, validation split, bad lines."""
    p.add_argument("--output", required=True, help="output directory: new or empty (see --overwrite)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the dataset --output holds already (runs trained on it resume on other rows); "
        "a folder that holds anything else (beside a dataset too) is never replaced",
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
        "--raw-values",
        action="store_true",
        help="keep each value's 64-bit number too (raw.npy), for dynamic tables (embedding.ids=dynamic): "
        "they map the values themselves, not the ids (8 bytes per feature per row)",
    )
    p.add_argument(
        "--val-fraction",
        type=FRACTION,
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
    p.add_argument(
        "--no-shuffle",
        action="store_true",
        help="keep the train rows in input order; each input file is then a window of them (train.progressive_window=data)",
    )
    if chunk_lines:  # tabular: criteo's lines have no time column to window by (it was offered, and always refused)
        p.add_argument(
            "--window-seconds",
            type=bounded(float, 0.0),
            default=0.0,
            help="with --no-shuffle, windows of this many seconds of the schema's split_by column instead of "
            "input files (the rows must come in time order)",
        )
    p.add_argument("--seed", type=int, default=0, help="seed of the global shuffle of the train rows")
    p.add_argument(
        "--shard-mb",
        type=bounded(float, 0.001, strict=True),
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
