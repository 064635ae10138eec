# distlab -- the README's two commands:
#   make run    set everything up (venv, distlab, torch, Fashion-MNIST) and run the main job
#   make test   set everything up and run the test suite
PYTHON ?= python3
VENV   ?= .venv
# This machine has PyTorch 2.13.0's CPU build on disk; a looser pin would download a CUDA build.
TORCH  ?= torch==2.13.0
NPROC  ?= 2
BIN    := $(VENV)/bin

.PHONY: setup data run test clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install "$(TORCH)"
	$(BIN)/python -m pip install -e ".[test]"
	touch $@

data:
	@sh scripts/install-data.sh

run: setup data
	rm -rf runs/quickstart  # the main job's own output, made afresh each time (a new run never overwrites another's)
	$(BIN)/distlab train --nproc-per-node $(NPROC) --model mlp --dataset fashion-mnist --epochs 1 --out runs/quickstart

test: setup data
	$(BIN)/python -m pytest -n auto --dist worksteal   # every core (pytest-xdist; an idle worker takes queued tests): each test takes free ports and its own temp dirs

clean:
	rm -rf $(VENV) runs .pytest_cache
