#!/usr/bin/env bash
# The first install, as a user meets it outside this checkout: build the sdist and
# the wheel (the wheel from the sdist, so the sdist must be complete), check their
# metadata with twine, then install only the wheel and its jax extra in a fresh
# virtual environment and run a 2-host cell there, through %%kinetic, from a
# directory where this checkout cannot be imported.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
# The interpreter with build and twine: the test extra's (make test creates it).
python=${PYTHON:-$root/.venv/bin/python}
dist=$root/build/dist
venv=$root/build/install-venv
rm -rf "$dist" "$venv"
"$python" -m build --outdir "$dist" . >/dev/null
"$python" -m twine check --strict "$dist"/*
wheel=$(ls "$dist"/kinetic_nb-*.whl)
python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet --no-compile "kinetic_nb[jax] @ file://$wheel"  # compiled as imported
workdir=$(mktemp -d)
trap 'rm -rf "$workdir"' EXIT
cd "$workdir"
env -u PYTHONPATH KINETIC_STORAGE="file://$workdir/jobs" "$venv/bin/python" - <<'PY'
import kinetic_nb
from IPython.core.interactiveshell import InteractiveShell

assert "site-packages" in kinetic_nb.__file__, f"imported from {kinetic_nb.__file__}, not the installed wheel"
shell = InteractiveShell.instance()
shell.run_cell("%load_ext kinetic_nb", store_history=True)
result = shell.run_cell(
    "%%kinetic -n 2 --quiet\n"
    "import jax, jax.numpy as jnp\n"
    "from jax.experimental import multihost_utils\n"
    "total = multihost_utils.process_allgather(jnp.ones(2) * jax.process_index()).sum()\n"
    "(jax.process_count(), float(total))",
    store_history=True,
)
assert result.error_in_exec is None, result.error_in_exec
assert result.result == (2, 2.0), result.result
print(f"first install ok: kinetic_nb {kinetic_nb.__version__} from its wheel ran a 2-host JAX cell: {result.result}")
PY
rm -rf "$venv"
