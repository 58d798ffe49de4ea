#!/usr/bin/env bash
# The whole TorchRec comparison from a fresh clone: builds our venv (.venv, if missing) and a
# TorchRec CPU venv (/tmp/venv-torchrec, if missing), then runs scripts/bench_vs_torchrec.py.
#
#   scripts/bench_vs_torchrec.sh [REPEATS=3] [OUTPUT=bench_vs_torchrec.json] [more flags...]
#
# About 5 minutes per repeat on a 2-core machine. Keep the machine otherwise idle.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
repeats=${1:-3}
output=${2:-bench_vs_torchrec.json}
shift $(( $# < 2 ? $# : 2 ))
torchrec_venv=${TORCHREC_VENV:-/tmp/venv-torchrec}

if [ ! -x "$here/.venv/bin/dlrm-jax" ]; then
  python3 -m venv "$here/.venv" && "$here/.venv/bin/pip" install -q -e "$here"
fi
if [ ! -x "$torchrec_venv/bin/python" ] || ! "$torchrec_venv/bin/python" -c "import torchrec" 2>/dev/null; then
  "$here/scripts/peers/setup_torchrec.sh" "$torchrec_venv"
fi
exec "$here/.venv/bin/python" "$here/scripts/bench_vs_torchrec.py" --repeats "$repeats" --output "$output" \
  --torchrec-python "$torchrec_venv/bin/python" --cli "$here/.venv/bin/dlrm-jax" "$@"
