# `make run` and `make test` each create .venv if it is missing, install meshplace into it,
# and then run. Nothing else needs to be installed by hand.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint format bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	mkdir -p out
	$(BIN)/meshplace workloads
	$(BIN)/meshplace plan nmt --cluster colocrl-4gpu --placer all \
		--out out/nmt.plan.json --result out/nmt.result.json
	$(BIN)/meshplace report out/nmt.result.json --html out/nmt.html

test: $(STAMP)
	# The report test opens a report in headless Chromium (Debian's package).
	command -v chromium >/dev/null || (apt-get update && apt-get install -y --no-install-recommends chromium)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples
	# Each of the suite's ~100 worker, rank and command-line processes imports meshplace;
	# with PYTHONDONTWRITEBYTECODE set (as here) none writes bytecode, so each compiled the
	# sources again (~0.2 s a process): compile them once.
	$(BIN)/python -m compileall -q src > /dev/null
	$(BIN)/python -m pytest -n 2 --dist loadfile

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples

format: $(STAMP)
	$(BIN)/ruff format src tests benchmarks examples
	$(BIN)/ruff check --fix src tests benchmarks examples

bench: $(STAMP)
	$(BIN)/python benchmarks/capture.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache
