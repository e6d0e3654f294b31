# Set-up on a fresh machine needs only Python 3.10+ and make:
#   make demo   create .venv, install shardio, generate a small image folder, pack, verify, read back
#   make test   create .venv, install shardio with test extras, run the test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# torch is pinned: 2.13.0 is the CPU build the project is tested with.
TORCH  ?= torch==2.13.0

.PHONY: install demo test bench peers clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml setup.py $(wildcard shardio/*.c)
	$(BIN)/python -m pip install -q "$(TORCH)" -e ".[test,bench]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/python tools/demo.py

test: install
	$(BIN)/python -m pytest -q

bench: install
	$(BIN)/python benchmarks/bench_pack.py

# The peer loaders the benchmarks compare with, in an environment of their own: LitData and
# MosaicML Streaming pin numpy<2.2, torchvision and transformers, which shardio's cannot take.
# benchmarks/bench_read.py runs their contenders with .venv-peers/bin/python (or
# $$SHARDIO_PEERS_PYTHON) when their library imports there.  `import streaming` imports
# torchvision, and PyPI's torchvision needs a torch with CUDA libraries (beside the 2.13.0 CPU
# build it fails with "operator torchvision::nms does not exist"), so this environment takes
# torch 2.14.1 with torchvision 0.29.1 (a CUDA build, about 5.5 GB; it runs on the CPU).
PEERS_VENV  ?= .venv-peers
PEERS_TORCH ?= torch==2.14.1 torchvision==0.29.1
peers:
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install -q $(PEERS_TORCH) "numpy<2.2" litdata mosaicml-streaming pillow psutil

clean:
	rm -rf demo-out .pytest_cache .hypothesis
