#!/usr/bin/env bash
# Install what the dashboard's browser tests need: Debian's Chromium and the Python driver.
#
#   scripts/install_browser.sh [VENV]      VENV defaults to .venv
#
# 1. Debian's `chromium` package (apt-get), only when /usr/bin/chromium is missing. We never run
#    `playwright install`: it downloads a browser build of its own, which this workplace blocks;
#    the tests launch /usr/bin/chromium through Playwright's executable_path instead.
# 2. The `playwright` Python package into the virtual environment, only when it is missing.
# Idempotent: each step is skipped when already done.
set -euo pipefail

VENV="${1:-.venv}"
log() { printf '[install_browser] %s\n' "$*" >&2; }

if [ ! -x /usr/bin/chromium ]; then
  log "installing Debian's chromium"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq chromium >/dev/null
fi
/usr/bin/chromium --version >&2

if [ ! -x "$VENV/bin/python" ]; then
  log "no virtual environment at $VENV (run make setup first)"
  exit 1
fi
if ! "$VENV/bin/python" -c "import playwright" 2>/dev/null; then
  log "installing the playwright Python package"
  # (the grep drops one warning per package about this machine's unused local index folders)
  "$VENV/bin/python" -m pip --disable-pip-version-check install --quiet "playwright>=1.45" 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; }
  "$VENV/bin/python" -c "import playwright" 
fi
log "ready: /usr/bin/chromium and playwright in $VENV"
