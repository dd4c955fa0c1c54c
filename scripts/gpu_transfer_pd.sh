#!/bin/bash
# benchmarks/transfer_vllm_pd.py on the GPU machine (no package registry, at most ~64 MiB of
# files per command): the same wheel chunks as scripts/gpu_live.sh, staged one per command,
# commands back to back; the last command installs and runs the benchmark.
#
# Here (a machine with the registries), once:
#   bash scripts/gpu_transfer_pd.sh prepare SUITE
#       SUITE: kvplane's wheel built from this checkout and the benchmark's files (under 1 MiB,
#       so that it travels with the last wheel chunk).
# There, one command each (CHUNKS/p0..pN from scripts/gpu_wheels.sh):
#   bash SUITE/scripts/gpu_live.sh stage CHUNKS/p0            # ... p1, p2, p3
#   bash SUITE/scripts/gpu_transfer_pd.sh run CHUNKS SUITE OUT [benchmark arguments]
# `run` moves the remaining chunks in, installs everything into /tmp/kvplane-site (about 10 s)
# and runs the benchmark (seven vLLM servers on the one GPU; about 5 minutes with the
# defaults), writing transfer-vllm-pd.json, its output and the servers' logs to OUT. It
# changes nothing outside /tmp.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=gpu_live.sh
source "$HERE/gpu_live.sh"  # install, stage, PARTS and SITE

prepare() {
  local suite=${1:?SUITE} root
  root=$(cd "$HERE/.." && pwd)
  set -e
  rm -rf "$suite"
  mkdir -p "$suite/wheels" "$suite/benchmarks" "$suite/tests/live" "$suite/scripts"
  (cd "$root" && python3 -m pip wheel -q --no-deps --no-build-isolation -w "$suite/wheels" .)
  cp "$root/benchmarks/transfer_vllm_pd.py" "$root/benchmarks/live_pd.py" "$suite/benchmarks/"
  cp "$root/tests/live/servers.py" "$root/tests/live/tiny_model.py" "$suite/tests/live/"
  cp "$root/scripts/gpu_live.sh" "$root/scripts/gpu_transfer_pd.sh" "$suite/scripts/"
  du -sh "$suite"
}

run() {
  local chunks=${1:?CHUNKS} suite=${2:?SUITE} out=${3:?OUT}
  shift 3
  suite=$(cd "$suite" && pwd)
  local t0=$SECONDS
  install "$chunks" "$suite" "$out" || return 1
  export KVPLANE_BENCH_LOGS_TGZ=$out/logs.tgz
  (cd "$suite" && timeout "${BENCH_TIMEOUT:-540}" python3 benchmarks/transfer_vllm_pd.py \
    --json "$out/transfer-vllm-pd.json" --logs /tmp/kvplane-xfer-pd "$@" 2>&1 \
    | tee "$out/transfer-vllm-pd.txt")
  local rc=${PIPESTATUS[0]}
  [ -e "$out/logs.tgz" ] || (cd /tmp/kvplane-xfer-pd && tar -czf "$out/logs.tgz" ./*.log)
  echo "transfer_vllm_pd: exit $rc after $((SECONDS - t0)) s"
  return "$rc"
}

case "${1:-}" in
  prepare) shift; prepare "$@" ;;
  run) shift; run "$@" ;;
  *) echo "usage: gpu_transfer_pd.sh prepare SUITE | run CHUNKS SUITE OUT [ARGS]" >&2
     exit 2 ;;
esac
