"""How many times a step the dispatching (main) thread of a training run gives up the GIL:
each time, on a host whose input threads want it, it waits to get it back.

Counts calls of ``PyEval_SaveThread`` on the main thread under gdb, for a run of N and of 2N
steps (same config), and prints the difference over N: compiling, the first window and the
end's evaluation cancel out. Needs gdb and a Python whose ``libpython`` exports the symbol.

    python scripts/gil_releases.py --steps 40 -- --config criteo_kaggle --set data.source=binary \\
        --set data.path=DS --set train.batch_size=1024 --set mesh.devices=1

(2026-12-04, the 2-core VM: 54.1 a step before the release thread, 2.3 after.)
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

GDB = """set pagination off
set confirm off
set breakpoint pending on
handle SIGSEGV nostop noprint pass
handle SIGPIPE nostop noprint pass
handle SIGUSR1 nostop noprint pass
set $n = 0
break PyEval_SaveThread thread 1
commands
silent
set $n = $n + 1
continue
end
run
printf "SAVES %d\\n", $n
quit
"""


def count(steps: int, train_args: list[str]) -> int:
    with tempfile.NamedTemporaryFile("w", suffix=".gdb", delete=False) as f:
        f.write(GDB)
    args = [*train_args, "--set", f"train.steps={steps}", "--set", "train.progress_bar=false"]
    args += ["--set", "train.checkpoint_every=0", "--set", "train.eval_every=0", "--set", "train.eval_batches=1"]
    cmd = ["gdb", "-q", "-batch", "-x", f.name, "--args", sys.executable, "-m", "dlrm_jax", "train", *args]
    out = subprocess.run(cmd, capture_output=True, text=True).stdout
    os.unlink(f.name)
    found = re.search(r"SAVES (\d+)", out)
    if not found:
        raise SystemExit(f"gdb counted nothing: {out[-2000:]}")
    return int(found.group(1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("train_args", nargs=argparse.REMAINDER, help="after --: dlrm-jax train's arguments")
    args = ap.parse_args()
    train_args = [a for a in args.train_args if a != "--"]
    short, long = count(args.steps, train_args), count(2 * args.steps, train_args)
    print(f"{(long - short) / args.steps:.1f} GIL releases a step on the dispatching thread ({short} and {long})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
