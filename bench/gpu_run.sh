#!/usr/bin/env bash
# One device call that always brings its results back: run it with the device tool's
# timeout_s ≈ 480 and the default BUDGET=440 (seconds, all steps and the teardown together).
#
#   OUT=/path/for/results bench/gpu_run.sh            # on the lent GPU machine ($OUT is set)
#   OUT=/tmp/out GPU=none MODEL=tiny CONFIGS=1,2 bench/gpu_run.sh   # the same on CPU (tests)
#
# Steps in value order, each bounded (never past the budget) and teed under $OUT: probe (kernel,
# GPU, driver, /dev/shm, where the MPS binaries are and their versions), the MPS smoke test
# (bench/mps_smoke.py), one replica's device path (bench/gpu_check.py, ≤ 90 s), weight sharing
# (bench/weight_share.py, ≤ 120 s: SHARE_REPLICAS replicas with their own weights, then sharing
# one copy by CUDA IPC under MPS — device memory, identical audio, leader kill -9 and the group's
# recovery), where the machine has two GPUs one run over both (`launch --gpus 0,1 --mps`: a
# daemon per GPU, verify-mps per GPU, a request, `down`; ≤ 120 s), the overlap of two replicas'
# GPU steps (`verify-mps --overlap` on 2 built-in replicas with --mps, which must pass, then on 2
# without, which must not: time slicing; ≤ 150 s; skipped with GPU=none), then the DP table
# (bench/launch_scaling.py, a row written as each configuration ends). No `set -e`: a failed or
# timed-out step is a line of summary.md and the next step runs. The EXIT trap stops every run and
# MPS daemon the steps started (by their records: `omni-dp down`, the smoke test's own cleanup),
# reports anything still running, and packs the runs' artifacts (run.json, events, mps_attach.*,
# MPS and replica logs). $OUT then holds exactly these 12 files, whatever happened (and bench/
# with bench.json and bench.png when BENCH_CONFIGS asks for `omni-dp bench`):
#   summary.md probe.txt mps_smoke.txt gpu_check.txt share.txt gpus2.txt overlap.txt bench.txt
#   scaling.txt
#   scaling.md scaling.jsonl artifacts.tar.gz
# Exit status: 0 every step ok, 1 some step failed, timed out or was skipped (summary.md says
# which), 3 a process of this call is still running (named in scaling.txt; work dir kept).
# Needs python3 with torch (CUDA build on a GPU), aiohttp, click, numpy, psutil, nvidia-ml-py,
# pyyaml, prometheus-client, safetensors: what the lent machine's image has; no venv, no network.
# Knobs (environment): OUT BUDGET GPU MODEL CONFIGS CONCURRENCY REQUESTS CONFIG_TIMEOUT
# LIMIT_PROBE LIMIT_SMOKE LIMIT_CHECK LIMIT_SHARE LIMIT_GPUS2 LIMIT_OVERLAP OVERLAP_S
# OVERLAP_CONCURRENCY SHARE_REPLICAS SHARE_RUNS TEARDOWN_RESERVE PYTHON BENCH_CONFIGS (the
# opt-in `omni-dp bench` step also needs rich and matplotlib in the image).

cd "$(dirname "$0")/.." || exit 3
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu-out}
BUDGET=${BUDGET:-440}
GPU=${GPU:-0}
MODEL=${MODEL:-small}
CONFIGS=${CONFIGS:-1,2mps,3mps,5mps,2,3}
CONCURRENCY=${CONCURRENCY:-32,96}  # 96 > the replicas' 32 running requests: DP1 must queue
REQUESTS=${REQUESTS:-192}
CONFIG_TIMEOUT=${CONFIG_TIMEOUT:-75}
LIMIT_PROBE=${LIMIT_PROBE:-30}
LIMIT_SMOKE=${LIMIT_SMOKE:-60}
LIMIT_CHECK=${LIMIT_CHECK:-90}
LIMIT_SHARE=${LIMIT_SHARE:-120}
LIMIT_GPUS2=${LIMIT_GPUS2:-120}
LIMIT_OVERLAP=${LIMIT_OVERLAP:-150}
OVERLAP_S=${OVERLAP_S:-6}  # seconds of load per overlap check
OVERLAP_CONCURRENCY=${OVERLAP_CONCURRENCY:-32}  # streams through the router: 16 per replica
SHARE_REPLICAS=${SHARE_REPLICAS:-3}
SHARE_RUNS=${SHARE_RUNS:-separate,shared}  # bench/weight_share.py --runs; none: skip the step
TEARDOWN_RESERVE=${TEARDOWN_RESERVE:-45}  # kept for the exit trap's downs and packing
export PY=${PYTHON:-python3}
START=$SECONDS
FILES=(summary.md probe.txt mps_smoke.txt gpu_check.txt share.txt gpus2.txt overlap.txt bench.txt
       scaling.txt scaling.md scaling.jsonl)

