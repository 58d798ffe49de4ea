#!/usr/bin/env bash
# Multi-process training on one machine: N processes on 127.0.0.1, each with its share of
# mesh.devices as simulated CPU devices (or its GPUs), exactly as N hosts would run it.
#
#   scripts/launch_local.sh N [dlrm-jax train arguments...]
#   scripts/launch_local.sh 2 --config smoke --set mesh.devices=8
#
# Each output line is prefixed with its process, [p0] ... [pN-1]; the first lines name each
# process's pid. Exit status: 0 when every process succeeded, else the first non-zero one.
# Ctrl-C stops all of them (each saves a checkpoint first). If one process dies the others
# exit on their own within the bound the README states; re-running the same command resumes.
# Uses the dlrm-jax on PATH, else the repository's .venv.
set -u
if [ $# -lt 1 ] || ! [ "$1" -ge 1 ] 2>/dev/null; then
  echo "usage: $0 N [dlrm-jax train arguments...]" >&2
  exit 2
fi
n=$1
shift
here=$(cd "$(dirname "$0")/.." && pwd)
cli=$(command -v dlrm-jax || echo "$here/.venv/bin/dlrm-jax")
[ -x "$cli" ] || { echo "$0: no dlrm-jax on PATH or in $here/.venv" >&2; exit 2; }
py=$(dirname "$cli")/python
port=$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')

pids=()
for ((i = 0; i < n; i++)); do
  # Progress bars redraw with carriage returns: through the line prefixer they would be one
  # endless line. The caller's own --set train.progress_bar=true still wins (it comes later).
  "$cli" train --set train.progress_bar=false "$@" --coordinator "127.0.0.1:$port" --num-processes "$n" --process-id "$i" \
    > >(sed -u "s/^/[p$i] /") 2> >(sed -u "s/^/[p$i] /" >&2) &
  pids+=($!)
  echo "[launch] process $i: pid $!"
done
trap 'kill -INT "${pids[@]}" 2>/dev/null' INT TERM

status=0
for pid in "${pids[@]}"; do
  while true; do
    wait "$pid"
    rc=$?
    # A wait interrupted by a trapped signal returns >128 while the process still runs.
    kill -0 "$pid" 2>/dev/null || break
  done
  [ "$status" -eq 0 ] && status=$rc
done
wait  # the output filters
exit "$status"
