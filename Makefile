# pagoda: make install | model | browser | test | test-reliability | run | bench | lint | clean   (GNU make)
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3
PIP := $(PY) -m pip --disable-pip-version-check
PIP_QUIET := -q
MODEL_DIR := models/smollm2-135m-instruct
TORCH_PKGS ?= torch==2.13.0 triton==3.6.0
ARGS ?=

.PHONY: install model browser test test-reliability test-all run bench lint clean distclean

install: $(VENV)/.installed

# Torch goes in first: a plain "torch" dependency with no torch present pulls the multi-GB CUDA build.
# Skipped where the venv already has a torch (e.g. the CUDA one on a GPU machine).
$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || { echo "pip install $(TORCH_PKGS)"; $(PIP) install $(PIP_QUIET) $(TORCH_PKGS); }
	@echo "pip install -e '.[test,convert,bench]'"
	@$(PIP) install $(PIP_QUIET) -e '.[test,convert,bench]'
	@touch $@

model: install
	$(PY) -m pagoda.prepare smollm2

# The console's browser test (tests/test_console_browser.py) drives Debian's chromium, headless: installed here
# when missing (CI starts from a clean clone, as root, with apt); nothing to do when it is present.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "apt-get install chromium (the console's browser test)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	      chromium fonts-dejavu-core >/dev/null; \
	  else echo "no chromium, and no apt-get as root to install it: install it, or the browser test fails"; fi; }

# Two pytest-xdist workers by default (CI's host has 2 cores and the suite leaves one mostly idle: its servers
# and clients wait on each other); a module's tests stay together on one worker (tests/conftest.py).
# TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2
test: install model browser
	PAGODA_BROWSER_REQUIRED=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=30 $(ARGS)

# Every reliability test, the long ones too (kill -9 / SIGSTOP of each process kind, the full load test).
test-reliability: install model
	$(PY) -m pytest -q -s -m "reliability_full or not reliability_full" tests/reliability $(ARGS)

test-all: install model browser
	PAGODA_BROWSER_REQUIRED=1 $(PY) -m pytest -q -m "" $(ARGS)

run: install model
	$(VENV)/bin/pagoda serve --model $(MODEL_DIR) $(ARGS)

bench: install
	$(VENV)/bin/pagoda bench throughput $(ARGS)

lint: install
	$(VENV)/bin/ruff check .

clean:
	rm -rf .pytest_cache .ruff_cache .hypothesis build dist bench/out
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

# Also removes the venv and the converted models (both take a while to rebuild).
distclean: clean
	rm -rf $(VENV) models
