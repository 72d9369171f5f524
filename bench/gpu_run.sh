#!/usr/bin/env bash
# The one device call for a lent GPU. With the device tool, from the repository root:
#
#   run  command: OUT=$OUT bench/gpu_run.sh   carry: [".whl"]   timeout_s: 540
#
# after `bench/fetch_wheels.sh` here (the wheels the machine's image lacks; nothing can be
# installed from a registry there). The whole call keeps to BUDGET seconds (440, the teardown
# included), so a rerun still fits the session's 15 minutes of device time. On CPU, as the tests
# run it:  OUT=/tmp/out GPU=none bench/gpu_run.sh
#
# This wrapper installs the carried wheels (pip --no-index --no-deps --target, on PYTHONPATH),
# raises the open-file limit (an MPS server needs many), and hands over to bench/gpu_run.py,
# which runs the steps (bench/gpu_steps.py) and writes at most 8 files under $OUT, summary.md
# first. Knobs (environment): OUT GPU MODEL PYTHON BUDGET TEARDOWN_RESERVE HEADLINE_CONFIGS
# HEADLINE_CONCURRENCY HEADLINE_TRIALS HEADLINE_DURATION HEADLINE_WARMUP KV_TOKENS
# SHARE_REPLICAS SHARE_RUNS CHECK_STEPS MORE_CONFIGS VOICE_CONFIGS VOICE_CONCURRENCY KERNEL_SECONDS
# OVERLAP_DURATION OVERLAP_CONCURRENCY VLLM_OMNI_MODEL VLLM_OMNI_DEPLOY VLLM_OMNI_PYTHON WORK, and LIMIT_<STEP> (seconds; PROBE MPS_SMOKE HEADLINE SHARE GPU_CHECK
# VOICE OVERLAP MORE_DP FORM3 TP2 GPUS2 VLLM_OMNI). Exit 0 every step ok, 1 a step failed, timed out or had no time, 3 a process of the
# call is left running (named in summary.md).
cd "$(dirname "$0")/.." || exit 3
PY=${PYTHON:-python3}
export PYTHON=$PY PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    site=${WHEEL_SITE:-/tmp/omni-dp-wheels}
    if out=$("$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps \
            --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl 2>&1); then
        export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
        export GPU_RUN_WHEELS="installed into $site: $(cd .whl && echo *.whl)"
    else
        export GPU_RUN_WHEELS="pip install of .whl failed: ${out//$'\n'/ }"
    fi
    echo "gpu_run: wheels: $GPU_RUN_WHEELS"
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# "MPS Server failed to create/open SHM segment" is a too-low open-file limit.
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)" 2>/dev/null
exec "$PY" bench/gpu_run.py
