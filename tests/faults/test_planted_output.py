"""A file name planted by another user, listed by the victim's cell, is text in the victim's notebook (issue #38).

As two real unprivileged users (``two_users``): the attacker leaves a file in
the shared 0777 directory whose name is b3f2552's in-band display marker around
a record of ``text/html`` and ``application/javascript``; the victim's cell runs
``ls`` on that directory. The name reaches the victim's notebook as the text it
is, and nothing the notebook would run as code.
"""

# ruff: noqa: F811 - the two_users fixture is imported, then named by the test that uses it
from __future__ import annotations

import json
import os

import kinetic_nb
from kinetic_nb.runner import protocol
from tests.test_printed_text import ACTIVE, PAYLOAD
from tests.two_users import two_users  # noqa: F401


def _plant(shared: str) -> None:
    """As the attacker: a file named after the payload, where the victim lists."""
    open(os.path.join(shared, PAYLOAD), "w").close()


def _list_the_shared_directory(shared: str) -> list[tuple[str, str]]:
    """As the victim: a cell that lists the shared directory; what its echo showed."""
    os.environ.pop("KINETIC_STORAGE", None)  # root's test root is not the victim's to reach
    shown: list[tuple[str, str]] = []
    source = f"import subprocess\nsubprocess.run(['ls', {shared!r}], check=True)\nprint('listed')"
    job = kinetic_nb.submit(source, hosts=2, framework="none", storage=shared,
                            echo=lambda text, stream: shown.append((stream, text)))
    job.result(timeout=120)
    return shown


def test_a_planted_file_name_is_text_in_the_victims_output(two_users):
    shared = str(two_users.shared)
    two_users.attacker.run(_plant, shared)
    shown = two_users.victim.run(_list_the_shared_directory, shared)
    displays = [json.loads(text) for stream, text in shown if stream == protocol.DISPLAY]
    assert [record for record in displays if set(record.get("data", {})) & set(ACTIVE)] == []
    printed = "".join(text for stream, text in shown if stream == protocol.STDOUT)
    assert f"{PAYLOAD}\n" in printed and printed.endswith("listed\n")
