"""The host-safe core must not pull in the client side (click's test style)."""

import json
import subprocess
import sys

import pytest

FORBIDDEN = ("IPython", "ipywidgets", "traitlets", "matplotlib", "kubernetes", "kinetic_nb.client", "kinetic_nb.magics")


@pytest.mark.parametrize(
    "module", ["kinetic_nb.runner", "kinetic_nb.runner.execute", "kinetic_nb.runner.__main__",
               "kinetic_nb.agent.__main__", "kinetic_nb.agent.supervisor", "kinetic_nb.storage", "kinetic_nb.errors"]
)
def test_host_side_imports_stay_light(module):
    code = f"import json, sys, {module}; print(json.dumps(sorted(sys.modules)))"
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout)
    pulled_in = [name for name in loaded if name.split(".")[0] in FORBIDDEN or name in FORBIDDEN]
    assert pulled_in == []


def test_public_api():
    import kinetic_nb

    assert set(kinetic_nb.__all__) == {*kinetic_nb._EXPORTS, "load_ipython_extension", "__version__"}
    for name in kinetic_nb.__all__:
        assert getattr(kinetic_nb, name) is not None
