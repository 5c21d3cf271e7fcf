from kinetic_nb.runner.logs import LogChunkWriter, collapse_carriage_returns, last_lines, read_log
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
    assert names == ["hosts/2/log/000000.txt", "hosts/2/log/000001.txt"]
    assert read_log(storage, 2) == "first line\nhalf é\n"
    assert last_lines(read_log(storage, 2), 1) == ["half é"]
