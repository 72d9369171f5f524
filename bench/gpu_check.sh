#!/usr/bin/env bash
# GPU checks (≤ 8 minutes): the replica's CUDA path, then `omni-dp launch` of the `small` model as
# DP1, DP2 and DP3 under MPS (and without MPS when time allows) at saturating load through the
# router, with the attach report of every MPS run and a check that `down` left nothing behind.
# Uses the python3 that has a CUDA torch (no venv needed); run from anywhere. Needs, besides a
# CUDA torch: aiohttp click numpy psutil nvidia-ml-py pyyaml prometheus-client safetensors
# (pip install them if missing) and nvidia-cuda-mps-control on PATH (it ships with the driver).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version,compute_mode --format=csv,noheader
"$PY" -c "import torch; assert torch.cuda.is_available(), 'torch sees no GPU'; print('torch', torch.__version__)"
command -v nvidia-cuda-mps-control || echo "nvidia-cuda-mps-control not on PATH: the --mps rows will fail preflight"
(cd bench && timeout 120 "$PY" gpu_check.py small)
(cd bench && timeout 420 "$PY" launch_scaling.py --configs "${CONFIGS:-1,2mps,3mps,2,3}" \
    --concurrency 32 --requests 192 --serve-args "--model small" ${RECORD:+--record "$RECORD"})
