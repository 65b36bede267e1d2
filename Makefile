# Two commands for a fresh machine with Python 3.11 and pip: `make demo` and `make test`.
# torch is pinned: 2.13.0 is the CPU build (a bare `torch` pulls a multi-GB CUDA build).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
TORCH  := torch==2.13.0

.PHONY: demo test bench check clean

$(VENV)/.base:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install $(TORCH)
	$(PIP) install -e .
	touch $@

$(VENV)/.test: $(VENV)/.base pyproject.toml
	$(PIP) install $(TORCH) -e ".[test,plot]"
	touch $@

demo: $(VENV)/.base
	$(VENV)/bin/openmla demo

test: $(VENV)/.test
	$(PY) -m pytest

bench: $(VENV)/.test
	$(VENV)/bin/openmla bench

check: $(VENV)/.base
	$(VENV)/bin/openmla check

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