mkdir -p "$OUT" || exit 3
for f in "${FILES[@]}"; do : >"$OUT/$f"; done
# Short (MPS socket paths ≤ 107 bytes) and private; removed by the trap unless something is left.
WORK=$(mktemp -d /tmp/odp-gpu.XXXXXX) || exit 3
STATE=$WORK/state
mkdir -p "$WORK/artifacts"
# OMNI_DP_STATE_DIR is set by launch_scaling.py for the runs it starts (and so marks every
# process of theirs); this script's own processes never carry it.
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# "MPS Server failed to create/open SHM segment" is a too-low open-file limit.
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)" 2>/dev/null
if [ "$GPU" = none ]; then DEVICE=cpu; SMOKE_GPU=0; SHARE_MPS=; else
    DEVICE=cuda; SMOKE_GPU=$GPU; SHARE_MPS=--mps; fi

STATUS=0
left() { echo $((BUDGET - (SECONDS - START))); }
summary() { printf '%s\n' "$*" >>"$OUT/summary.md"; echo "$*"; }

# step NAME LIMIT FILE COMMAND…: at most LIMIT seconds (less if the budget is short), output
# teed to $OUT/FILE, one row in summary.md. `timeout` signals the command's process group: the
# launcher's own processes run in sessions of their own and are the trap's to stop.
step() {
    local name=$1 limit=$2 file=$3 room rc t0=$SECONDS result
    shift 3
    room=$(($(left) - TEARDOWN_RESERVE))
    ((limit > room)) && limit=$room
    if ((room < 5)); then
        echo "skipped: ${room}s of the budget left" >>"$OUT/$file"
        summary "| $name | skipped (budget spent) | 0 | $file |"
        STATUS=1
        return
    fi
    echo "### $name: $* (limit ${limit}s)" >>"$OUT/$file"
    timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$OUT/$file"
    rc=${PIPESTATUS[0]}
    case $rc in
        0) result=ok ;;
        124 | 137) result="timed out after ${limit}s" ;;
        *) result="exit $rc" ;;
    esac
    echo "### $name: $result" >>"$OUT/$file"
    [ "$rc" = 0 ] || STATUS=1
    summary "| $name | $result | $((SECONDS - t0)) | $file |"
}

probe() {
    echo "## system"; date -u; uname -r; uname -m; nproc; free -g | head -2
    echo "## /dev/shm"; df -h /dev/shm
    echo "## open files"; ulimit -n
    echo "## nvidia-smi"
    timeout 20 nvidia-smi --query-gpu=index,name,uuid,memory.total,memory.used,driver_version,compute_mode,mig.mode.current --format=csv
    timeout 20 nvidia-smi
    echo "## driver"; cat /proc/driver/nvidia/version
    echo "## on PATH ($PATH)"
    for b in nvidia-cuda-mps-control nvidia-cuda-mps-server nvidia-smi; do
        echo "$b: $(command -v "$b" || echo 'not on PATH')"
    done
    echo "## driver folders"; ls -la /usr/local/nvidia/bin /usr/local/nvidia 2>&1 | head -40
    echo "## omni-dp's MPS binary search"
    "$PY" -c "from omni_dp.mps.binaries import locate_mps_binaries as find; b = find()
print(b.describe()); print('versions differ: refused' if b.mismatch else 'versions: no mismatch known')"
    echo "## torch"
    "$PY" -c "import torch; c = torch.cuda.is_available()
print(torch.__version__, 'cuda', torch.version.cuda, 'available', c,
      torch.cuda.get_device_name(0) if c else '-')"
    echo "## packages"
    "$PY" -m pip list 2>/dev/null | grep -iE '^(torch|aiohttp|click|numpy|psutil|nvidia-ml-py|pyyaml|prometheus.client|safetensors|uvloop|python-json-logger) '
}
export -f probe

# One run over GPUs 0 and 1: a private daemon each, its replicas' attachment proven per GPU,
# status grouped by GPU, one request through the router, `down`. Its state is STATE_DIR: the
# exit trap's cleanup downs it whatever happened here. Arguments: STATE_DIR MODEL (this script's
# own variables are not exported: `bash -c` sees only what it is given).
two_gpus() {
    local odp=("$PY" -m omni_dp) rc=0 MODEL=$2
    export OMNI_DP_STATE_DIR=$1
    "${odp[@]}" launch --gpus 0,1 --replicas-per-gpu 2 --mps --max-total-tokens 4096 \
        --run-id gpus2 --base-port 18600 --router-port 18700 --detach --start-timeout 90 \
        --on-mps-fault fail -- --model "$MODEL" || return 1
    "${odp[@]}" verify-mps gpus2 || rc=1
    "${odp[@]}" status gpus2 --json || rc=1
    "$PY" -c "import json, urllib.request as u
r = u.Request('http://127.0.0.1:18700/v1/audio/speech', json.dumps({'input': 'Two GPUs.'}).encode(),
              {'Content-Type': 'application/json'})
print('speech through the router:', u.urlopen(r, timeout=60).status)" || rc=1
    "${odp[@]}" down gpus2 || rc=1
    return $rc
}
export -f two_gpus

