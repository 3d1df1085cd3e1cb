# `make run` and `make test` each set up .venv idempotently, then run.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint install clean

$(STAMP): pyproject.toml requirements.lock
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements.lock
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/python scripts/rollout.py

test: $(STAMP)
	$(BIN)/ruff check rollout trainer_hooks scripts tests
	$(BIN)/python -m pytest -x -p no:cacheprovider -n 2 --dist loadfile tests  # two workers, a file each

clean:
	rm -rf $(VENV)
