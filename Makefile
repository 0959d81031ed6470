# Two commands a user needs: `make demo` and `make test`. Both create (or reuse) .venv in the checkout, with the
# versions of constraints/lock.txt (one set for both: the demo runs the code the tests ran; test_versions.py checks).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
VERL_STAMP := $(VENV)/.verl-stamp
LOCK := constraints/lock.txt
PIP := $(BIN)/python -m pip install -q --disable-pip-version-check -c $(LOCK)

.PHONY: setup setup-verl demo parity-demo test test-fast test-unit test-latest lint clean bench

setup: $(STAMP)

# torch first: otherwise megatron-core resolves a multi-GB CUDA torch plus nvidia-* packages.
$(STAMP): pyproject.toml setup.py $(LOCK)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) torch
	$(PIP) -e '.[test,bench]'
	@$(BIN)/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('transformer_engine') is not None and 'transformer-engine is installed in a CPU venv: it breaks import megatron.core')"
	touch $(STAMP)

# The verl integration's tests (docs/verl.md): verl 0.9.1 with --no-deps (its metadata pins transformers < 5.11) and
# the packages its Megatron engine imports (pyproject's `verl` extra), all pinned by constraints/lock.txt.
setup-verl: $(VERL_STAMP)

$(VERL_STAMP): $(STAMP) $(LOCK)
	$(PIP) -e '.[test,bench,verl]'
	$(PIP) --no-deps verl
	$(BIN)/python -c "import verl.workers.engine.megatron, verl.workers.engine_workers"
	touch $(VERL_STAMP)

# RL post-training of a tiny policy on an embedded task (GRPO, exact branch replay); a fresh run each time in
# runs/demo/ (the demo's own folder); its printed lines (runs/demo.log) are then checked against the README's demo
# block within tools/demo_block.py's TOLERANCE. `make parity-demo`: one exact step, naive vs packed vs replay gradients.
demo: $(STAMP)
	rm -rf runs/demo
	mkdir -p runs
	PYTHONUNBUFFERED=1 bash -o pipefail -c '$(BIN)/megatron-branch train examples/configs/demo.yaml | tee runs/demo.log'
	$(BIN)/python tools/demo_block.py runs/demo.log --within

parity-demo: $(STAMP)
	$(BIN)/python examples/parity_demo.py

test: $(STAMP) $(VERL_STAMP) lint
	$(BIN)/python -m pytest tests/unit tests/gpu -q -p no:cacheprovider
	$(BIN)/python tests/distributed/launch.py 2
	$(BIN)/python tests/distributed/launch.py 4
	$(BIN)/python tests/distributed/launch.py 8 -k cp8

# The edit-test loop: the unit tests not marked `slow` (about 2 CPU-minutes; 5:23 wall on a loaded 2-core machine,
# 2026-12-07). `make test` runs everything.
test-fast: $(STAMP)
	$(BIN)/python -m pytest tests/unit -q -p no:cacheprovider -m "not slow"

# Weekly-style canary, NOT in CI (CI runs `make test` on the lock): a separate venv with the newest torch,
# transformers and megatron-core the registry serves (no lock), then the fast unit tests. What it installed is in
# $(LATEST_OUT)/freeze.txt; record what it found in docs/versions.md. megatron-branch supports megatron-core 0.16.1
# only (compat/ refuses others): a newer megatron-core shows up here as those refusals.
LATEST_VENV ?= .venv-latest
LATEST_OUT ?= latest-out
test-latest:
	test -x $(LATEST_VENV)/bin/python || $(PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/python -m pip install -q --disable-pip-version-check -U torch
	$(LATEST_VENV)/bin/python -m pip install -q --disable-pip-version-check -U -e '.[test,bench]' transformers
	$(LATEST_VENV)/bin/python -m pip install -q --disable-pip-version-check -U --no-deps megatron-core
	mkdir -p $(LATEST_OUT)
	$(LATEST_VENV)/bin/python -m pip freeze > $(LATEST_OUT)/freeze.txt
	$(LATEST_VENV)/bin/python -m pytest tests/unit -q -p no:cacheprovider -m "not slow" 2>&1 | tee $(LATEST_OUT)/pytest.txt

test-unit: $(STAMP)
	$(BIN)/python -m pytest tests/unit -q -p no:cacheprovider

# The fair benchmark (docs/performance.md): one run per preset, tables/JSON/plots under $(BENCH_OUT).
# Timed: run it on a quiet machine. `make bench BENCH_PRESETS=C` runs one configuration.
BENCH_PRESETS ?= A B C memory-G
BENCH_OUT ?= bench-out
bench: $(STAMP)
	mkdir -p $(BENCH_OUT)
	for p in $(BENCH_PRESETS); do \
		$(BIN)/python -m megatron_branch bench --preset $$p --json $(BENCH_OUT)/$$p.json \
			--markdown $(BENCH_OUT)/$$p.md --plot $(BENCH_OUT)/$$p-plots --overwrite || exit 1; \
	done

lint: $(STAMP)
	$(BIN)/ruff check megatron_branch tools examples tests benchmarks docs
	$(BIN)/ruff format --check megatron_branch tools examples tests benchmarks docs

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
