# kvplane: two commands on a fresh machine.
#   make demo   set up, run the main job on the embedded defaults (SQLite, simulator)
#   make test   set up, start the services the tests need, run the whole suite
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
EXTRAS ?= sim,postgres,dashboard,live,ray,dev
STAMP  := $(VENV)/.installed-kvplane
LIVE   := $(VENV)/.installed-live

.PHONY: demo test setup setup-live browser-deps system-deps lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip setuptools wheel

$(STAMP): pyproject.toml | $(PY)
	$(PIP) install --quiet -e ".[$(EXTRAS)]"
	touch $@

setup: $(STAMP)

# vLLM (CPU build) and NIXL for the live tests: about 2 minutes once, seconds afterwards.
$(LIVE): scripts/install_live.sh | $(PY)
	bash scripts/install_live.sh $(VENV)
	touch $@

setup-live: $(LIVE) $(STAMP)

# Debian's Chromium and the Playwright driver, for the dashboard's browser test.
browser-deps: $(STAMP)
	bash scripts/install_browser.sh $(VENV)

# Debian's PostgreSQL server for the store's contract tests (tests/conftest.py starts and stops it).
system-deps:
	@bash scripts/system_deps.sh

demo: setup
	$(VENV)/bin/kvplane demo

test: system-deps setup-live browser-deps
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check core store sim live dashboard kvplane tests
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) kvplane.db kvplane.db-wal kvplane.db-shm
