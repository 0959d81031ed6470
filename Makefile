# Two commands a user needs: `make demo` and `make test`. Both create (or reuse) .venv in the checkout.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
VERL_STAMP := $(VENV)/.verl-stamp

.PHONY: setup setup-verl demo parity-demo test test-fast test-unit lint clean bench

setup: $(STAMP)

# torch first: otherwise megatron-core resolves a multi-GB CUDA torch plus nvidia-* packages.
$(STAMP): pyproject.toml setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[test,bench]'
	@$(BIN)/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('transformer_engine') is not None and 'transformer-engine is installed in a CPU venv: it breaks import megatron.core')"
	touch $(STAMP)

# The verl integration's tests (docs/verl.md): verl 0.9.1 with --no-deps (its metadata pins transformers < 5.11) and
# the packages its Megatron engine imports (pyproject's `verl` extra), all pinned by constraints/verl.txt.
setup-verl: $(VERL_STAMP)

$(VERL_STAMP): $(STAMP) constraints/verl.txt
	$(BIN)/python -m pip install -q --disable-pip-version-check -c constraints/verl.txt -e '.[test,bench,verl]'
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps -c constraints/verl.txt verl
	$(BIN)/python -c "import verl.workers.engine.megatron, verl.workers.engine_workers"
	touch $(VERL_STAMP)

# RL post-training of a tiny policy on an embedded task (GRPO, exact branch replay); a fresh run each time in
# runs/demo/ (the demo's own folder). `make parity-demo`: one exact step, naive vs packed vs replay gradients.
demo: $(STAMP)
	rm -rf runs/demo
	mkdir -p runs
	$(BIN)/megatron-branch train examples/configs/demo.yaml

parity-demo: $(STAMP)
	$(BIN)/python examples/parity_demo.py

test: $(STAMP) $(VERL_STAMP) lint
	$(BIN)/python -m pytest tests/unit tests/gpu -q -p no:cacheprovider
	$(BIN)/python tests/distributed/launch.py 2
	$(BIN)/python tests/distributed/launch.py 4
	$(BIN)/python tests/distributed/launch.py 8 -k cp8

# The edit-test loop: the unit tests not marked `slow` (under a minute on 2 cores). `make test` runs everything.
test-fast: $(STAMP)
	$(BIN)/python -m pytest tests/unit -q -p no:cacheprovider -m "not slow"

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
