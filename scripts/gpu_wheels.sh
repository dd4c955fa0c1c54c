#!/bin/bash
# Wheels for the GPU machine, in chunks small enough to travel one per command.
#
#   bash scripts/gpu_wheels.sh DEST [KV]   # DEST/p0..pN (<= 45 MiB each)
#
# The GPU machine (an H200 with Python 3.12 and torch 2.11+cu130, no package registry) gets
# everything as wheels: the pins in scripts/gpu_wheels.txt (vLLM 0.25.1, NIXL 1.5.1, what they
# and kvplane need beyond the image) plus a wheel of kvplane built from this checkout. They go
# into one tar, kvplane's wheel last, split into 45 MiB chunks (a chunk and the working tree,
# about 14 MiB, stay under the 64 MiB one device call carries): a change to kvplane only
# changes the last chunk. With KV, kvplane's wheel is written there instead and the chunks hold only the
# pinned wheels (the same bytes for every checkout). Downloads are cached in $KVPLANE_GPU_WHEELS (default /tmp/kvplane-gpu-wheels).
# Two large parts nobody uses on Hopper are cut out of their wheels to save a chunk: vLLM's
# FlashAttention 2 kernels (vLLM picks FlashAttention 3 on Hopper) and nixl-cu13's nixl_ep
# extension (built for newer torch; NIXL's transfer agent does not use it).
set -euo pipefail
DEST=${1:?usage: gpu_wheels.sh DEST [KV]}
KVOUT=${2:-}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
CACHE=${KVPLANE_GPU_WHEELS:-/tmp/kvplane-gpu-wheels}
PY=${PYTHON:-python3}
[ -x "$ROOT/.venv/bin/python" ] && [ -z "${PYTHON:-}" ] && PY="$ROOT/.venv/bin/python"
mkdir -p "$CACHE" "$DEST"
DEST=$(cd "$DEST" && pwd)

want=$(grep -c '==' "$HERE/gpu_wheels.txt")
have=$(find "$CACHE" -maxdepth 1 -name "*.whl" | wc -l)
if [ "$have" -lt "$want" ]; then
  plats=""
  for n in 17 24 26 27 28 31 34 35 39; do plats="$plats --platform manylinux_2_${n}_x86_64"; done
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --abi cp312 --abi abi3 --abi none $plats \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
    -d "$CACHE" -r "$HERE/gpu_wheels.txt"
  zip -q -d "$CACHE"/vllm-0.25.1-*.whl 'vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so' || true
  zip -q -d "$CACHE"/nixl_cu13-1.5.1-*.whl 'nixl_ep_cu13/*' || true
fi
have=$(find "$CACHE" -maxdepth 1 -name "*.whl" | wc -l)
[ "$have" -eq "$want" ] || { echo "gpu_wheels: $have wheels in $CACHE, the list pins $want" >&2; exit 1; }

# kvplane itself, from this checkout (pure Python: one wheel for every interpreter)
KV=$(mktemp -d)
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$KV" "$ROOT" >/dev/null
rm -f "$DEST"/p? "$DEST"/p??
(cd "$CACHE" && tar -cf - $(ls *.whl | sort)) > "$KV/all.tar"
if [ -n "$KVOUT" ]; then
  mkdir -p "$KVOUT" && rm -f "$KVOUT"/kvplane-*.whl && cp "$KV"/kvplane-*.whl "$KVOUT/"
  ls -l "$KVOUT"/kvplane-*.whl
else
  (cd "$KV" && tar -rf all.tar kvplane-*.whl)
fi
split -b 45M -d -a 1 "$KV/all.tar" "$DEST/p"
rm -rf "$KV"
ls -l "$DEST"/p?
