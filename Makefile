# Two commands a user needs: `make demo` and `make test`. Both create (or reuse) .venv in the checkout.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: setup demo test test-unit lint clean

setup: $(STAMP)

# torch first: otherwise megatron-core resolves a multi-GB CUDA torch plus nvidia-* packages.
$(STAMP): pyproject.toml setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[test,bench]'
	@$(BIN)/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('transformer_engine') is not None and 'transformer-engine is installed in a CPU venv: it breaks import megatron.core')"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

test: $(STAMP) lint
	$(BIN)/python -m pytest tests/unit tests/gpu -q -p no:cacheprovider
	$(BIN)/python tests/distributed/launch.py 2
	$(BIN)/python tests/distributed/launch.py 4
	$(BIN)/python tests/distributed/launch.py 8 -k cp8

test-unit: $(STAMP)
	$(BIN)/python -m pytest tests/unit -q -p no:cacheprovider

lint: $(STAMP)
	$(BIN)/ruff check megatron_branch tools examples tests benchmarks docs
	$(BIN)/ruff format --check megatron_branch tools examples tests benchmarks docs

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
