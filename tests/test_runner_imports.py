"""What each layer may import, checked in a fresh interpreter (click's test style).

The host-safe core must not pull in the client side; the display must not pull
in a backend, the poller or the client; the client must not pull in the display.
"""

import ast
import json
import pathlib
import subprocess
import sys

import pytest

import kinetic_nb

#: What the host-safe core may load: the standard library, cloudpickle, cryptography (the shipped folder's and
#: the channel's encryption), and these parts of kinetic_nb.
HOST_SAFE_PACKAGES = ("kinetic_nb.runner", "kinetic_nb.agent", "kinetic_nb.storage", "kinetic_nb.errors")
HOST_SAFE_THIRD_PARTY = frozenset({"cloudpickle", "cryptography", "cffi", "_cffi_backend"})


@pytest.mark.parametrize(
    "module", ["kinetic_nb.runner", "kinetic_nb.runner.execute", "kinetic_nb.runner.__main__",
               "kinetic_nb.agent.__main__", "kinetic_nb.agent.supervisor", "kinetic_nb.agent.watch",
               "kinetic_nb.agent.ray_host",
               "kinetic_nb.storage", "kinetic_nb.errors"]
)
def test_host_side_imports_only_what_it_is_allowed(module):
    assert outside_allowlist(module) == []


def test_the_allowlist_names_what_the_client_side_loads():
    outside = outside_allowlist("kinetic_nb.notebook.magics")
    assert {"kinetic_nb.client.launch", "kinetic_nb.notebook.magics", "IPython"} <= set(outside)


def test_hosts_that_install_kinetic_nb_get_every_package_the_host_side_imports():
    """A pod or an ssh host installs kinetic_nb without its dependencies (no IPython there), and then
    HOST_DISTRIBUTIONS: each third-party package the host side may load must be one of them, or come with one
    (cffi with cryptography), else a host on a stock image fails at its first import of it."""
    from kinetic_nb.backends.host_environment import HOST_DISTRIBUTIONS, host_packages

    brought_along = {"cffi", "_cffi_backend"}
    assert HOST_SAFE_THIRD_PARTY - brought_along <= set(HOST_DISTRIBUTIONS)
    installed = " ".join(host_packages("file:///tmp/jobs"))
    assert all(name in installed for name in HOST_DISTRIBUTIONS), installed


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


PACKAGE = pathlib.Path(kinetic_nb.__file__).parent


def imports_of(path: pathlib.Path) -> set[str]:
    """The modules a source file imports by name: ``import a.b`` gives a.b; ``from a import b`` gives a and a.b."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def modules_under(folder: str) -> list[pathlib.Path]:
    return sorted((PACKAGE / folder).rglob("*.py"))


def reaching(folder: str, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    """Each module under ``folder`` (of the package) that imports one of ``forbidden`` or inside one, with what."""
    found = {}
    for path in modules_under(folder):
        bad = sorted(name for name in imports_of(path) if any(name == f or name.startswith(f + ".") for f in forbidden))
        if bad:
            found[str(path.relative_to(PACKAGE))] = bad
    return found


def test_the_layer_rules_are_tested_on_every_module():
    """The folders the rules below name exist and hold modules: a rule over an empty folder cannot fail."""
    for folder in ("notebook", "client", "shipping", "backends", "backends/kubernetes", "backends/ray"):
        assert len(modules_under(folder)) >= 2, folder
    assert imports_of(PACKAGE / "notebook" / "magics.py") >= {"kinetic_nb.client", "kinetic_nb.client.backend_options"}


def test_the_face_imports_no_backend():
    """The magics list what the backends declare through the client (``client.backend_options``)."""
    assert reaching("notebook", ("kinetic_nb.backends", "kubernetes", "ray")) == {}


def test_no_backend_imports_the_package_root():
    """A backend reads the package's version and files with importlib.metadata and importlib.resources."""
    root = {f"kinetic_nb.{name}" for name in kinetic_nb._EXPORTS} | {"kinetic_nb.__version__", "kinetic_nb.__file__"}
    found = {}
    for path in modules_under("backends"):
        source = path.read_text()
        bad = sorted(name for name in imports_of(path) if name == "kinetic_nb" or name in root)
        bad += ["kinetic_nb.__version__"] * ("kinetic_nb.__version__" in source)
        bad += ["kinetic_nb.__file__"] * ("kinetic_nb.__file__" in source)
        if bad:
            found[str(path.relative_to(PACKAGE))] = bad
    assert found == {}


