"""Write a Criteo-format TSV drawn from the synthetic generator, to try `dlrm-jax preprocess`.

    python scripts/make_criteo_sample.py --lines 200000 --output /tmp/criteo_sample.tsv

The file has the real layout (label, 13 integer fields that may be empty or negative, 26 hex
categoricals that may be empty). ``--bad-lines K`` appends K malformed lines of different kinds
at the end, to see how preprocessing reports them.

``--drift-windows W`` writes a stream that drifts instead, in time order: W windows of
``lines / W`` lines, each giving birth to ``--born-per-window`` new values per feature that fade
(each window older halves a cohort's share) and stop after ``--lifetime`` windows, labels from a
known model of the values and the dense features (``data/sources/drifting.py``: the stream
``dlrm-jax bench stream`` trains on, as 26 categoricals and 13 integers). Real click logs drift
like this (new ads, users and items every day); the default sample draws every line from one
distribution, where a vocabulary counted on the first lines is already the best one.

    python scripts/make_criteo_sample.py --lines 262144 --drift-windows 32 --output drift.tsv
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from dlrm_jax.cli.args import COUNT, POSITIVE, bounded
from dlrm_jax.config import CRITEO_KAGGLE_CARDINALITIES
from dlrm_jax.data.sources.criteo import write_criteo_tsv
from dlrm_jax.data.sources.drifting import DriftingStream
from dlrm_jax.data.sources.synthetic import TRAIN_STREAM, RawSamples, SyntheticGenerator

BAD_LINES = [
    "1\t2\t3\n",  # too few fields
    "2" + "\t1" * 13 + "\tab" * 26 + "\n",  # label not 0/1
    "0\tx" + "\t1" * 12 + "\tab" * 26 + "\n",  # integer field not an integer
    "1" + "\t1" * 13 + "\tzz" * 26 + "\n",  # categorical not hex
    "\n",  # empty line
]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lines", type=POSITIVE, default=100_000)
    p.add_argument("--output", required=True, help="a new file (--overwrite replaces one)")
    p.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    p.add_argument("--max-rows", type=POSITIVE, default=100_000, help="cap on distinct ids per feature")
    p.add_argument("--seed", type=COUNT, default=0)
    p.add_argument("--missing-cat-rate", type=bounded(float, 0, below=1.0000001), default=0.02)
    p.add_argument("--bad-lines", type=COUNT, default=0)
    p.add_argument("--drift-windows", type=COUNT, default=0, help="a drifting stream of this many windows (0: none)")
    p.add_argument("--born-per-window", type=POSITIVE, default=2000, help="with --drift-windows: new values a window")
    p.add_argument("--lifetime", type=POSITIVE, default=4, help="with --drift-windows: windows a value is seen")
    args = p.parse_args(argv)
    out = Path(args.output)
    if out.is_dir() or not out.parent.is_dir():
        p.error(f"--output {out}: {'a folder' if out.is_dir() else f'no folder {out.parent}'}; give a file")
    if out.exists() and not args.overwrite:
        p.error(f"--output {out}: exists; --overwrite replaces it")
    if args.drift_windows and args.lines < args.drift_windows:
        p.error(f"--lines {args.lines}: fewer than --drift-windows {args.drift_windows} (a line a window at least)")
    if args.drift_windows:
        raw = drifting_lines(args.lines, args.drift_windows, args.born_per_window, args.lifetime, args.seed)
    else:
        rows = tuple(min(c, args.max_rows) for c in CRITEO_KAGGLE_CARDINALITIES)
        gen = SyntheticGenerator(
            seed=args.seed, num_dense=13, table_rows=rows, bag_sizes=(1,) * 26, zipf_exponent=1.1, positive_rate=0.26
        )
        raw = gen.raw(TRAIN_STREAM, 0, 0, args.lines)
    write_criteo_tsv(args.output, raw, missing_cat_rate=args.missing_cat_rate, seed=args.seed)
    with open(args.output, "a") as f:
        for i in range(args.bad_lines):
            f.write(BAD_LINES[i % len(BAD_LINES)])
    print(f"wrote {len(raw.labels) + args.bad_lines} lines to {args.output}")


def drifting_lines(lines: int, windows: int, born: int, lifetime: int, seed: int) -> RawSamples:
    """``lines`` of a :class:`DriftingStream` of ``windows`` windows as Criteo fields: each value
    its raw id's low 32 bits (a Criteo value is a 32-bit hash), each dense feature x as the count
    floor(e^(x + 2)), which DLRM's log1p turns back into about x + 2."""
    if not 0 < windows <= lines:
        raise SystemExit(f"--drift-windows {windows}: between 1 and --lines ({lines})")
    stream = DriftingStream(
        features=26,
        num_dense=13,
        windows=windows,
        window_samples=lines // windows,
        born_per_window=born,
        lifetime=lifetime,
        seed=seed,
    )
    parts = [stream.window(t) for t in range(windows)]
    dense = np.concatenate([w.dense for w in parts])
    return RawSamples(
        counts=np.floor(np.exp(dense.astype(np.float64) + 2.0)).astype(np.int64),
        missing=np.zeros(dense.shape, bool),
        ids=(np.concatenate([w.ids for w in parts]) & np.uint64(0xFFFFFFFF)).astype(np.int64),
        labels=np.concatenate([w.labels for w in parts]).astype(np.int8),
    )


if __name__ == "__main__":
    main()
