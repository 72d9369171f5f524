#!/bin/sh
# TEST STAND-IN for an engine interpreter whose BF16 GEMM is wrong under its MPS SM cap: prints
# what bf16_gemm_check.py prints for a wrong answer (sglang-omni's H200 figure) and exits 1.
echo '{"check": "bf16_gemm", "shape": [512, 1024, 1024], "device": "cuda", "relative_error": 0.92, "threshold": 0.01, "passed": false, "caps": {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "42", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": null}}'
exit 1