# Two built-in replicas on one GPU, with --mps and then without: `verify-mps --overlap` must
# pass with it (their kernels run at once) and must not without (time slicing: they take
# turns; 1 FAIL, or 2 when the load left them too idle to tell). Each run is downed here; the
# exit trap's cleanup downs whatever is left in STATE_DIR. Arguments: STATE_DIR GPU MODEL
# OVERLAP_S OVERLAP_CONCURRENCY.
overlap_check() {
    local odp=("$PY" -m omni_dp) rc=0 mode port code with=- without=-
    local GPU=$2 MODEL=$3 OVERLAP_S=$4 OVERLAP_CONCURRENCY=$5
    export OMNI_DP_STATE_DIR=$1
    for mode in mps plain; do
        local flags=()
        if [ "$mode" = mps ]; then flags=(--mps --on-mps-fault fail); port=18800
        else port=18820; fi
        echo "## overlap, $mode: 2 replicas on GPU $GPU"
        if "${odp[@]}" launch --gpu "$GPU" --replicas 2 "${flags[@]}" --max-total-tokens 4096 \
            --run-id "overlap-$mode" --base-port "$port" --router-port $((port + 10)) \
            --detach --start-timeout 90 -- --model "$MODEL"; then
            "${odp[@]}" verify-mps "overlap-$mode" --overlap --duration "$OVERLAP_S" \
                --concurrency "$OVERLAP_CONCURRENCY"
            code=$?
            "${odp[@]}" down "overlap-$mode" || rc=1
        else code="launch failed"; rc=1; fi
        if [ "$mode" = mps ]; then with=$code; else without=$code; fi
    done
    echo "overlap with --mps: verify-mps --overlap exit $with (0 PASS wanted)"
    echo "overlap without --mps: verify-mps --overlap exit $without (1 or 2 wanted: not a PASS)"
    [ "$with" = 0 ] || rc=1
    case $without in 1 | 2) ;; *) rc=1 ;; esac
    return $rc
}
export -f overlap_check

cleanup() {
    trap - EXIT INT TERM
    local t0=$SECONDS
    echo "### cleanup" | tee -a "$OUT/mps_smoke.txt" >>"$OUT/scaling.txt"
    timeout -k 5 30 "$PY" bench/mps_smoke.py --work "$WORK/smoke" --cleanup \
        >>"$OUT/mps_smoke.txt" 2>&1
    # Every run left in the state dir: artifacts copied, `omni-dp down`; then any process of
    # this call still running (its OMNI_DP_STATE_DIR) is named; exit 0 only when none is.
    (cd bench && timeout -k 5 120 "$PY" launch_scaling.py --cleanup --state-dir "$STATE" \
        --out "$WORK/cleanup" --artifacts "$WORK/artifacts" --watch-dir "$WORK") \
        >>"$OUT/scaling.txt" 2>&1
    local clean=$?
    local pack=(artifacts)
    [ -d "$WORK/smoke/log" ] && pack+=(smoke/log)
    tar -czf "$OUT/artifacts.tar.gz" -C "$WORK" "${pack[@]}" 2>>"$OUT/scaling.txt"
    if [ "$clean" = 0 ]; then
        rm -rf "$WORK"
        summary "| cleanup | nothing left running | $((SECONDS - t0)) | scaling.txt |"
    else
        summary "| cleanup | PROCESSES LEFT (kept $WORK) | $((SECONDS - t0)) | scaling.txt |"
        STATUS=3
    fi
    {
        echo; echo "## DP table"; cat "$OUT/scaling.md"
        echo; echo "## gpu_check"; grep -E '^(ok|FAIL|RESULT|\{)' "$OUT/gpu_check.txt"
        echo; echo "## weight share"; grep -E '^(\||## )' "$OUT/share.txt"
        echo; echo "## two GPUs"; grep -E '^(RESULT|speech|skipped|omni-dp: MPS)' "$OUT/gpus2.txt"
        echo; echo "## overlap"; grep -E '^(## overlap|RESULT|GPU|    |overlap|skipped|omni-dp)' \
            "$OUT/overlap.txt"
        echo; echo "## MPS smoke (facts)"
        grep -E '^(binaries|gpu|daemon|client_pid|after_|start_server|quit|stopped)' \
            "$OUT/mps_smoke.txt" | cut -c1-700
        echo; echo "total $((SECONDS - START))s of a ${BUDGET}s budget, exit $STATUS"
    } >>"$OUT/summary.md"
    exit "$STATUS"
}
trap cleanup EXIT
trap 'STATUS=130; exit 130' INT TERM

