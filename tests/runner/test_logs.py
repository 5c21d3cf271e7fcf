import json

from kinetic_nb.runner import logs, protocol
from kinetic_nb.runner.job_keys import new_key
from kinetic_nb.runner.logs import (
    LogChunkWriter,
    LogScreen,
    TerminalLine,
    collapse_carriage_returns,
    last_lines,
    read_log,
    read_log_segments,
    shown_text,
)
from kinetic_nb.runner.records import read_log_chunk
from kinetic_nb.storage import LocalStorage

#: The job's key every chunk is sealed under.
KEY = new_key()


def test_progress_bars_keep_their_last_state():
    assert collapse_carriage_returns("10%\r50%\r100%\ndone\n") == "100%\ndone\n"
    assert collapse_carriage_returns("windows line\r\nnext\r\n") == "windows line\nnext\n"


def test_chunks_are_append_only_and_join_in_order(tmp_path):
    storage = LocalStorage(str(tmp_path))
    writer = LogChunkWriter(storage, 2, KEY)
    writer.feed(b"first line\nhalf ")
    writer.flush()
    writer.feed("é".encode()[:1])  # half of a UTF-8 character waits for the rest
    writer.flush()
    writer.feed("é".encode()[1:] + b"\n")
    writer.flush()
    names = [info.name for info in storage.list("hosts/2/log/")]
    assert names == ["hosts/2/log/000000.json", "hosts/2/log/000001.json"]
    assert read_log(storage, 2, KEY) == "first line\nhalf é\n"
    assert last_lines(read_log(storage, 2, KEY), 1) == ["half é"]


def test_stdout_and_stderr_stay_apart_and_in_order(tmp_path):
    storage = LocalStorage(str(tmp_path))
    writer = LogChunkWriter(storage, 0, KEY)
    writer.feed(b"out one\n", protocol.STDOUT)
    writer.feed(b"err one\n", protocol.STDERR)
    writer.feed(b"out two\n", protocol.STDOUT)
    writer.flush()
    writer.feed(b"err two\n", protocol.STDERR)
    writer.flush(final=True)
    assert read_log_segments(storage, 0, KEY) == [("out", "out one\n"), ("err", "err one\n"), ("out", "out two\n"),
                                             ("err", "err two\n")]
    assert len(storage.list("hosts/0/log/")) == 2  # one chunk per flush, however often the stream changed


def test_a_chunk_that_cannot_be_stored_is_reported(tmp_path):
    (tmp_path / "hosts").write_text("a file where a directory should be")
    failures = []
    writer = LogChunkWriter(LocalStorage(str(tmp_path)), 0, KEY, on_error=lambda name, error: failures.append(name))
    writer.feed(b"lost\n")
    writer.flush()
    assert failures == ["hosts/0/log/000000.json"]


def test_a_progress_bar_is_one_line_whatever_the_chunk_boundaries(tmp_path):
    storage = LocalStorage(str(tmp_path))
    writer = LogChunkWriter(storage, 0, KEY)
    pieces = ["epoch 1\n  0%|", "\r 50%|#####", "\r", "100%|##########", "\n", "done\n"]
    for piece in pieces:  # one chunk per write: every boundary falls somewhere in the bar's line
        writer.feed(piece.encode(), protocol.STDERR)
        writer.flush()
    written = "".join(text for _, text in read_log_segments(storage, 0, KEY))
    assert written == "epoch 1\n  0%|\r 50%|#####\r 50%|#####\r100%|##########\ndone\n"
    assert "0%| 50%" not in written  # no update glued to the one before
    assert read_log(storage, 0, KEY) == "epoch 1\n100%|##########\ndone\n"
    assert collapse_carriage_returns(written) == "epoch 1\n100%|##########\ndone\n"  # as a terminal shows it


def test_a_rewrite_overwrites_only_what_it_writes_as_a_terminal_does():
    line = TerminalLine()
    assert line.feed("loss 0.50 step 1") == []
    assert line.feed("\rloss 0.25") == [] and line.text == "loss 0.25 step 1"
    assert line.feed("\n") == ["loss 0.25 step 1"]


