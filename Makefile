# Two commands a new user needs: `make demo` and `make test`. Each creates or
# refreshes the virtual environment it runs in: the demo installs only what the
# quickstart notebook needs (the jax, plots and demo extras); the tests install
# every extra. One environment serves both: the test install is a superset of
# the demo's, so it marks the demo's as done too.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO_STAMP := $(VENV)/.demo-stamp
TEST_STAMP := $(VENV)/.test-stamp
DEMO_EXTRAS := jax,plots,demo
TEST_EXTRAS := $(DEMO_EXTRAS),torch,examples,test

.PHONY: demo test bench binder-check install-check clean

# A newer pip than the one venv bundles resolves and installs these in about two thirds of the time. The
# packages are compiled as they are installed (40 of the test install's 71 s here): the tests' ssh hosts log
# in as other users, who cannot write bytecode into this environment and would compile jax and torch from
# source on every import (the suite took 2 minutes longer with --no-compile).
$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(DEMO_STAMP): setup.cfg pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e ".[$(DEMO_EXTRAS)]"
	touch $(DEMO_STAMP)

# jsonschema's format-nongpl extra (which jupyter-events asks for) brings rfc3987-syntax, whose import builds
# 38 grammars: 2.9 s of CPU in every process that imports jsonschema, as every Ray worker and raylet agent does
# (`import ray` 3.5 s against 0.8 s without it; the tests' 4-node cluster up in 57 s against 30 s), and
# JupyterLab and nbformat do. It is only jsonschema's checker of the `iri` and `iri-reference` formats, which
# jsonschema lets pass unchecked without it. Lift this once it imports lazily
# (python -X importtime -c "import jsonschema").
$(TEST_STAMP): setup.cfg pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e ".[$(TEST_EXTRAS)]"
	$(PY) -m pip uninstall --quiet --yes rfc3987-syntax
	touch $(TEST_STAMP) $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(PY) examples/run_quickstart.py

test: $(TEST_STAMP)
	$(PY) -m ruff check .
	scripts/ensure_chromium.sh
	scripts/ensure_sshd.sh
	$(PY) -m pytest -n 2 $(PYTEST_ARGS)

binder-check:
	scripts/check_binder.sh

# The first install outside this checkout: wheel + sdist, twine check, a 2-host cell from the wheel alone.
install-check: $(TEST_STAMP)
	PYTHON=$(PY) scripts/check_install.sh

bench: $(TEST_STAMP)
	$(PY) benchmarks/launch_overhead.py

clean:
	rm -rf $(VENV) build .pytest_cache .ruff_cache