summary "# gpu_run $(date -u '+%F %T') UTC: GPU $GPU, model $MODEL, budget ${BUDGET}s"
summary ""
summary "work dir $WORK (removed at the end unless something is left running)"
summary ""
summary "| step | result | s | output |"
summary "|---|---|---|---|"
step probe "$LIMIT_PROBE" probe.txt bash -c probe
step "mps smoke" "$LIMIT_SMOKE" mps_smoke.txt \
    "$PY" bench/mps_smoke.py --work "$WORK/smoke" --gpu "$SMOKE_GPU"
step gpu_check "$LIMIT_CHECK" gpu_check.txt \
    bash -c "cd bench && exec \"\$PY\" gpu_check.py '$MODEL' --device $DEVICE"
if [ "$SHARE_RUNS" = none ]; then
    echo "skipped: SHARE_RUNS=none" >>"$OUT/share.txt"
    summary "| weight share | skipped (SHARE_RUNS=none) | 0 | share.txt |"
else step "weight share" "$LIMIT_SHARE" share.txt bash -c "cd bench && exec \"\$PY\" weight_share.py \
    --replicas '$SHARE_REPLICAS' --runs '$SHARE_RUNS' --serve-args '--model $MODEL' --gpu '$GPU' \
    $SHARE_MPS --state-dir '$STATE' --out '$WORK/share' --artifacts '$WORK/artifacts' \
    --run-timeout 60 --recovery-timeout 40 --launch-args '--start-timeout 50 --on-mps-fault fail'"
fi
GPUS_HERE=0
[ "$GPU" = none ] || GPUS_HERE=$("$PY" -c 'import pynvml as n; n.nvmlInit(); print(n.nvmlDeviceGetCount())' 2>/dev/null || echo 0)
if [ "${GPUS_HERE:-0}" -lt 2 ]; then
    echo "skipped: ${GPUS_HERE:-0} GPU(s) here; one run over two GPUs needs two" >>"$OUT/gpus2.txt"
    summary "| two GPUs | skipped (${GPUS_HERE:-0} GPU(s) here) | 0 | gpus2.txt |"
else step "two GPUs" "$LIMIT_GPUS2" gpus2.txt bash -c 'two_gpus "$@"' two_gpus "$STATE" "$MODEL"
fi
if [ "$GPU" = none ]; then
    echo "skipped: GPU=none; the overlap of two replicas' GPU kernels needs a GPU" >>"$OUT/overlap.txt"
    summary "| overlap | skipped (no GPU) | 0 | overlap.txt |"
else step overlap "$LIMIT_OVERLAP" overlap.txt bash -c 'overlap_check "$@"' overlap_check \
    "$STATE" "$GPU" "$MODEL" "$OVERLAP_S" "$OVERLAP_CONCURRENCY"
fi
# `omni-dp bench` itself (opt-in: BENCH_CONFIGS=1,2mps,3mps; its sweep needs more device time
# than this call's budget leaves beside the DP table): the command a GPU session runs to record
# DP1 vs DP2/DP3 under MPS for the `small` preset, its JSON and figure under $OUT/bench/.
if [ -z "${BENCH_CONFIGS:-}" ] || [ "$GPU" = none ]; then
    echo "skipped: BENCH_CONFIGS unset (or GPU=none); to record, e.g. BENCH_CONFIGS=1,2mps,3mps" \
        >>"$OUT/bench.txt"
    summary "| bench | skipped (BENCH_CONFIGS unset) | 0 | bench.txt |"
else step bench "$(($(left) - TEARDOWN_RESERVE))" bench.txt env OMNI_DP_STATE_DIR="$STATE" \
    "$PY" -m omni_dp bench \
    --configs "$BENCH_CONFIGS" --trials 2 --duration 8 --warmup 2 --concurrency 32,96 \
    --out "$OUT/bench" -- --gpu "$GPU" --max-total-tokens 16384 --start-timeout 90 \
    -- --model "$MODEL"
fi
room=$(($(left) - TEARDOWN_RESERVE))
step "DP table" "$room" scaling.txt bash -c "cd bench && exec \"\$PY\" launch_scaling.py \
    --configs '$CONFIGS' --concurrency '$CONCURRENCY' --requests '$REQUESTS' \
    --serve-args '--model $MODEL' --gpu '$GPU' --state-dir '$STATE' --out '$OUT' \
    --artifacts '$WORK/artifacts' --watch-dir '$WORK' --config-timeout '$CONFIG_TIMEOUT' --budget $((room - 25)) \
    --launch-args '--start-timeout 90 --on-mps-fault fail'"
