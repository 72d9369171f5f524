#!/usr/bin/env bash
# The replica's CUDA checks and a GPU throughput table, on a machine with an NVIDIA GPU.
# Uses the python3 that has a CUDA torch (no venv needed): run from the repository root.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" -c "import torch; assert torch.cuda.is_available(), 'torch sees no GPU'; print('torch', torch.__version__)"
(cd bench && "$PY" gpu_check.py small)
"$PY" bench/engine_throughput.py --requests 128 --concurrency 1,8,32,64 \
    --serve-args "--model small --device cuda --max-total-tokens 65536"
