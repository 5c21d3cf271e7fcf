"""The README and docs/ as a newcomer reads them: every link leads somewhere, every example notebook is listed, and
"Reading the panel" explains every word the panel can show.

The panel's words are taken from the code (``HostState``, ``JobStatus``, ``state.phase_words``), so a state or a
phase added there without a line in the README fails here.
"""

from __future__ import annotations

import pathlib
import re
import urllib.parse

import pytest
from markdown_it import MarkdownIt

from kinetic_nb.runner.protocol import HostState, Phase
from kinetic_nb.state import JobStatus, phase_words

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: Links that leave the repository are not followed: the tests run offline.
EXTERNAL = ("http://", "https://", "mailto:")


def _targets(document: pathlib.Path) -> list[str]:
    """Every link's and image's target in ``document``, as written (code blocks and code spans hold none)."""
    targets = []
    for token in MarkdownIt("commonmark").parse(document.read_text()):
        for child in token.children or ():
            target = child.attrGet("href") if child.type == "link_open" else child.attrGet("src")
            if child.type in ("link_open", "image") and target:
                targets.append(str(target))
    return targets


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(document: pathlib.Path) -> set[str]:
    tokens = MarkdownIt("commonmark").parse(document.read_text())
    return {_slug(tokens[at + 1].content) for at, token in enumerate(tokens) if token.type == "heading_open"}


def _section(document: pathlib.Path, title: str) -> str:
    """The text under the ``## title`` heading, up to the next heading of its level."""
    text = document.read_text()
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    assert match, f"{document.name} has no '## {title}' section"
    return match.group(1)


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: path.name)
def test_every_link_leads_to_a_file_and_heading_that_exist(document):
    broken = []
    for target in _targets(document):
        if target.startswith(EXTERNAL):
            continue
        path, _, anchor = urllib.parse.unquote(target).partition("#")
        resolved = (document.parent / path).resolve() if path else document
        if not resolved.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{target} (no such heading)")
    assert broken == [], f"{document.name}: {broken}"


def test_the_examples_table_lists_every_notebook():
    listed = set(re.findall(r"\]\((examples/[^)]+\.ipynb)\)", _section(ROOT / "README.md", "Examples")))
    notebooks = {f"examples/{path.name}" for path in (ROOT / "examples").glob("*.ipynb")}
    assert notebooks and listed == notebooks


def test_reading_the_panel_explains_every_state_and_phase_the_panel_shows():
    section = _section(ROOT / "README.md", "Reading the panel")
    rows = set(re.findall(r"^\| (\S+) \|", section, re.MULTILINE))  # the first column of its tables
    assert {state.value for state in HostState} <= rows
    assert {status.value for status in JobStatus} <= rows
    said = " ".join(section.split())
    missing = [phase.value for phase in Phase if f"*{phase_words(phase.value)}*" not in said]
    assert missing == [], f"phases the panel shows that the README does not name: {missing}"
