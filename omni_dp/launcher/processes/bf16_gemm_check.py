"""One BF16 GEMM against an FP32 reference, in this process's own CUDA context.

Some MPS SM caps make cuBLAS pick BF16 GEMM kernels that give wrong answers (sglang-omni saw a
relative error of 0.92 where 0.003 is normal, on an H200 capped at 56 SMs; "related failures"
under active-thread-percentage limits). A capped replica therefore runs this under its caps
before it serves, and never serves when it fails.

Run as a file by the replica's own interpreter — an external engine's environment has torch
but no omni_dp — so it imports nothing but the standard library and torch:

    PYTHON bf16_gemm_check.py --device cuda|cpu

Prints one JSON line of facts (the error, the device as this process sees it under its caps);
exits 0 when the error is within THRESHOLD, 1 when it is not, 2 when the check cannot run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

M, K, N = 512, 1024, 1024
THRESHOLD = 1e-2  # an accurate BF16 GEMM of this size is near 0.003
WRONG, CANNOT_RUN = 1, 2
CAP_VARIABLES = ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")


def check(torch, device: str, matmul=None) -> dict:
    """The GEMM's relative error against FP32 on the CPU, from the same BF16-rounded inputs
    (so the error is the GEMM's own), with what the device says under the caps."""
    matmul = matmul or torch.matmul
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(M, K, generator=generator).to(torch.bfloat16)
    b = torch.randn(K, N, generator=generator).to(torch.bfloat16)
    reference = a.float() @ b.float()
    out = matmul(a.to(device), b.to(device))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    error = ((out.float().cpu() - reference).norm() / reference.norm()).item()
    facts = {"check": "bf16_gemm", "shape": [M, K, N], "device": device,
             "relative_error": error, "threshold": THRESHOLD, "passed": error <= THRESHOLD,
             "caps": {name: os.environ.get(name) for name in CAP_VARIABLES}}
    if device.startswith("cuda"):
        properties = torch.cuda.get_device_properties(torch.device(device))
        free, total = torch.cuda.mem_get_info()
        # Whether a capped client sees its caps here is not documented: recorded, not assumed.
        facts.update(gpu=properties.name, sm_count=properties.multi_processor_count,
                     mem_get_info={"free": free, "total": total})
    return facts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    try:
        import torch

        facts = check(torch, args.device)
    except Exception as exc:  # whatever stops it, the replica must not serve
        print(json.dumps({"check": "bf16_gemm", "device": args.device, "passed": False,
                          "error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return CANNOT_RUN
    print(json.dumps(facts), flush=True)
    return 0 if facts["passed"] else WRONG


if __name__ == "__main__":
    sys.exit(main())
