# The two commands of the README. Both create or reuse .venv and install what is needed.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: run test setup lint proto bench
setup:
	@bash scripts/setup.sh

run: setup
	$(VENV)/bin/pdcluster up --prefill 1 --decode 1 --connector p2p --demo-request

test: setup
	$(PY) -m ruff check .
	$(PY) -m pytest -q

lint: setup
	$(PY) -m ruff check .

proto: setup
	$(PY) scripts/gen_proto.py