def test_backspaces_move_back_as_a_terminal_does(tmp_path):
    line = TerminalLine()
    assert line.feed("50%\b\b\b75%") == [] and line.text == "75%"
    assert line.feed("\b\b\b\b\b\b") == [] and line.cursor == 0  # never before the line's start
    # Keras's progress bar: a row of backspaces over the last bar, then a carriage return and the next.
    storage = LocalStorage(str(tmp_path))
    writer = LogChunkWriter(storage, 0, KEY)
    for piece in ["Epoch 1/2\n", "1/3 [=>....] - loss: 0.9", "\b" * 23 + "\r", "3/3 [======] - loss: 0.5",
                  "\n", "Epoch 2/2\n"]:
        writer.feed(piece.encode())
        writer.flush()
    assert read_log(storage, 0, KEY) == "Epoch 1/2\n3/3 [======] - loss: 0.5\nEpoch 2/2\n"
    shown = LogScreen()
    lines = [line for _, text in read_log_segments(storage, 0, KEY) for line in shown.feed(protocol.STDOUT, text)]
    assert lines == ["Epoch 1/2", "3/3 [======] - loss: 0.5", "Epoch 2/2"]


#: What a host may print that a terminal acts on: colours, a hyperlink, the clipboard (OSC 52), a title, the screen
#: erased, a bell, a right-to-left override, a NUL, a lone escape and a C1 control; and text to keep around them.
ACTING = ("\x1b[1;31mred\x1b[0m \x1b]8;;https://example.com\x1b\\a link\x1b]8;;\x1b\\ "
          "\x1b]52;c;c3RlYWw=\x07\x1b]0;a title\x1b\\\x1b[2J\x1b[H\x07 \u202eevil\x00 \x1b \x9b\ttab é 👨\u200d👩\u200d👧\n")
#: What the panel shows of it: the text alone, each character that is no text as U+FFFD.
SHOWN = "red a link \ufffd \ufffdevil\ufffd \ufffd \ufffd\ttab é 👨\u200d👩\u200d👧"


def test_the_panel_shows_what_a_host_printed_as_plain_text():
    assert shown_text(ACTING) == SHOWN + "\n"
    assert shown_text("plain text, as it was\ttabbed\n") == "plain text, as it was\ttabbed\n"
    assert shown_text("a message\rthat hides\b its start") == "a message\ufffdthat hides\ufffd its start"
    display = json.dumps({"data": {"text/plain": "\x1b[32mgreen\x1b[0m\x07"}, "metadata": {}})
    assert [shown_text(line) for line in LogScreen().feed(protocol.DISPLAY, display)] == ["green\ufffd"]


def test_a_line_still_being_written_shows_no_part_of_an_escape_it_cuts_short():
    for end in range(len(ACTING)):  # the line as a poll may find it, cut anywhere
        shown = shown_text(ACTING[:end])
        assert SHOWN.startswith(shown.rstrip("\ufffd")) or shown.startswith("red a link"), (end, shown)
        assert not any(part in shown for part in ("[1;31", "8;;", "52;", "0;a", "[2J", "\x1b", "\x07")), (end, shown)


def test_the_host_s_lines_stay_as_it_printed_them():
    screen = LogScreen()  # what logs() gives: the host's own text, escapes and all (Jupyter renders colours)
    assert screen.feed(protocol.STDOUT, "\x1b[31mred\x1b[0m\n") == ["\x1b[31mred\x1b[0m"]


#: What b3f2552 parsed out of a host's stdout: a display record between these two, and a session cell's
#: start and end. A file name, a file's contents or a subprocess's output could carry them.
OLD_DISPLAY_START, OLD_DISPLAY_END = "\x1b]kinetic-display;", "\x1b\\"
OLD_CELL_MARK, OLD_CELL_END_MARK = "\x1ekinetic-cell:5\x1e", "\x1ekinetic-cell-end:5\x1e"
PLANTED = json.dumps({"data": {"text/html": "<script>steal()</script>",
                               "application/javascript": "steal()", "text/plain": "x"}, "metadata": {}})


def test_printed_text_is_only_ever_text_whatever_it_contains(tmp_path):
    storage = LocalStorage(str(tmp_path))
    writer = LogChunkWriter(storage, 0, KEY)
    output = (f"before\n{OLD_DISPLAY_START}{PLANTED}{OLD_DISPLAY_END}middle\n"
              f"{OLD_CELL_MARK}in a cell?\n{OLD_CELL_END_MARK}after\n")
    data = output.encode()
    for start in range(0, len(data), 7):  # cut anywhere, as pipes cut it
        writer.feed(data[start:start + 7])
    writer.flush(final=True)
    segments = read_log_segments(storage, 0, KEY)
    assert [stream for stream, _ in segments] == [protocol.STDOUT]  # no display segment
    assert segments[0][1] == output  # all of it, as it was printed
    assert writer.cell == 0 and [info.name.split("/")[0] for info in storage.list("")] == ["hosts"]  # no cell began


