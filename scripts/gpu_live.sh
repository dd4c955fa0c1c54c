#!/bin/bash
# The GPU live suite (tests/gpu/gpu_live.py) on a GPU machine that has no package registry and
# takes at most ~64 MiB of files per command: vLLM 0.25.1 (CUDA 13), NIXL 1.5.1 and kvplane
# travel as wheel chunks, one chunk per command, the commands back to back.
#
# Here (a machine with the registries), once:
#   bash scripts/gpu_live.sh prepare CHUNKS SUITE
#       CHUNKS/p0..pN: the pinned wheels (scripts/gpu_wheels.sh);
#       SUITE: kvplane's wheel built from this checkout, the suite's files, this script, and
#       Debian's libfabric/hwloc .debs for the LIBFABRIC try (2 MB).
# There (the GPU machine, from a folder holding CHUNKS and SUITE), one command each:
#   bash SUITE/scripts/gpu_live.sh stage CHUNKS/p0        # ... and so on for p1..p(N-1)
#   bash SUITE/scripts/gpu_live.sh run CHUNKS SUITE OUT   # the last chunk: install + run all
# `run` installs into /tmp/kvplane-site (about 10 s), makes the tiny models, tries NIXL's
# LIBFABRIC backend with libfabric's tcp provider, runs the suites (three vLLM servers on the
# one GPU at a time: about 4 minutes for gpu_live.py, 3 for gpu_variants.py; GPU_SUITES picks)
# and writes gpu_live.json, gpu_variants.json, the suites' output and the servers' logs to
# OUT. It changes nothing outside /tmp.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
PARTS=/tmp/kvplane-parts
SITE=/tmp/kvplane-site

prepare() {
  local chunks=${1:?CHUNKS} suite=${2:?SUITE} root
  root=$(cd "$HERE/.." && pwd)
  set -e
  rm -rf "$suite"
  bash "$root/scripts/gpu_wheels.sh" "$chunks" "$suite/wheels"
  mkdir -p "$suite/tests/gpu" "$suite/tests/live" "$suite/scripts" \
    "$suite/debs"
  cp "$root/tests/gpu/gpu_live.py" "$root/tests/gpu/gpu_variants.py" \
    "$root/tests/gpu/gpu_prediction.py" "$root"/tests/gpu/gpu_prediction*.yaml \
    "$root/tests/gpu/libfabric_probe.py" "$suite/tests/gpu/"
  cp "$root/tests/live/servers.py" "$root/tests/live/tiny_model.py" \
    "$root/tests/live/tiny_mla_model.py" "$root/tests/live/live_workloads.py" \
    "$suite/tests/live/"
  cp "$root/scripts/gpu_live.sh" "$suite/scripts/"
  printf '[pytest]\nmarkers =\n    live: needs real vLLM and NIXL\naddopts = -ra\n' \
    > "$suite/pytest.ini"
  # NIXL's LIBFABRIC plugin links libfabric.so.1 (symbol version FABRIC_1.10) and
  # libhwloc.so.15; Debian's newest libfabric (trixie: 2.1) is fetched to see what happens.
  local lists=/tmp/kvplane-trixie
  mkdir -p "$lists/lists/partial"
  echo "deb http://deb.debian.org/debian trixie main" > "$lists/sources.list"
  local o="-oDir::Etc::SourceList=$lists/sources.list -oDir::Etc::SourceParts=/dev/null"
  o="$o -oDir::State::Lists=$lists/lists -oAPT::Architecture=amd64"
  apt-get $o update -qq
  (cd "$suite/debs" && apt-get $o download -qq libfabric1 libfabric-bin libhwloc15 \
    libibverbs1 librdmacm1t64 libpsm2-2 libnl-3-200 libnl-route-3-200 libnuma1 2>&1 \
    | grep -v unsandboxed || true)
  du -sh "$chunks" "$suite"
}

stage() {
  mkdir -p "$PARTS" && mv "${1:?chunk}" "$PARTS/" && ls -l "$PARTS"
}

