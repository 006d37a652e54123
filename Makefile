# Where the Memory Goes — every target sets itself up from requirements.txt in .venv.
#   make book               build the site strictly; prints the path of index.html
#   make test               the whole test suite (what CI runs), with the time of each part
#   make site-check         the built site in headless Chromium, with screenshots
#   make lab                open the labs in JupyterLab (installs jupyterlab on first use)
#   make grade              the score table of the graded tests on your own labkit
#   make autograder         a Gradescope autograder zip (_build/autograder.zip) running labkit-grade
#   make stubs              regenerate src/labkit exercise stubs from solutions/labkit
#   make student-edition DIR=../course-student   the repository without solutions/
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The student edition has no solutions/: then everything runs on the student's own code.
SOLUTIONS := $(if $(wildcard solutions/labkit),LABKIT_SOLUTIONS=$(CURDIR)/solutions,env -u LABKIT_SOLUTIONS)
# make test runs its parts two at a time (tools/make_test.py): the machine has 2 cores.
PYTEST := $(PY) -m pytest -p no:cacheprovider

# (the student edition's `make grade` is the instructor's score table)
.PHONY: lint test-two-nodes autograder site-check test-compat compat-venv grade setup book test test-solutions test-stubs test-notebooks test-book notebooks lab stubs student-edition clean bench mutants test-gpu

$(VENV)/.installed: requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --no-compile -r requirements.txt
	@# pip compiles every module one by one (half of the install's ~60 s); both cores do it in
	@# ~17 s. It exits 1 where a package ships a file that is not Python 3.11 (pip ignores those too).
	$(PY) -m compileall -q -j 0 $$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))') > /dev/null || true
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	touch $@

setup: $(VENV)/.installed

# In the student edition (no solutions/) the chapters' outputs come precomputed (precomputed/,
# written by `make student-edition`): they run the reference solutions, which it does not have.
book: setup
	@if [ ! -d solutions/labkit ] && [ -d precomputed/.jupyter_cache ]; then \
	  mkdir -p _build && rm -rf _build/.jupyter_cache && cp -r precomputed/.jupyter_cache _build/; fi
	@$(SOLUTIONS) $(VENV)/bin/jupyter-book build . -W -n --keep-going || { \
	  test -d solutions/labkit || echo "make book: a page had to be executed and failed. In the student edition the \
	chapters and labs run the reference solutions, which it does not include: their outputs ship precomputed in \
	precomputed/.jupyter_cache, and a page whose code cells you changed must be run again by the instructors \
	(make book in the full course repository)."; exit 1; }
	@echo "$(CURDIR)/_build/html/index.html"

# make test (tools/make_test.py): (1) the graded tests must FAIL on the stubs, side by side with
# every test on the solutions, the two-node torchrun job and ruff; (2) nbval executes every
# notebook (chapters, labs, tests/notebooks) once, two kernels at a time, the chapters' outputs
# stored in _build/.jupyter_cache; (3) the strict book build from that cache (it executes
# nothing); (4) the site in headless Chromium. Prints the wall and CPU time of each part.
test: setup
	$(PY) tools/make_test.py

test-stubs: setup
	$(PY) tools/make_test.py --only stubs

test-solutions: setup
	$(PY) tools/make_test.py --only solutions,grader,cheats

test-notebooks: setup
	$(PY) tools/make_test.py --only notebooks

test-book: setup
	$(PY) tools/make_test.py --only book

test-two-nodes: setup
	$(PY) tools/make_test.py --only two-nodes

lint: setup
	$(PY) tools/make_test.py --only lint

# Every page of the built site in headless Chromium (1300 px, 390 px, dark mode), offline;
# screenshots in _build/site-check/. Installs Debian's chromium (apt) when none is on PATH.
site-check:
	tools/ensure_chromium.sh
	$(PY) tools/site_check.py

# nbval executes every notebook once (2 kernels), the chapters into the book's cache; `make book`
# then runs nothing. An instructor's check of the labs alone, with plain nbval:
#   LABKIT_SOLUTIONS=$PWD/solutions .venv/bin/python -m pytest --nbval-lax -n 2 --dist loadfile labs/
notebooks: setup
	$(SOLUTIONS) $(PY) tools/execute_notebooks.py

# The table is the result (exit 0 once it is written); -rN: no FAILED/ERROR line per test, the
# table lists each failure in the test's own words, and a lab not started is one line.
grade: setup
	env -u LABKIT_SOLUTIONS $(PYTEST) -q -rN -m exercise --grade --tb=no tests

# A Gradescope autograder: the course without solutions/, setup.sh and run_autograder, which
# grades /autograder/submission with labkit-grade (tools/autograder/).
autograder: setup
	$(PY) tools/autograder/build.py _build/autograder.zip

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
	@$(SOLUTIONS) $(COMPAT)/bin/python -m pytest -p no:cacheprovider -q tests; tests=$$?; \
	$(SOLUTIONS) $(COMPAT)/bin/python tools/execute_notebooks.py labs/*.ipynb \
	  --cache _build/compat/torch-$(TORCH)/.jupyter_cache; labs=$$?; \
	echo "make test-compat TORCH=$(TORCH): tests exit $$tests, labs exit $$labs"; \
	test $$tests -eq 0 -a $$labs -eq 0

# make bench [LAB=N]: reference solutions vs the libraries, as time ratios (each row its target: 1.5 for the same work; context rows none).
bench: setup
	$(SOLUTIONS) $(PY) -m tools.bench $(if $(LAB),--lab $(LAB))

# make mutants [LAB=N]: plausible student bugs planted in a copy of solutions/; the graders must
# catch >= 95% (per lab; the rate per exercise is printed). Writes _build/mutants.json.
mutants: setup
	@test -d solutions/labkit || { echo "make mutants needs solutions/ (the instructors' repository)"; exit 2; }
	@mkdir -p _build
	$(PY) -m tools.mutants $(if $(LAB),--lab $(LAB)) --json _build/mutants.json

# make test-gpu: every test and every notebook on a CUDA GPU (labs take the GPU sizes of
# labkit.models.lab_config), the CUDA-only tests included; prints which of those ran and passed
# and the wall time (budget: 8 minutes on one GPU). Logs in _build/gpu/ (tools/test_gpu.py).
# make test-gpu SYSTEM=1: the same with the Python on PATH ($(PYTHON)) as it is — its CUDA torch,
# no .venv, no pip, no network (labkit from src/): for a GPU machine without a package registry.
test-gpu: $(if $(SYSTEM),,setup)
	$(SOLUTIONS) $(if $(SYSTEM),$(PYTHON) tools/test_gpu.py --system,$(PY) tools/test_gpu.py)
