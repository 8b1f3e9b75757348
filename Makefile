# The two commands of the README. Both create or reuse .venv and install what is needed.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: run test setup lint proto bench
setup:
	@bash scripts/setup.sh

run: setup
	$(VENV)/bin/pdcluster up --prefill 1 --decode 1 --connector p2p --demo-request

# The pytest script, not `python -m pytest`: -m would put the checkout root on sys.path, and its
# kernels/ folder would shadow the `kernels` distribution that transformers imports.
test: setup
	$(PY) -m ruff check .
	$(VENV)/bin/pytest -q

lint: setup
	$(PY) -m ruff check .

proto: setup
	$(PY) scripts/gen_proto.py
