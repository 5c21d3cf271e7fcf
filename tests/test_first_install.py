"""What a user meets first, outside this checkout: the README's install lines and Binder's recipe.

The install itself (wheel + sdist, twine check, a 2-host cell from the wheel
alone) is scripts/check_install.sh, which .ci/run runs after the tests.
"""

from __future__ import annotations

import pathlib
import re

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
