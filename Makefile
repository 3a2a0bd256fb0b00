# llmkit — two commands: `make lab` and `make test`. Every target sets up .venv first.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
PORT ?= 8080

help:
	@echo "make lab     set everything up, then open the course notebooks in JupyterLab"
	@echo "make test    set everything up, then run every test (unit, servers, browser, notebooks)"
	@echo "make test-fast   the model-free tests only, in seconds (the inner loop)"
	@echo "make test-editions   every chapter in both editions (make test runs each chapter once, in one edition)"
	@echo "make test-busy   the notebooks beside a process that keeps one core busy; reports the wall time"
	@echo "make lint    ruff (lint + format check) and mypy: the gates make test runs first"
	@echo "make bench   side-by-side benchmark of the servers (writes bench-results/)"
	@echo "make llama-server   build the real llama-server from the same llama.cpp (once, ~7 min on 2 cores; make test does it)"
	@echo "make serve-sequential | serve-slots   run a server on port $(PORT)"
	@echo "make book    build the course as a site, English and Japanese (book/_build/html/index.html)"

# First run compiles llama.cpp (about 5 minutes on 2 cores); pip caches the wheel afterwards.
$(INSTALLED): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install --quiet --upgrade pip
	@echo "Installing llmkit and its dependencies (first time: llama.cpp is compiled, ~5 min; full log: $(VENV)/install.log)"
	@$(PY) -m pip install -v -e '.[dev]' 2>&1 | $(PY) scripts/install_progress.py $(VENV)/install.log \
		|| { echo "pip install failed; last lines of $(VENV)/install.log:"; tail -40 $(VENV)/install.log; exit 1; }
	@touch $@

install: $(INSTALLED)

# The browser tests drive Debian's Chromium through chromedriver; the book test also needs a font with Japanese
# glyphs (Noto CJK), else Japanese pages draw boxes ("tofu"). Bubblewrap (bwrap) is the cage `llmkit exercises grade`
# runs each submission in (tests/test_classroom.py).
BROWSER_PACKAGES := chromium chromium-driver fonts-noto-cjk bubblewrap
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null && command -v bwrap >/dev/null && fc-list :lang=ja | grep -q .; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
		echo "Installing Debian's $(BROWSER_PACKAGES) for the browser tests"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(BROWSER_PACKAGES) >/dev/null; \
	else \
		echo "The browser and grading tests need Chromium, a Japanese font and bubblewrap. Run once:  sudo apt-get install -y $(BROWSER_PACKAGES)"; \
	fi

# The real llama-server, from the llama.cpp source of the installed llama-cpp-python: built once (~7 min on
# 2 cores, with a progress line), kept in the user data folder. `make lab` does not wait for it: the first
# notebook cell that needs it builds it.
llama-server: $(INSTALLED)
	@$(PY) -m llmkit upstream build

# The gates, first in make test (configured in pyproject.toml): lint, formatting (check only: `ruff format` applies
# it), types.
lint: $(INSTALLED)
	$(VENV)/bin/ruff check
	$(VENV)/bin/ruff format --check
	$(VENV)/bin/mypy

# Each chapter runs once, in one edition: the code cells of notebooks/ja are notebooks/en's (tests/test_notebooks.py),
# and every label either prints has its translation with the same placeholders (tests/test_course.py). Even chapters
# run in English, odd ones in Japanese, so every run also exercises the Japanese catalogs, fonts and counts live.
# `make test-editions` runs every chapter in both (after re-executing a chapter, say).
CHAPTERS := $(wildcard notebooks/en/[0-9][02468]_*.ipynb) $(wildcard notebooks/ja/[0-9][13579]_*.ipynb)

test: $(INSTALLED) lint browser llama-server
	$(PY) -m pytest tests $(CHAPTERS) --nbval-lax -p no:cacheprovider $(PYTEST_ARGS)

test-editions: $(INSTALLED) llama-server
	$(PY) -m pytest notebooks/en notebooks/ja --nbval-lax -p no:cacheprovider $(PYTEST_ARGS)

# The inner loop: model-free tests only (seconds); make test still runs everything.
test-fast: $(INSTALLED)
	$(PY) -m pytest tests -m "not slow" -p no:cacheprovider $(PYTEST_ARGS)

# The notebooks as make test runs them, beside a child that spins on one core (killed at the end, whatever
# happens): every notebook must hold on a busy machine too. PYTEST_ARGS="notebooks/en/00_start_here.ipynb" runs one.
test-busy: $(INSTALLED) llama-server
	$(PY) scripts/test_busy.py $(PYTEST_ARGS)

# Root (containers, CI machines) needs --allow-root; LAB_ARGS passes anything else (--no-browser --port 8890).
lab: $(INSTALLED)
	$(VENV)/bin/jupyter lab notebooks/ $(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_ARGS)

# Add servers or options: make bench BENCH_ARGS="--url llama-server=http://127.0.0.1:8081"
bench: $(INSTALLED)
	$(VENV)/bin/llmkit bench --rounds 3 --soak 1000 --greedy-runs 25 $(BENCH_ARGS)

serve-sequential: $(INSTALLED)
	$(VENV)/bin/llmkit serve sequential --port $(PORT)

serve-slots: $(INSTALLED)
	$(VENV)/bin/llmkit serve slots --port $(PORT)

# Both editions (notebooks/en, notebooks/ja), one Jupyter Book build each, under a landing page:
# book/_build/html/index.html, en/, ja/ (book/build.py). BOOK_ARGS="-W" turns warnings into errors.
book: $(INSTALLED)
	$(PY) book/build.py $(BOOK_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info bench-results book/_build

.PHONY: help install browser llama-server lint test test-editions test-fast test-busy lab bench serve-sequential serve-slots book clean
