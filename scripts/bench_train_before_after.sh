#!/usr/bin/env bash
# dlrm-jax bench train from an older revision and from this checkout, interleaved, on 8
# simulated devices and on 1: a change's CPU cost, side by side on the same machine.
#   scripts/bench_train_before_after.sh REV [ROUNDS] [OUT] [CONFIGS]
# Writes OUT/{before,after}_{8,1}_{round}.json (and .log); prints each run's status.
set -u
rev=${1:?usage: $0 REV [ROUNDS] [OUT] [CONFIGS]}
rounds=${2:-2}
out=${3:-/tmp/bench-before-after}
configs=${4:-default,criteo_kaggle}
here=$(cd "$(dirname "$0")/.." && pwd)
python=$here/.venv/bin/python
old=$(mktemp -d)/before
git -C "$here" worktree add -q --detach "$old" "$rev" || exit 2
trap 'git -C "$here" worktree remove --force "$old"' EXIT
mkdir -p "$out"
for round in $(seq "$rounds"); do
  for devices in 8 1; do
    flags=""; [ "$devices" = 8 ] && flags="--xla_force_host_platform_device_count=8"
    for side in before after; do
      root=$here; [ "$side" = before ] && root=$old
      (cd /tmp && XLA_FLAGS="$flags" PYTHONPATH="$root" "$python" -m dlrm_jax bench train \
        --configs "$configs" --steps 30 --output "$out/${side}_${devices}_${round}.json" \
        > "$out/${side}_${devices}_${round}.log" 2>&1)
      echo "$side $devices devices, round $round: exit $?"
    done
  done
done
