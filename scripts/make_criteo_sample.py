"""Write a Criteo-format TSV drawn from the synthetic generator, to try `dlrm-jax preprocess`.

    python scripts/make_criteo_sample.py --lines 200000 --output /tmp/criteo_sample.tsv

The file has the real layout (label, 13 integer fields that may be empty or negative, 26 hex
categoricals that may be empty). ``--bad-lines K`` appends K malformed lines of different kinds
at the end, to see how preprocessing reports them.
"""

from __future__ import annotations

import argparse

from dlrm_jax.config import CRITEO_KAGGLE_CARDINALITIES
from dlrm_jax.data.sources.criteo import write_criteo_tsv
from dlrm_jax.data.sources.synthetic import TRAIN_STREAM, SyntheticGenerator

BAD_LINES = [
    "1\t2\t3\n",  # too few fields
    "2" + "\t1" * 13 + "\tab" * 26 + "\n",  # label not 0/1
    "0\tx" + "\t1" * 12 + "\tab" * 26 + "\n",  # integer field not an integer
    "1" + "\t1" * 13 + "\tzz" * 26 + "\n",  # categorical not hex
    "\n",  # empty line
]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lines", type=int, default=100_000)
    p.add_argument("--output", required=True)
    p.add_argument("--max-rows", type=int, default=100_000, help="cap on distinct ids per feature")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--missing-cat-rate", type=float, default=0.02)
    p.add_argument("--bad-lines", type=int, default=0)
    args = p.parse_args(argv)
    rows = tuple(min(c, args.max_rows) for c in CRITEO_KAGGLE_CARDINALITIES)
    gen = SyntheticGenerator(
        seed=args.seed, num_dense=13, table_rows=rows, bag_sizes=(1,) * 26, zipf_exponent=1.1, positive_rate=0.26
    )
    write_criteo_tsv(
        args.output, gen.raw(TRAIN_STREAM, 0, 0, args.lines), missing_cat_rate=args.missing_cat_rate, seed=args.seed
    )
    with open(args.output, "a") as f:
        for i in range(args.bad_lines):
            f.write(BAD_LINES[i % len(BAD_LINES)])
    print(f"wrote {args.lines + args.bad_lines} lines to {args.output}")


if __name__ == "__main__":
    main()
