#!/usr/bin/env bash
# Provided with the project's peer benchmarks (see scripts/bench_vs_torchrec.sh); otherwise as provided.
# Builds a TorchRec CPU venv for side-by-side benchmarks: torch 2.13.0 (CPU), fbgemm-gpu-cpu 1.8.0,
# torchrec 1.8.0 (released and tested together). Usage: setup_torchrec.sh [VENV_DIR]
# torchrec goes in with --no-deps: its metadata asks for the CUDA fbgemm-gpu, which would replace the
# CPU build. pip then warns "torchrec 1.8.0 requires fbgemm-gpu"; that is expected.
set -euo pipefail
venv=${1:-/tmp/venv-torchrec}
python3 -m venv "$venv"
pin=$(mktemp); echo "torch==2.13.0" > "$pin"
"$venv/bin/pip" install -q torch==2.13.0
"$venv/bin/pip" install -q -c "$pin" fbgemm-gpu-cpu==1.8.0
"$venv/bin/pip" install -q -c "$pin" --no-deps torchrec==1.8.0
"$venv/bin/pip" install -q -c "$pin" tensordict torchmetrics==1.0.3 tqdm pyre-extensions numpy
"$venv/bin/python" -c "import torch, fbgemm_gpu, torchrec; print('torch', torch.__version__, 'fbgemm', fbgemm_gpu.__version__, 'torchrec', torchrec.__version__)"
