"""The leader's output on its way to the cell (kinetic_nb.client.echo): chatter out, whatever the chunk boundaries."""

from __future__ import annotations

import pytest

from kinetic_nb.client.echo import LeaderEcho
from kinetic_nb.runner import protocol

GLOO = "[Gloo] Rank 0 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3\n"
JAX_START = ("I0000 00:00:1718000000.123456   12345 coordination_service_agent.cc:332] "
             "Coordination agent has successfully connected.\n")
JAX_ERROR = "E0000 00:00:1718000000.123456   12345 coordination_service_agent.cc:332] Failed to connect.\n"


def shown(pieces, stream=protocol.STDOUT) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    echo = LeaderEcho(lambda text, name: out.append((name, text)))
    for piece in pieces:
        echo.feed(stream, piece)
    echo.close()
    return out


@pytest.mark.parametrize("cut", range(1, len(GLOO)))
def test_gloo_chatter_is_left_out_wherever_a_chunk_cuts_it(cut):
    text = "epoch 1\n" + GLOO + "epoch 2\n"
    at = len("epoch 1\n") + cut
    assert "".join(t for _, t in shown([text[:at], text[at:]])) == "epoch 1\nepoch 2\n"


def test_the_coordination_services_start_up_lines_are_chatter_and_its_errors_are_not():
    assert shown([JAX_START[:20], JAX_START[20:], JAX_ERROR], protocol.STDERR) == [(protocol.STDERR, JAX_ERROR)]


def test_a_line_that_only_starts_like_chatter_is_shown_once_complete_or_once_the_host_ends():
    assert shown(["[Gl", "obal] step 3\n"]) == [(protocol.STDOUT, "[Global] step 3\n")]
    assert shown(["[Gloo] Rank "]) == [(protocol.STDOUT, "[Gloo] Rank ")]  # closed: no line grows any more


def test_other_output_passes_at_once_rewrites_included():
    out = []
    echo = LeaderEcho(lambda text, name: out.append((name, text)))
    echo.feed(protocol.STDERR, " 50%|#####")
    echo.feed(protocol.STDERR, "\r100%|##########")
    echo.feed(protocol.DISPLAY, '{"data": {"text/plain": "x"}}')
    assert out == [(protocol.STDERR, " 50%|#####"), (protocol.STDERR, "\r100%|##########"),
                   (protocol.DISPLAY, '{"data": {"text/plain": "x"}}')]
