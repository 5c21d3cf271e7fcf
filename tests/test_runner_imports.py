"""What each layer may import, checked in a fresh interpreter (click's test style).

The host-safe core must not pull in the client side; the display must not pull
in a backend, the poller or the client; the client must not pull in the display.
"""

import json
import subprocess
import sys

import pytest

#: What the host-safe core may load: the standard library, cloudpickle, and these parts of kinetic_nb.
HOST_SAFE_PACKAGES = ("kinetic_nb.runner", "kinetic_nb.agent", "kinetic_nb.storage", "kinetic_nb.errors")
HOST_SAFE_THIRD_PARTY = frozenset({"cloudpickle"})


@pytest.mark.parametrize(
    "module", ["kinetic_nb.runner", "kinetic_nb.runner.execute", "kinetic_nb.runner.__main__",
               "kinetic_nb.agent.__main__", "kinetic_nb.agent.supervisor", "kinetic_nb.agent.watch",
               "kinetic_nb.agent.ray_host",
               "kinetic_nb.storage", "kinetic_nb.errors"]
)
def test_host_side_imports_only_what_it_is_allowed(module):
    assert outside_allowlist(module) == []


def test_the_allowlist_names_what_the_client_side_loads():
    outside = outside_allowlist("kinetic_nb.magics")
    assert {"kinetic_nb.client", "kinetic_nb.magics", "IPython"} <= set(outside)


def outside_allowlist(module: str) -> list[str]:
    """What ``import module`` loads beyond the host-safe allowlist (and beyond a bare interpreter)."""
    outside = []
    already = set(loaded_by("json"))  # what the interpreter and site-packages' hooks load before any import
    for name in sorted(set(loaded_by(module)) - already):
        top = name.split(".")[0]
        if name == "kinetic_nb" or any(name == p or name.startswith(p + ".") for p in HOST_SAFE_PACKAGES):
            continue
        if name.startswith("kinetic_nb.") or not (top in sys.stdlib_module_names or top.lstrip("_") in
                                                  sys.stdlib_module_names or top in HOST_SAFE_THIRD_PARTY):
            outside.append(name)
    return outside


def loaded_by(module: str) -> list[str]:
    """Every module a fresh interpreter holds after ``import module``."""
    code = f"import json, sys, {module}; print(json.dumps(sorted(sys.modules)))"
    return json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout)


def pulled_in(module: str, forbidden: tuple[str, ...]) -> list[str]:
    """The modules ``import module`` loads that are, or are inside, one of ``forbidden``."""
    return [name for name in loaded_by(module) if any(name == f or name.startswith(f + ".") for f in forbidden)]


@pytest.mark.parametrize("module", ["kinetic_nb.display", "kinetic_nb.display.panel", "kinetic_nb.display.timeline",
                                    "kinetic_nb.state"])
def test_the_display_never_imports_a_backend_the_poller_or_the_client(module):
    assert pulled_in(module, ("kinetic_nb.backends", "kinetic_nb.poller", "kinetic_nb.client", "kubernetes")) == []


@pytest.mark.parametrize("module", ["kinetic_nb.client", "kinetic_nb.catalog"])
def test_the_client_never_imports_the_display(module):
    assert pulled_in(module, ("kinetic_nb.display", "ipywidgets", "matplotlib")) == []


def test_a_handle_is_shown_in_a_process_that_never_imported_the_display():
    code = """
import sys
import kinetic_nb.client
from kinetic_nb import views
from kinetic_nb.state import JobSnapshot, JobStatus
assert "kinetic_nb.display" not in sys.modules
print(views.render("text", JobSnapshot("kn-x", "local", "cpu", JobStatus.PENDING, 0.0, 1.0, ())))
"""
    shown = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert shown.startswith("kn-x · local · cpu · 0 hosts · 1.0 s · PENDING")


def test_public_api():
    import kinetic_nb

    assert set(kinetic_nb.__all__) == {*kinetic_nb._EXPORTS, "load_ipython_extension", "__version__"}
    for name in kinetic_nb.__all__:
        assert getattr(kinetic_nb, name) is not None
