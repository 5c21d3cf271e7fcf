"""A host's marks pipe (kinetic_nb.runner.marks): frames whatever the reads cut, and what is not a frame dropped."""

from __future__ import annotations

import json
import os
import struct
import threading

import pytest

from kinetic_nb.runner import host_display, marks
from kinetic_nb.runner.marks import Mark, MarkReader

RECORD = json.dumps({"data": {"text/html": "<b>x</b>", "text/plain": "X"}, "metadata": {}})


def frame(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">cI", kind, len(body)) + body


def test_frames_come_whole_wherever_the_reads_cut_them():
    data = frame(marks.CELL_START, b"3") + frame(marks.DISPLAY, RECORD.encode()) + frame(marks.CELL_END, b"3")
    for cut in range(1, len(data)):
        reader = MarkReader()
        assert reader.feed(data[:cut]) + reader.feed(data[cut:]) == [
            Mark(marks.CELL_START, 3), Mark(marks.DISPLAY, RECORD), Mark(marks.CELL_END, 3)]
        assert reader.pending == 0 and reader.problems == []


def test_a_partial_frame_waits_for_its_rest():
    reader = MarkReader()
    data = frame(marks.DISPLAY, RECORD.encode())
    assert reader.feed(data[:-1]) == [] and reader.pending == len(data) - 1
    assert reader.feed(data[-1:]) == [Mark(marks.DISPLAY, RECORD)]


def test_an_oversized_frame_is_skipped_as_it_arrives_and_the_next_one_is_read(monkeypatch):
    monkeypatch.setattr(marks, "MAX_FRAME_BYTES", 10)
    reader = MarkReader()
    big = frame(marks.DISPLAY, b"x" * 25)
    assert reader.feed(big[:12]) == [] and reader.pending == 0  # never held
    assert reader.feed(big[12:] + frame(marks.CELL_END, b"4")) == [Mark(marks.CELL_END, 4)]
    assert reader.problems == ["a frame of 25 bytes (at most 10 travel)"]


@pytest.mark.parametrize(("data", "problem"), [
    (b"hello, this is not a frame", "26 bytes that are not a frame"),
    (frame(marks.DISPLAY, b"not json"), "a frame of kind b'D' whose body is not one (8 bytes)"),
    (frame(marks.DISPLAY, b'{"no": "data"}'), "a frame of kind b'D' whose body is not one (14 bytes)"),
    (frame(marks.CELL_START, b"-1"), "a frame of kind b'S' whose body is not one (2 bytes)"),
    (frame(marks.CELL_END, b"\xff"), "a frame of kind b'E' whose body is not one (1 bytes)"),
])
def test_what_is_not_a_frame_is_dropped_and_named(data, problem):
    reader = MarkReader()
    assert reader.feed(data) == [] and reader.problems == [problem] and reader.pending == 0


@pytest.fixture
def pipe():
    """A marks pipe this process writes, read by a thread as the agent reads it; the frames it read."""
    read_end, write_end = os.pipe()
    reader, read = MarkReader(), []

    def agent() -> None:
        while data := os.read(read_end, 1 << 16):
            read.extend(reader.feed(data))

    thread = threading.Thread(target=agent, daemon=True)
    thread.start()
    marks.attach(write_end)
    try:
        yield read
    finally:
        marks.attach(None)
        os.close(write_end)
        thread.join(5)
        os.close(read_end)


def test_the_runners_frames_reach_the_agent_large_ones_whole(pipe):
    large = json.dumps({"data": {"image/png": "A" * 300_000, "text/plain": "<Figure>"}, "metadata": {}})
    marks.cell_started(2)
    assert marks.send_display(RECORD) and marks.send_display(large)
    marks.cell_ended(2)
    marks.taken()
    assert pipe == [Mark(marks.CELL_START, 2), Mark(marks.DISPLAY, RECORD), Mark(marks.DISPLAY, large),
                    Mark(marks.CELL_END, 2)]


def test_a_cells_boundaries_are_not_waited_for_but_a_display_is(pipe, monkeypatch):
    """A cell's start and end cost the cell no wait for the agent (issue 39's hot path): the start is confirmed
    with ``taken()`` just before the cell's code runs; a display waits, since the cell prints on after it."""
    waits: list[int] = []
    monkeypatch.setattr(marks, "_wait_taken", waits.append)
    marks.cell_started(5)
    marks.cell_ended(5)
    assert waits == []
    marks.taken()
    assert marks.send_display(RECORD)
    assert len(waits) == 2


def test_with_no_agent_a_display_is_its_text_on_stdout(capsys):
    assert not marks.attached()
    host_display.publish_display_data({"text/html": "<b>x</b>", "text/plain": "X"})
    marks.cell_started(1)  # nowhere to say it: nothing printed
    assert capsys.readouterr().out == "X\n"