def test_the_client_imports_nothing_of_the_face_or_the_display():
    assert reaching("client", ("kinetic_nb.notebook", "ipywidgets", "matplotlib", "IPython.core.magic")) == {}
    assert reaching("shipping", ("kinetic_nb.notebook", "kinetic_nb.client", "kinetic_nb.backends")) == {}


@pytest.mark.parametrize("module", ["kinetic_nb.notebook.display", "kinetic_nb.notebook.display.panel",
                                    "kinetic_nb.notebook.display.timeline", "kinetic_nb.state"])
def test_the_display_never_imports_a_backend_the_poller_or_the_client(module):
    assert pulled_in(module, ("kinetic_nb.backends", "kinetic_nb.client", "kubernetes")) == []


@pytest.mark.parametrize("module", ["kinetic_nb.client.launch", "kinetic_nb.client.catalog", "kinetic_nb.client.sessions",
                                    "kinetic_nb.client.cell_handle"])
def test_the_client_never_imports_the_display(module):
    assert pulled_in(module, ("kinetic_nb.notebook", "ipywidgets", "matplotlib")) == []


def test_a_handle_made_through_the_public_api_is_shown_by_the_display():
    code = """
import sys
import kinetic_nb.client.launch
from kinetic_nb import views
from kinetic_nb.state import JobSnapshot, JobStatus
snapshot = JobSnapshot("kn-x", "local", "cpu", JobStatus.PENDING, 0.0, 1.0, ())
try:
    views.render("text", snapshot)
except LookupError as error:
    print(error)
import kinetic_nb
kinetic_nb.submit  # the face wires the display in
print(views.render("text", snapshot))
"""
    shown = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    refused, table = shown.split("\n", 1)
    assert refused == ("no view 'text' is registered (known: none): import kinetic_nb.notebook.display, as "
                       "kinetic_nb's public API does")
    assert table.startswith("kn-x · local · cpu · 0 hosts · 1.0 s · PENDING")


#: Each public name and what it documents: the object it must be, by where it is defined.
PUBLIC_API = {
    "submit": "kinetic_nb.client.launch.submit",
    "last_job": "kinetic_nb.client.launch.last_job",
    "CellHandle": "kinetic_nb.client.cell_handle.CellHandle",
    "JobHandle": "kinetic_nb.client.cell_handle.CellHandle",
    "HostSnapshot": "kinetic_nb.state.HostSnapshot",
    "JobSnapshot": "kinetic_nb.state.JobSnapshot",
    "JobStatus": "kinetic_nb.state.JobStatus",
    "resolve_accelerator": "kinetic_nb.accelerators.resolve_accelerator",
    "accelerator_names": "kinetic_nb.accelerators.accelerator_names",
    "attach": "kinetic_nb.client.catalog.attach",
    "jobs": "kinetic_nb.client.catalog.jobs",
    "gc": "kinetic_nb.client.catalog.gc",
    "start": "kinetic_nb.client.sessions.start",
    "sessions": "kinetic_nb.client.sessions.sessions",
    "attach_session": "kinetic_nb.client.sessions.attach_session",
    "Session": "kinetic_nb.client.sessions.Session",
    "doctor": "kinetic_nb.backends.kubernetes.doctor.doctor",
    "load_ipython_extension": "kinetic_nb.load_ipython_extension",
}


def test_public_api(tmp_path):
    """Every exported name, twice, after ``%load_ext`` (which imports every submodule the magics use): still the
    function or class documented, never a submodule of the same name that an import put on the package."""
    code = f"""
import json
from IPython.testing.globalipapp import start_ipython
import kinetic_nb
shell = start_ipython()
shell.run_line_magic("load_ext", "kinetic_nb")
seen = {{}}
for attempt in range(2):
    for name in kinetic_nb.__all__:
        value = getattr(kinetic_nb, name)
        seen.setdefault(name, []).append(value if isinstance(value, str) else
                                         f"{{getattr(value, '__module__', '?')}}.{{getattr(value, '__qualname__', type(value).__name__)}}")
    listed = kinetic_nb.sessions(storage={str(tmp_path)!r})  # a call, as a user makes it, each time
    assert listed == [], listed
print(json.dumps(seen))
"""
    answer = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert answer.returncode == 0, answer.stderr[-2000:]
    seen = json.loads(answer.stdout.splitlines()[-1])
    assert set(kinetic_nb.__all__) == {*PUBLIC_API, "__version__"}
    assert seen.pop("__version__") == [kinetic_nb.__version__] * 2
    assert seen == {name: [where, where] for name, where in PUBLIC_API.items()}
