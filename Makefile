# Two commands do everything on a fresh machine with Python 3.11 and make:
#   make demo   set up, then run the main job
#   make test   set up, then run the test suite (the docs site's strict build and the docs' Python blocks included)
#   make docs   serve the docs site at http://127.0.0.1:8000 (rebuilds on every change)
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup demo test test-all lint docs clean

setup: $(STAMP)

# torch==2.13.0 first, so pip takes the local CPU build and not a CUDA download.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m ruff check .
	$(VENV)/bin/lint-imports
	HYPOTHESIS_PROFILE=ci $(PY) -m pytest -q -m "not slow" -n auto

test-all: $(STAMP)
	HYPOTHESIS_PROFILE=ci $(PY) -m pytest -q -n auto

docs: $(STAMP)
	PYTHONPATH=$(CURDIR) NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

lint: $(STAMP)
	$(PY) -m ruff check .
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .ruff_cache site
