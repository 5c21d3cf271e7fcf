import json

from kinetic_nb.runner import protocol
from kinetic_nb.runner.job_keys import new_key
from kinetic_nb.runner.logs import (
    LogChunkWriter,
    TerminalLine,
    collapse_carriage_returns,
    last_lines,
    read_log,
    read_log_segments,
)
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


def test_a_display_record_is_lifted_out_of_stdout_in_its_place(tmp_path):
    storage = LocalStorage(str(tmp_path))
    writer = LogChunkWriter(storage, 0, KEY)
    record = json.dumps({"data": {"text/html": "<b>x</b>", "text/plain": "X"}, "metadata": {}})
    output = f"before\n{protocol.DISPLAY_START}{record}{protocol.DISPLAY_END}after\n".encode()
    for start in range(0, len(output), 7):  # the record arrives cut anywhere
        writer.feed(output[start:start + 7])
        writer.flush()
    writer.flush(final=True)
    segments = read_log_segments(storage, 0, KEY)
    assert [stream for stream, _ in segments if stream == protocol.DISPLAY] == [protocol.DISPLAY]
    assert "".join(text for stream, text in segments if stream == protocol.STDOUT) == "before\nafter\n"
    assert read_log(storage, 0, KEY) == "before\nX\nafter\n"


def test_an_unterminated_display_marker_is_plain_output_at_the_end(tmp_path):
    storage = LocalStorage(str(tmp_path))
    writer = LogChunkWriter(storage, 0, KEY)
    writer.feed(f"odd {protocol.DISPLAY_START}not json".encode())
    writer.flush()
    assert read_log(storage, 0, KEY) == "odd "
    writer.flush(final=True)
    assert read_log(storage, 0, KEY) == f"odd {protocol.DISPLAY_START}not json"
