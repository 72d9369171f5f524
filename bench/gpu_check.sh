#!/usr/bin/env bash
# The GPU checks: the same one-call script as bench/gpu_run.sh (kept under this name, which the
# project's notes use). Read gpu_run.sh for the steps, the files under $OUT and the knobs.
exec "$(dirname "$0")/gpu_run.sh" "$@"
