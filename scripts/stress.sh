#!/usr/bin/env bash
# Repeated multi-device and multi-process trainings, each under a timeout: any abort or hang
# fails the script. This is the check for the dispatch and checkpoint-thread rules in
# dlrm_jax/train/trainer.py (one thread dispatches collectives, a bounded number in flight).
#
#   scripts/stress.sh [SINGLE_RUNS=20] [TWO_PROCESS_RUNS=10]
#
# Uses the dlrm-jax on PATH (or .venv/bin). Writes into a temporary folder; prints one line per
# run and a summary; exit status 1 if any run failed.
set -u
single=${1:-20}
pairs=${2:-10}
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

echo "stress: $((single + pairs)) runs, $failed failed"
[ $failed -eq 0 ]
