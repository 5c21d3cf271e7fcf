from kinetic_nb.runner import protocol
from kinetic_nb.runner.logs import LogChunkWriter, collapse_carriage_returns, last_lines, read_log, read_log_segments
from kinetic_nb.storage import LocalStorage


def test_progress_bars_keep_their_last_state():
    assert collapse_carriage_returns("10%\r50%\r100%\ndone\n") == "100%\ndone\n"
    assert collapse_carriage_returns("windows line\r\nnext\r\n") == "windows line\nnext\n"


def test_chunks_are_append_only_and_join_in_order(tmp_path):
    storage = LocalStorage(str(tmp_path))
    writer = LogChunkWriter(storage, 2)
    writer.feed("first line\nhalf ".encode())
    writer.flush()
    writer.feed("é".encode()[:1])  # half of a UTF-8 character waits for the rest
    writer.flush()
    writer.feed("é".encode()[1:] + b"\n")
    writer.flush()
    names = [info.name for info in storage.list("hosts/2/log/")]
    assert names == ["hosts/2/log/000000.json", "hosts/2/log/000001.json"]
    assert read_log(storage, 2) == "first line\nhalf é\n"
    assert last_lines(read_log(storage, 2), 1) == ["half é"]


def test_stdout_and_stderr_stay_apart_and_in_order(tmp_path):
    storage = LocalStorage(str(tmp_path))
    writer = LogChunkWriter(storage, 0)
    writer.feed(b"out one\n", protocol.STDOUT)
    writer.feed(b"err one\n", protocol.STDERR)
    writer.feed(b"out two\n", protocol.STDOUT)
    writer.flush()
    writer.feed(b"err two\n", protocol.STDERR)
    writer.flush(final=True)
    assert read_log_segments(storage, 0) == [("out", "out one\n"), ("err", "err one\n"), ("out", "out two\n"),
                                             ("err", "err two\n")]
    assert len(storage.list("hosts/0/log/")) == 2  # one chunk per flush, however often the stream changed


def test_a_chunk_that_cannot_be_stored_is_reported(tmp_path):
    (tmp_path / "hosts").write_text("a file where a directory should be")
    failures = []
    writer = LogChunkWriter(LocalStorage(str(tmp_path)), 0, on_error=lambda name, error: failures.append(name))
    writer.feed(b"lost\n")
    writer.flush()
    assert failures == ["hosts/0/log/000000.json"]
