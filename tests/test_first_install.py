"""What a user meets first: the README's install lines, Binder's recipe, and what ``make demo`` installs.

The install itself (wheel + sdist, twine check, a 2-host cell from the wheel
alone) is scripts/check_install.sh, which .ci/run runs after the tests.
"""

from __future__ import annotations

import ast
import configparser
import importlib.metadata
import pathlib
import re
import subprocess
import sys

import nbformat
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = pathlib.Path(__file__).resolve().parent.parent
PLACEHOLDER = "YOUR-GITHUB-ACCOUNT"


def test_the_readme_says_what_to_replace_in_its_install_lines():
    readme = (ROOT / "README.md").read_text()
    assert not re.search(r"\bOWNER\b", readme)  # a bare placeholder nobody is told about
    badge, colab = readme.splitlines()[2], readme.split("%pip install", 1)[1].splitlines()[0]
    assert f"mybinder.org/v2/gh/{PLACEHOLDER}/kinetic_nb" in badge and f"github.com/{PLACEHOLDER}/kinetic_nb" in colab
    assert f"replace `{PLACEHOLDER}` with the GitHub" in " ".join(readme.split())


def test_binder_takes_torch_from_the_cpu_only_index_and_nothing_else_from_there():
    requirements = (ROOT / "binder" / "requirements.txt").read_text()
    post_build = (ROOT / "binder" / "postBuild").read_text()
    assert "torch" not in re.sub(r"#.*", "", requirements)  # the default index's torch is the CUDA build
    assert "index-url" not in requirements  # every other package would be looked up there too
    assert re.search(r'torch="torch==[\d.]+\+cpu"', post_build)
    assert '--no-deps --index-url https://download.pytorch.org/whl/cpu "$torch"' in post_build


# -- make demo: the quickstart's own needs, and nothing else --------------------------------------------------------

#: What the quickstart uses without importing it: the kernel nbclient starts, and what ``job.timeline()`` draws with.
USED_WITHOUT_AN_IMPORT = {"ipykernel", "matplotlib"}


def make_installs(target: str) -> set[str]:
    """The extras ``make TARGET`` installs kinetic_nb with, read from what make would run in a new environment."""
    commands = subprocess.run(["make", "--dry-run", "--always-make", target, "VENV=/nonexistent-venv"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout
    lists = re.findall(r'pip install .*-e "?\.\[([\w,-]+)\]', commands)
    assert len(lists) == 1, f"make {target} should install kinetic_nb once, with its extras: {commands}"
    return set(lists[0].split(","))


def requirement_names(extras: set[str]) -> set[str]:
    """The distributions kinetic_nb with ``extras`` asks for by name (install_requires included), normalized."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    lines = config["options"]["install_requires"].splitlines()
    for extra in extras:
        lines += config["options.extras_require"][extra].splitlines()
    return {canonicalize_name(Requirement(line).name) for line in map(str.strip, lines) if line and line[0] != "#"}


def quickstart_imports() -> set[str]:
    """The top-level modules the quickstart's cells (magic lines left out) and its headless runner import."""
    notebook = nbformat.read(ROOT / "examples" / "01_quickstart.ipynb", as_version=4)
    sources = ["\n".join(line for line in cell.source.splitlines() if not line.startswith("%"))
               for cell in notebook.cells if cell.cell_type == "code"]
    sources.append((ROOT / "examples" / "run_quickstart.py").read_text())
    modules = set()
    for node in ast.walk(ast.parse("\n".join(sources))):
        if isinstance(node, ast.Import):
            modules.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            modules.add(node.module.split(".")[0])
    return modules - set(sys.stdlib_module_names) - {"kinetic_nb"}


def test_make_demo_installs_what_the_quickstart_uses_and_nothing_else():
    distributions = importlib.metadata.packages_distributions()
    needed = {canonicalize_name(distributions[module][0]) for module in quickstart_imports()}
    needed |= USED_WITHOUT_AN_IMPORT
    installed = requirement_names(make_installs("demo"))
    assert needed <= installed, f"make demo does not install {sorted(needed - installed)}"
    # A bound on what those bring in anyway (jax's ml_dtypes) installs nothing more.
    brought_in = {canonicalize_name(Requirement(line).name) for name in needed
                  for line in importlib.metadata.requires(name) or () if "extra ==" not in line}
    unused = installed - needed - brought_in - requirement_names(set())
    assert not unused, f"make demo installs {sorted(unused)}, which the quickstart never uses"


def test_make_test_installs_everything_make_demo_does():
    # make test marks the demo's environment as done: that holds only while the test install is a superset.
    assert make_installs("demo") <= make_installs("test")


def test_binder_installs_the_demo_extra_as_make_demo_does():
    """Binder runs the same quickstart: the same headless runner and the same bound on what its JAX cells import."""
    post_build = (ROOT / "binder" / "postBuild").read_text()
    assert re.search(r'pip install [^\n]*"\$torch" "?\.\[demo\]"?\n', post_build)
