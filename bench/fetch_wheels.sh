#!/usr/bin/env bash
# The wheels the lent GPU machine's image lacks, downloaded here into .whl/ (ignored by git) for
# the device call to carry: `run` with carry [".whl"]; bench/gpu_run.sh installs them there with
# pip --no-index --no-deps --target and puts that folder on PYTHONPATH (no registry is reachable
# from that machine). About 4.1 MB.
#
# What omni-dp's serving path imports at module level and the image (python 3.12, x86_64) does
# not have: python-json-logger (omni_dp/logs.py), soundfile with cffi and pycparser
# (omni_dp/engine/audio.py), samplerate (omni_dp/engine/audio.py; its numpy is the image's),
# pyzmq (omni_dp/engine/links.py), msgspec (omni_dp/records.py: run.json and every record).
# One pinned version of each: two versions of one package stop the whole install there. To add
# one, append NAME==VERSION below (and its own needs that the image lacks:
# `unzip -p .whl/NAME-*.whl '*/METADATA' | grep ^Requires-Dist`), run this again, and rerun
# tests/test_gpu_run.py (it checks the list against pyproject.toml's dependencies and
# bench/device_image.txt).
#
#   bench/fetch_wheels.sh            # into .whl/, replacing what was there
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=(
    python-json-logger==4.2.0
    soundfile==0.14.0
    cffi==2.1.1
    pycparser==3.12
    samplerate==0.2.4
    pyzmq==27.3.0
    msgspec==0.23.0
)
DEST=${WHEEL_DIR:-.whl}
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64
           manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)

if [ "${1:-}" = --list ]; then printf '%s\n' "${WHEELS[@]}"; exit 0; fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
args=(--disable-pip-version-check -q download --no-deps --only-binary=:all: --python-version 3.12
      --implementation cp -d "$tmp")
for p in "${PLATFORMS[@]}"; do args+=(--platform "$p"); done
echo "fetch_wheels: ${WHEELS[*]} (cp312, manylinux x86_64) into $DEST" >&2
python3 -m pip "${args[@]}" "${WHEELS[@]}"
rm -rf "$DEST"
mkdir -p "$DEST"
mv "$tmp"/*.whl "$DEST"/
ls -1 "$DEST" >&2
du -sh "$DEST" >&2
