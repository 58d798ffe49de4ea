#!/usr/bin/env bash
# Multi-process training on one machine: N processes on 127.0.0.1, each with its share of
# mesh.devices as simulated CPU devices (or its GPUs), exactly as N hosts would run it.
#
#   scripts/launch_local.sh N [train|eval|profile] [arguments of that dlrm-jax command...]
#   scripts/launch_local.sh 2 --config smoke --set mesh.devices=8
#   scripts/launch_local.sh 2 profile --config smoke --set mesh.devices=8 --run-dir runs/prof
#
# The command defaults to train.
# Each output line is prefixed with its process, [p0] ... [pN-1]; the first lines name each
# process's pid. Exit status: 0 when every process succeeded, else the first non-zero one.
# Ctrl-C stops all of them (each saves a checkpoint first). If one process dies the others
# exit on their own within the bound the README states; re-running the same command resumes.
# Uses the dlrm-jax on PATH, else the repository's .venv.
set -u
if [ $# -lt 1 ] || ! [ "$1" -ge 1 ] 2>/dev/null; then
  echo "usage: $0 N [train|eval|profile] [dlrm-jax arguments...]" >&2
  exit 2
fi
n=$1
shift
sub=train
case "${1:-}" in train | eval | profile) sub=$1; shift ;; esac
here=$(cd "$(dirname "$0")/.." && pwd)
cli=$(command -v dlrm-jax || echo "$here/.venv/bin/dlrm-jax")
[ -x "$cli" ] || { echo "$0: no dlrm-jax on PATH or in $here/.venv" >&2; exit 2; }
py=$(dirname "$cli")/python
port=$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')

pids=()
for ((i = 0; i < n; i++)); do
  # Progress bars redraw with carriage returns: through the line prefixer they would be one
  # endless line. The caller's own --set train.progress_bar=true still wins (it comes later).
  "$cli" "$sub" --set train.progress_bar=false "$@" --coordinator "127.0.0.1:$port" --num-processes "$n" --process-id "$i" \
    > >(sed -u "s/^/[p$i] /") 2> >(sed -u "s/^/[p$i] /" >&2) &
  pids+=($!)
  echo "[launch] process $i: pid $!"
done
trap 'kill -INT "${pids[@]}" 2>/dev/null' INT TERM

status=0
for i in "${!pids[@]}"; do
  pid=${pids[$i]}
  while true; do
    wait "$pid"
    rc=$?
    # A wait interrupted by a trapped signal returns >128 while the process still runs.
    kill -0 "$pid" 2>/dev/null || break
  done
  if [ "$rc" -gt 128 ]; then
    echo "[launch] process $i (pid $pid) ended by signal SIG$(kill -l $((rc - 128)) 2>/dev/null || echo $((rc - 128)))" >&2
  elif [ "$rc" -ne 0 ]; then
    echo "[launch] process $i (pid $pid) exited with status $rc" >&2
  fi
  [ "$status" -eq 0 ] && status=$rc
done
wait  # the output filters
exit "$status"