def test_a_display_record_from_the_marks_pipe_keeps_its_place(tmp_path):
    storage = LocalStorage(str(tmp_path))
    writer = LogChunkWriter(storage, 0, KEY)
    record = json.dumps({"data": {"text/html": "<b>x</b>", "text/plain": "X"}, "metadata": {}})
    writer.feed(b"before\n")
    writer.add_display(record)
    writer.feed(b"after\n")
    writer.flush(final=True)
    segments = read_log_segments(storage, 0, KEY)
    assert segments == [(protocol.STDOUT, "before\n"), (protocol.DISPLAY, record), (protocol.STDOUT, "after\n")]
    assert read_log(storage, 0, KEY) == "before\nX\nafter\n"


def test_a_cells_output_is_cut_by_the_marks_pipes_boundaries(tmp_path):
    storage = LocalStorage(str(tmp_path))
    writer = LogChunkWriter(storage, 0, KEY)
    writer.feed(b"the host starts\n")
    writer.start_cell(5)
    writer.feed(b"in cell 5\n")
    writer.end_cell(4)  # not this cell's end
    writer.feed(b"still cell 5\n")
    writer.end_cell(5)
    writer.flush(final=True)
    assert read_log(storage, 0, KEY) == "the host starts\n"
    [chunk] = [info.name for info in storage.list(protocol.CELLS_DIR + "/")]
    stored = read_log_chunk(storage, KEY, chunk)
    assert (stored.cell, stored.end) == (5, True)
    assert stored.segments == [(protocol.STDOUT, "in cell 5\nstill cell 5\n")]


class _Bucketlike(LocalStorage):
    """Local storage that says it is not on this machine's disk, as a bucket does."""

    def local_path(self, name: str = "") -> None:
        return None


def test_a_workers_output_of_a_cell_is_marked_stored_after_its_last_chunk_on_a_local_disk(tmp_path):
    """A worker's agent marks its cell's output stored once the last chunk is, printed or not (a worker that
    printed nothing stores no chunk): the notebook then shows every host's last line as it is. The leader's last
    chunk says so itself; on a bucket the marker would be a request per host per cell."""
    storage = LocalStorage(str(tmp_path))
    printed, silent, leader = (LogChunkWriter(storage, index, KEY) for index in (1, 2, 0))
    for writer in (printed, silent, leader):
        writer.start_cell(3)
    printed.feed(b"step 10 loss 0.53\n")
    for writer in (printed, silent, leader):
        writer.end_cell(3)
    names = {info.name for info in storage.list(protocol.cell_dir(3) + "/")}
    assert {protocol.cell_output_stored(3, 1), protocol.cell_output_stored(3, 2)} <= names
    assert protocol.cell_output_stored(3, 0) not in names and protocol.cell_log_chunk(3, 0, 0) in names
    assert protocol.cell_log_chunk(3, 1, 0) in names and protocol.cell_log_chunk(3, 2, 0) not in names
    bucket = _Bucketlike(str(tmp_path / "bucket"))
    remote = LogChunkWriter(bucket, 1, KEY)
    remote.start_cell(3)
    remote.end_cell(3)
    assert bucket.list() == []


def test_a_host_that_prints_fast_makes_chunks_its_readers_take(tmp_path, monkeypatch):
    """However little time passed, a chunk is written once MAX_CHUNK_CHARS wait: no chunk a host writes is over
    the limit a reader allows a log chunk (which it would refuse as unverified)."""
    monkeypatch.setattr(logs, "MAX_CHUNK_CHARS", 1000)
    monkeypatch.setattr(logs, "FLUSH_INTERVAL_S", 3600.0)  # never due by time in this test
    storage = LocalStorage(str(tmp_path))
    writer = LogChunkWriter(storage, 0, KEY)
    for _ in range(50):
        writer.feed(b"\x01" * 99 + b"\n")  # control characters: JSON escapes each into 6 bytes
    writer.add_display(json.dumps({"data": {"text/plain": "big " * 500}}))
    writer.feed(b"after\n")
    writer.flush(final=True)
    infos = storage.list("hosts/0/log/")
    assert len(infos) >= 6
    assert max(info.size for info in infos) < 8 * 1000  # each about MAX_CHUNK_CHARS, not all 5,000 at once
    segments = read_log_segments(storage, 0, KEY)
    kinds = [stream for stream, _ in segments]
    assert kinds.count(protocol.DISPLAY) == 1
    before = "".join(text for stream, text in segments[:kinds.index(protocol.DISPLAY)])
    after = "".join(text for stream, text in segments[kinds.index(protocol.DISPLAY) + 1:])
    assert (before, after) == (("\x01" * 99 + "\n") * 50, "after\n")
