# The README's two commands: `make swarm` and `make test`. Both set everything up first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.install-stamp
# The CPU wheel of torch 2.13.0 installs from local disk on the dev/CI machines; on a GPU box the same
# pin takes PyPI's CUDA build. Override with `make install TORCH_SPEC=...`.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install swarm test lint bench bench-quick clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

swarm: install
	$(BIN)/swarm local --config configs/tiny.yaml --peers 4

test: install
	$(BIN)/python -m pytest -q

lint: install
	$(BIN)/ruff check swarm peers tests bench

# Benchmarks: each entry of BENCHES is a module under bench/ run with `python -m`; add yours to the list.
# `bench-quick` passes --quick (shorter runs). Results land in bench/results/.
BENCHES := bench.compression

bench: install
	@for b in $(BENCHES); do echo "== $$b"; $(BIN)/python -m $$b || exit 1; done

bench-quick: install
	@for b in $(BENCHES); do echo "== $$b"; $(BIN)/python -m $$b --quick || exit 1; done

clean:
	rm -rf $(VENV) runs .pytest_cache
