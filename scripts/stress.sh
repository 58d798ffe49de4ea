#!/usr/bin/env bash
# Repeated multi-device and multi-process trainings, each under a timeout: any abort or hang
# fails the script. This is the check for the dispatch and checkpoint-thread rules in
# dlrm_jax/train/trainer.py (one thread dispatches collectives, a bounded number in flight).
#
#   scripts/stress.sh [SINGLE_RUNS=20] [TWO_PROCESS_RUNS=10] [PEER_LOSS_RUNS=4]
#   STRESS_SET="embedding.hot.rows=auto embedding.hot.refresh_every=25" scripts/stress.sh 6 4 0
#
# STRESS_SET: extra config overrides (KEY=VALUE, space-separated) for every run.
# Peer loss: a two-process training whose process 1 (odd runs) or 0 (even runs) is SIGKILLed
# mid-run; the survivor must exit non-zero within PEER_BOUND_S seconds (the README's bound).
#
# Uses the dlrm-jax on PATH (or .venv/bin). Writes into a temporary folder; prints one line per
# run and a summary; exit status 1 if any run failed.
set -u
single=${1:-20}
pairs=${2:-10}
losses=${3:-4}
here=$(cd "$(dirname "$0")/.." && pwd)
cli=$(command -v dlrm-jax || echo "$here/.venv/bin/dlrm-jax")
py=$(dirname "$cli")/python
work=$(mktemp -d /tmp/dlrm-stress.XXXXXX)
trap 'rm -rf "$work"' EXIT

"$py" "$here/scripts/make_criteo_sample.py" --lines 10000 --output "$work/day.tsv" >/dev/null
"$cli" preprocess criteo --input "$work/day.tsv" --output "$work/data" --no-progress >/dev/null || exit 1

# The command from the report: small batches, frequent whole-split evaluations.
args=(train --config criteo_kaggle --set data.source=binary --set "data.path=$work/data"
      --set train.batch_size=128 --set train.optimizer=sgd --set embedding.optimizer=sgd
      --set train.eval_every=63 --set train.eval_batches=0 --set mesh.devices=8
      --set train.progress_bar=false)
for kv in ${STRESS_SET:-}; do args+=(--set "$kv"); done
failed=0

for i in $(seq 1 "$single"); do
  start=$(date +%s)
  timeout -s KILL 300 "$cli" "${args[@]}" --set train.steps=313 --set train.checkpoint_every=0 \
    --run-dir "$work/one$i" >"$work/one$i.log" 2>&1
  rc=$?
  echo "8 devices, run $i: exit $rc in $(( $(date +%s) - start ))s"
  [ $rc -eq 0 ] || { failed=$((failed + 1)); tail -n 3 "$work/one$i.log"; }
done

for i in $(seq 1 "$pairs"); do
  port=$(( 20000 + RANDOM % 20000 ))
  start=$(date +%s)
  pids=()
  for p in 0 1; do
    timeout -s KILL 300 "$cli" "${args[@]}" --set train.steps=200 --set train.checkpoint_every=50 \
      --run-dir "$work/two$i" --coordinator "127.0.0.1:$port" --num-processes 2 --process-id $p \
      >"$work/two${i}_$p.log" 2>&1 &
    pids+=($!)
  done
  rcs=""
  for pid in "${pids[@]}"; do wait "$pid"; rcs="$rcs $?"; done
  echo "2 processes x 4 devices, run $i: exits$rcs in $(( $(date +%s) - start ))s"
  if [ "$rcs" != " 0 0" ]; then failed=$((failed + 1)); tail -n 3 "$work/two${i}_0.log" "$work/two${i}_1.log"; fi
done

PEER_BOUND_S=40
for i in $(seq 1 "$losses"); do
  port=$(( 20000 + RANDOM % 20000 ))
  victim=$(( i % 2 ))
  run="$work/lost$i"
  pids=()
  for p in 0 1; do
    "$cli" "${args[@]}" --set train.steps=100000 --set train.checkpoint_every=0 \
      --set train.eval_every=0 --set train.log_every=1 --run-dir "$run" \
      --coordinator "127.0.0.1:$port" --num-processes 2 --process-id $p >"$run.$p.log" 2>&1 &
    pids+=($!)  # the processes themselves (no timeout wrapper): the kill must reach them
  done
  for _ in $(seq 1 600); do [ -s "$run/metrics.jsonl" ] && break; sleep 0.5; done
  sleep 2
  disown "${pids[$victim]}"  # its "Killed" is expected: no job report for it
  kill -KILL "${pids[$victim]}"
  killed=$(date +%s)
  survivor=${pids[$((1 - victim))]}
  while kill -0 "$survivor" 2>/dev/null && [ $(( $(date +%s) - killed )) -le $PEER_BOUND_S ]; do sleep 0.2; done
  if kill -0 "$survivor" 2>/dev/null; then
    kill -KILL "$survivor"; rc="still running"
  else
    { wait "$survivor"; } 2>/dev/null; rc=$?
  fi
  log="$run.$((1 - victim)).log"
  echo "peer loss, run $i: process $victim killed, the other: exit $rc after $(( $(date +%s) - killed ))s: $(grep -v '^W' "$log" | tail -n 1 | cut -c1-110)"
  case "$rc" in 0|"still running") failed=$((failed + 1)); tail -n 3 "$log";; esac
done

echo "stress: $((single + pairs + losses)) runs, $failed failed"
[ $failed -eq 0 ]
