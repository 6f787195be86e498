# The README's two commands: `make swarm` and `make test`. Both set everything up first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.install-stamp
# The CPU wheel of torch 2.13.0 installs from local disk on the dev/CI machines; on a GPU box the same
# pin takes PyPI's CUDA build. Override with `make install TORCH_SPEC=...`.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install install-system swarm test durations test-fast lint bench bench-quick clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

swarm: install
	$(BIN)/swarm local --config configs/tiny.yaml --peers 4

# The headless-browser test of `swarm monitor` (tests/test_monitor_browser.py) needs Debian's chromium, and the
# NAT test (tests/net/test_nat.py) iptables, for a router namespace that masquerades: each installed here only
# when it is missing (as root, or through sudo).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
install-system:
	@command -v chromium >/dev/null 2>&1 || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq chromium; }
	@command -v iptables >/dev/null 2>&1 || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq iptables; }

# `test` runs every test on two workers (pytest-xdist; the modules that took longest go first, by
# tests/durations.json) and prints the 15 slowest. `durations` does the same and writes each module's seconds to
# tests/durations.json (commit it when modules were added or grew). `test-fast` (about a minute, for the edit
# loop) leaves out the tests marked `slow`: those that start peers, DHTs or `swarm` commands (each module marks
# them; tests/conftest.py says how). `make test TEST_WORKERS=0` runs them in this process.
TEST_WORKERS ?= 2
test: install install-system
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --maxschedchunk 2 --durations=15

durations: install install-system
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --maxschedchunk 2 --durations=15 --store-durations

test-fast: install
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --maxschedchunk 2 -m "not slow" --durations=15

lint: install
	$(BIN)/ruff check swarm peers tests bench

# Benchmarks: bench/run.py runs every module in its MODULES list (bench/<name>.py with run(quick) or main());
# `bench-quick` passes --quick (a few minutes). Results: bench/results/<name>.json and bench/results/README.md
# (committed, full runs only); a quick run writes the same files under runs/bench-quick/.
bench: install
	$(BIN)/python -m bench.run

bench-quick: install
	$(BIN)/python -m bench.run --quick

clean:
	rm -rf $(VENV) runs .pytest_cache
