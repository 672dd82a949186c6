# Two entry points: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# pytest-xdist workers for `make test`: one per core (nproc honours CPU affinity), at most 8
JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); echo $$(( n < 8 ? n : 8 )))

.PHONY: venv test lint demo clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The CPU build of torch 2.13.0 is pinned first so nothing pulls a CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check thinkspec tests scripts benchmarks

test: lint
	$(BIN)/python -m pytest -q -n $(JOBS)

demo: $(STAMP)
	$(BIN)/thinkspec demo

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
