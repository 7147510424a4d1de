# The two commands a new user needs are `make run` and `make test`; everything else is for developers.
SHELL := /bin/bash
PYTHON ?= python3
PYTEST_ARGS ?= -ra
VENV ?= .venv
PY := $(VENV)/bin/python
RUN_STAMP := $(VENV)/.installed-run
STAMP := $(VENV)/.installed-test

.PHONY: run test lint proto venv clean bench

$(VENV)/bin/python:
	@./scripts/ensure-python.sh "$(PYTHON)" "$(VENV)"

$(RUN_STAMP): $(VENV)/bin/python pyproject.toml
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	@touch $(RUN_STAMP)

$(STAMP): $(RUN_STAMP)
	$(PY) -m pip install --quiet -e '.[test]'
	@touch $(STAMP)

venv: $(STAMP)

run: $(RUN_STAMP)
	$(VENV)/bin/llmgw up $(ARGS)

test: $(STAMP)
	$(MAKE) --no-print-directory lint
	$(PY) -m pytest $(PYTEST_ARGS); status=$$?; if [ $$status -eq 5 ]; then echo "pytest collected no tests: failing" >&2; fi; exit $$status

lint: $(STAMP)
	$(VENV)/bin/ruff check llmgw tests bench
	$(VENV)/bin/ruff format --check llmgw tests bench
	$(VENV)/bin/mypy

proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. --pyi_out=. llmgw/proto/control.proto

bench: $(STAMP)
	$(PY) bench/gateway.py

clean:
	rm -rf $(VENV) build dist *.egg-info
