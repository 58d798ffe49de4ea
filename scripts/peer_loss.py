"""Kill a process of a two-process run, again and again, through the supervisor that
scripts/launch_local.sh starts: each time, the run must end within the bound with one line
naming the lost process, and the same command again must resume and end bitwise where an
uninterrupted run ends (metrics.jsonl's losses and AUCs).

    python scripts/peer_loss.py [--kills 20] [--output peer_loss.json]

--kills N: N kills of process 0 and N of process 1, alternating, each at a random moment after
the run's first checkpoint. Prints one line per kill and a summary; writes JSON; exit status 1
if any kill broke a rule.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BOUND_S = 45  # the README's bound for a survivor to end after its peer is lost
ARGS = [
    "--config",
    "smoke",
    "--set",
    "mesh.devices=8",
    "--set",
    "train.steps=60",
    "--set",
    "train.log_every=1",
    "--set",
    "train.eval_every=20",
    "--set",
    "train.checkpoint_every=10",
]


def launch(run_dir: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [str(REPO / "scripts" / "launch_local.sh"), "2", *ARGS, "--run-dir", str(run_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


def history(run_dir: Path) -> list:
    return [
        (e["step"], e["loss"], e.get("auc"))
        for e in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20, help="kills of each process")
    parser.add_argument("--output", default="peer_loss.json")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    work = Path(tempfile.mkdtemp(prefix="dlrm-peer-loss-"))
    try:
        whole = launch(work / "reference", env)
        out, _ = whole.communicate(timeout=600)
        if whole.returncode:
            print(out[-3000:])
            return 1
        reference = history(work / "reference")
        results = []
        for i in range(2 * args.kills):
            victim, run = i % 2, work / f"run{i}"
            p = launch(run, env)
            lines, pids = [], {}
            for text in p.stdout:
                lines.append(text)
                if m := re.match(r"\[launch\] process (\d): pid (\d+)", text):
                    pids[int(m[1])] = int(m[2])
                if len(pids) == 2:
                    break
            while not (run / "checkpoints" / "10").is_dir() and p.poll() is None:
                time.sleep(0.02)
            time.sleep(rng.uniform(0.0, 3.0))
            os.kill(pids[victim], 9)
            killed = time.time()
            rest, _ = p.communicate(timeout=BOUND_S + 60)
            took = time.time() - killed
            out = "".join(lines) + rest
            said = [x for x in out.splitlines() if x.startswith("[launch] process ") and "pid" not in x]
            native = [x for x in out.splitlines() if "Check failure stack trace" in x or re.search(r"\]\s+@\s+0x", x)]
            again = launch(run, env)
            out2, _ = again.communicate(timeout=600)
            resumed = re.search(r"resuming from checkpoint at step (\d+)", out2)
            ok_line = (
                len(said) == 1
                and said[0].startswith(f"[launch] process {victim} was ended by SIGKILL")
                and "to resume" in said[0]
                and not native
            )
            bitwise = again.returncode == 0 and history(run) == reference
            results.append(
                {
                    "kill": i,
                    "victim": victim,
                    "seconds_to_end": round(took, 2),
                    "one_line": ok_line,
                    "resumed_from": int(resumed[1]) if resumed else None,
                    "bitwise": bitwise,
                    "line": said[0] if said else out[-500:],
                }
            )
            print(
                f"kill {i}: process {victim}, ended in {took:.1f}s, one line: {ok_line}, resumed from "
                f"{results[-1]['resumed_from']}, bitwise: {bitwise}",
                flush=True,
            )
            shutil.rmtree(run, ignore_errors=True)
        bad = [r for r in results if not (r["one_line"] and r["bitwise"] and r["seconds_to_end"] < BOUND_S)]
        summary = {
            "kills": len(results),
            "failed": len(bad),
            "bound_s": BOUND_S,
            "max_seconds_to_end": max(r["seconds_to_end"] for r in results) if results else None,
            "results": results,
        }
        Path(args.output).write_text(json.dumps(summary, indent=1) + "\n")
        print(
            f"peer loss: {len(results)} kills, {len(bad)} broke a rule; slowest end "
            f"{summary['max_seconds_to_end']} s (bound {BOUND_S} s)"
        )
        return 1 if bad else 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
