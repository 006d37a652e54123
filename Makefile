# Where the Memory Goes — every target sets itself up from requirements.txt in .venv.
#   make book               build the site strictly; prints the path of index.html
#   make test               the whole test suite (what CI runs)
#   make lab                open the labs in JupyterLab (installs jupyterlab on first use)
#   make grade              the score table of the graded tests on your own labkit
#   make stubs              regenerate src/labkit exercise stubs from solutions/labkit
#   make student-edition DIR=../course-student   the repository without solutions/
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The student edition has no solutions/: then everything runs on the student's own code.
SOLUTIONS := $(if $(wildcard solutions/labkit),LABKIT_SOLUTIONS=$(CURDIR)/solutions,env -u LABKIT_SOLUTIONS)
# One process per test file group would cost more than it saves on 2 cores; tests run serially.
PYTEST := $(PY) -m pytest -p no:cacheprovider

# (the student edition's `make grade` is the instructor's score table)
.PHONY: test-compat compat-venv grade setup book test test-solutions test-stubs test-notebooks test-book lab stubs student-edition clean

$(VENV)/.installed: requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	touch $@

setup: $(VENV)/.installed

book: setup
	$(SOLUTIONS) $(VENV)/bin/jupyter-book build . -W -n --keep-going
	@echo "$(CURDIR)/_build/html/index.html"

# (b) the graded tests on the stubs: each must fail; (a) every test with the solutions;
# (c) every notebook under nbval; (d) the strict book build from scratch.
test: setup
	@start=$$(date +%s); \
	$(MAKE) --no-print-directory test-stubs test-solutions test-notebooks test-book && \
	echo "make test: all four parts passed in $$(( $$(date +%s) - start )) s"

test-solutions: setup
	$(SOLUTIONS) $(PYTEST) -q tests

test-stubs: setup
	env -u LABKIT_SOLUTIONS $(PYTEST) -q -m exercise --stubs-must-fail --tb=no tests

test-notebooks: setup
	$(SOLUTIONS) $(PYTEST) -q --nbval-lax --timeout=900 labs tests/notebooks

test-book: setup
	rm -rf _build
	$(MAKE) --no-print-directory book

grade: setup
	env -u LABKIT_SOLUTIONS $(PYTEST) -q -m exercise --grade --tb=no tests

lab: setup
	$(PY) -c "import jupyterlab" 2>/dev/null || $(PY) -m pip install -q jupyterlab
	$(VENV)/bin/jupyter lab labs

stubs: setup
	$(PY) tools/make_stubs.py

student-edition: setup
	@test -n "$(DIR)" || { echo "usage: make student-edition DIR=<new folder>"; exit 2; }
	$(PY) tools/student_edition.py "$(DIR)"

clean:
	rm -rf _build grades.json

# make test-compat TORCH=2.7.1: the solutions' tests and the labs on another torch, in its own
# venv (.venv-compat/torch-<version>, the rest of requirements.txt as pinned). Not part of make test.
COMPAT := .venv-compat/torch-$(TORCH)
compat-venv:
	@test -n "$(TORCH)" || { echo "usage: make test-compat TORCH=<version, e.g. 2.7.1>"; exit 2; }
	test -x $(COMPAT)/bin/python || $(PYTHON) -m venv $(COMPAT)
	test -f $(COMPAT)/.installed || { \
	  grep -v '^torch==' requirements.txt > $(COMPAT)/requirements.txt && \
	  $(COMPAT)/bin/python -m pip install -q --disable-pip-version-check "torch==$(TORCH)" -r $(COMPAT)/requirements.txt && \
	  $(COMPAT)/bin/python -m pip install -q --disable-pip-version-check --no-deps -e . && \
	  touch $(COMPAT)/.installed; }

test-compat: compat-venv
	@$(COMPAT)/bin/python -c "import torch, labkit; print('torch', torch.__version__, '| labkit imports')"
	$(SOLUTIONS) $(COMPAT)/bin/python -m pytest -p no:cacheprovider -q tests
	$(SOLUTIONS) $(COMPAT)/bin/python -m pytest -p no:cacheprovider -q --nbval-lax --timeout=900 labs
