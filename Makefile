# kvplane: two commands on a fresh machine.
#   make demo   set up, run the main job on the embedded defaults (SQLite, simulator)
#   make test   set up, start the services the tests need, run the whole suite
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
EXTRAS ?= sim,postgres,dev
STAMP  := $(VENV)/.installed-$(subst ,,$(EXTRAS))

.PHONY: demo test setup system-deps lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip setuptools wheel

$(STAMP): pyproject.toml | $(PY)
	$(PIP) install --quiet -e ".[$(EXTRAS)]"
	touch $@

setup: $(STAMP)

# Debian's PostgreSQL server for the store's contract tests (tests/conftest.py starts and stops it).
system-deps:
	@bash scripts/system_deps.sh

demo: setup
	$(VENV)/bin/kvplane demo

test: system-deps setup
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check core store sim live dashboard kvplane tests
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) kvplane.db kvplane.db-wal kvplane.db-shm
