#!/usr/bin/env bash
# A non-editable install as a user gets it: build the wheel, install it with its dependencies
# into a fresh venv, and train the shipped smoke config by name from outside the checkout.
# Usage: scripts/check_wheel_install.sh [WORKDIR]   (default: a new temporary folder)
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="${1:-$(mktemp -d)}"
mkdir -p "$work"
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q --upgrade pip build
"$work/venv/bin/python" -m build -q --wheel --outdir "$work/dist" "$repo"
"$work/venv/bin/pip" install -q "$work"/dist/dlrm_jax-*.whl
cd "$work"
"$work/venv/bin/dlrm-jax" --version
"$work/venv/bin/dlrm-jax" train --config smoke --run-dir "$work/run"
"$work/venv/bin/python" -c "from dlrm_jax.data.preprocessing.tabular_schema import load_schema; print('schema', load_schema('movielens_1m').path)"
echo "wheel install OK in $work"
