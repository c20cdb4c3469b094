# `make demo` and `make test` each create .venv when it is missing, install, then run.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test install bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	# torch first, pinned to the CPU wheel, so no other requirement pulls a CUDA build
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[dev,ray]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/dapo demo

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) runs
