#!/usr/bin/env bash
# Multi-process training on one machine: N processes on 127.0.0.1, each with its share of
# mesh.devices as simulated CPU devices (or its GPUs), exactly as N hosts would run it.
#
#   scripts/launch_local.sh N [train|eval|profile] [arguments of that dlrm-jax command...]
#   scripts/launch_local.sh 2 --config smoke --set mesh.devices=8
#   scripts/launch_local.sh 2 profile --config smoke --set mesh.devices=8 --run-dir runs/prof
#
# The command defaults to train. A supervisor (dlrm_jax/parallel/launch.py) runs the processes:
# each output line is prefixed with its process, [p0] ... [pN-1]; the first lines name each
# process's log file and pid (if the supervisor is killed, the processes save, stop and
# write on into those logs). Ctrl-C stops all of them (each saves a checkpoint first). If one process dies,
# the others are stopped and one line names the lost process and the command that resumes;
# jaxlib's native abort reports go to RUN_DIR/launch/<time>/pI.log, not the terminal. Exit status: 0
# when every process succeeded, else the first failed one's (128 + signal if killed).
# Uses the dlrm-jax on PATH, else the repository's .venv.
set -u
here=$(cd "$(dirname "$0")/.." && pwd)
cli=$(command -v dlrm-jax || echo "$here/.venv/bin/dlrm-jax")
[ -x "$cli" ] || { echo "$0: no dlrm-jax on PATH or in $here/.venv" >&2; exit 2; }
DLRM_JAX_LAUNCH_AS="$0 $*" exec "$(dirname "$cli")/python" -m dlrm_jax.parallel.launch "$@"