# install CHUNKS SUITE OUT: the staged chunks and SUITE's wheels into $SITE, the environment
# every GPU command runs in, and the versions (OUT/versions.txt). Shared with gpu_transfer_pd.sh.
install() {
  local chunks=${1:?CHUNKS} suite=${2:?SUITE} out=${3:?OUT} t0=$SECONDS p
  mkdir -p "$out" "$PARTS" /tmp/kvplane-whl "$SITE"
  for p in "$chunks"/p?; do [ -e "$p" ] && mv "$p" "$PARTS/"; done
  cat "$PARTS"/p? | tar -xf - -C /tmp/kvplane-whl || { echo "chunks incomplete"; return 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
    /tmp/kvplane-whl/*.whl "$suite"/wheels/*.whl 2>&1 | grep -v -i warning | tail -5
  echo "installed $(ls /tmp/kvplane-whl | wc -l) wheels in $((SECONDS - t0)) s"
  export PYTHONPATH=$SITE PATH=$SITE/bin:$PATH PYTHONUNBUFFERED=1
  export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
  export VLLM_USE_FLASHINFER_SAMPLER=0
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c "import vllm, torch, nixl; print('vllm', vllm.__version__, 'torch', \
torch.__version__)"
    ldd --version | sed -n 1p  # sed reads to the end: head could end ldd with SIGPIPE (pipefail)
  } 2>&1 | tee "$out/versions.txt"
}

run() {
  local chunks=${1:?CHUNKS} suite=${2:?SUITE} out=${3:?OUT} t0=$SECONDS
  suite=$(cd "$suite" && pwd)
  install "$chunks" "$suite" "$out" || return 1
  export KVPLANE_TEST_LOGS=/tmp/kvplane-gpu-logs

  # LIBFABRIC with libfabric's tcp provider (no EFA NIC here)
  local fab=/tmp/kvplane-fabric
  mkdir -p "$fab"
  for d in "$suite"/debs/*.deb; do dpkg -x "$d" "$fab"; done
  local libs=$fab/usr/lib/x86_64-linux-gnu:$fab/lib/x86_64-linux-gnu
  {
    echo "== fi_info -p tcp"
    LD_LIBRARY_PATH=$libs FI_PROVIDER=tcp "$fab/usr/bin/fi_info" -p tcp 2>&1 | head -12
    echo "== ldd libplugin_LIBFABRIC.so (not found / version errors)"
    LD_LIBRARY_PATH=$libs ldd "$(find "$SITE" -path '*plugins/libplugin_LIBFABRIC.so' | head -1)" \
      2>&1 | grep -E "not found|version|fabric|hwloc" | head -12
    echo "== probe"
    LD_LIBRARY_PATH=$libs FI_PROVIDER=tcp timeout 120 python3 \
      "$suite/tests/gpu/libfabric_probe.py" 2>&1 | tail -15
  } > "$out/libfabric.txt" 2>&1
  cat "$out/libfabric.txt"

  # GPU_SUITES: which modules of tests/gpu (default both: gpu_live.py, then gpu_variants.py,
  # the unequal block sizes and MLA)
  local files=() f
  for f in ${GPU_SUITES:-gpu_live.py gpu_variants.py}; do files+=("tests/gpu/$f"); done
  (cd "$suite" && KVPLANE_GPU_REPORT=$out timeout "${GPU_TIMEOUT:-540}" python3 -m pytest -q \
    -c pytest.ini "${files[@]}" -p no:cacheprovider 2>&1 | tee "$out/pytest.txt")
  local rc=${PIPESTATUS[0]}
  (cd "$KVPLANE_TEST_LOGS" && tar -czf "$out/logs.tgz" . 2>/dev/null)
  echo "gpu_live: pytest exit $rc after $((SECONDS - t0)) s"
  return "$rc"
}

[[ "${BASH_SOURCE[0]}" == "$0" ]] || return 0  # sourced (gpu_transfer_pd.sh): functions only
case "${1:-}" in
  prepare) shift; prepare "$@" ;;
  stage) shift; stage "$@" ;;
  run) shift; run "$@" ;;
  *) echo "usage: gpu_live.sh prepare CHUNKS SUITE | stage CHUNK | run CHUNKS SUITE OUT" >&2
     exit 2 ;;
esac
