# Two commands a new user needs: `make demo` and `make test`. Each creates or
# refreshes the virtual environment it runs in.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test bench binder-check install-check clean

$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[jax,torch,plots,examples,test]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/run_quickstart.py

test: $(STAMP)
	$(PY) -m ruff check .
	scripts/ensure_chromium.sh
	scripts/ensure_sshd.sh
	$(PY) -m pytest $(PYTEST_ARGS)

binder-check:
	scripts/check_binder.sh

# The first install outside this checkout: wheel + sdist, twine check, a 2-host cell from the wheel alone.
install-check: $(STAMP)
	PYTHON=$(PY) scripts/check_install.sh

bench: $(STAMP)
	$(PY) benchmarks/launch_overhead.py

clean:
	rm -rf $(VENV) build .pytest_cache .ruff_cache
