#!/usr/bin/env bash
# Binder's recipe, checked in a fresh virtual environment: binder/requirements.txt,
# then binder/postBuild, then every example's imports, and that torch is the
# CPU-only build (Binder has no GPU; the CUDA build is gigabytes).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=build/binder-venv
rm -rf "$venv"
python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet --no-compile -r binder/requirements.txt  # compiled as imported
PATH="$venv/bin:$PATH" bash binder/postBuild >/dev/null
KERAS_BACKEND=jax "$venv/bin/python" -c "
import kinetic_nb, kinetic_nb.notebook.magics, jax, torch, keras, matplotlib, ipywidgets
assert torch.version.cuda is None and torch.__version__.endswith('+cpu'), f'torch {torch.__version__} is not the CPU-only build'
print('binder environment ok: kinetic_nb', kinetic_nb.__version__, '| jax', jax.__version__, '| torch', torch.__version__)
"
rm -rf "$venv"
