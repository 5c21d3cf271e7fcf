"""``-e`` values and the job's key, tested as the leaks were found: never stored, never printed, in any form.

A secret leaks in whatever form text gives it, so every check searches for all
of them: the value itself, its repr and JSON bodies, its escapes, and each of
those with its backslashes doubled (a repr of a repr). Stored objects are read
raw from the job's directory: signing is not encryption.
"""

from __future__ import annotations

import gc
import json
import os
import pathlib
import queue
import re
import traceback

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.core.magic_arguments import MagicArgumentParser
from jupyter_client.manager import start_new_kernel

import kinetic_nb
from kinetic_nb.notebook import magics

#: A secret with every character that escaping changes: a backslash, both quotes, a newline, a non-ASCII letter.
VALUE = "a\\b\"c'd\ne-é-secret"
#: What a magic line can carry (its words are split like a shell's, without escapes, and quotes must pair).
LINE_VALUE = "tok-a\\b\"c'd\"e\\n-é-secret"
HOST = "import os, sys\nhost = int(os.environ['KINETIC_HOST_INDEX'])\n"
WORKTREE = pathlib.Path(__file__).resolve().parents[2]


def forms(value: str) -> set[str]:
    """Every form ``value`` takes in text (written here, apart from the redactor's own list)."""
    both = repr(value + "\"'")[1:-4]  # inside a string that holds both quotes: every ' escaped
    found = {value, repr(value)[1:-1], both, ascii(value)[1:-1], json.dumps(value)[1:-1],
             json.dumps(value, ensure_ascii=False)[1:-1], value.encode("unicode_escape").decode()}
    return found | {form.replace("\\", "\\\\") for form in found}


def assert_absent(value: str, text: str | bytes, where: str) -> None:
    for form in forms(value):
        needle = form.encode() if isinstance(text, bytes) else form
        assert needle not in text, f"{form!r} (a form of the secret) is in {where}"


def stored_files(handle) -> dict[str, bytes]:
    """Every object of the job's directory, raw, by its path there."""
    root = pathlib.Path(handle.storage.local_path())
    return {str(path.relative_to(root)): path.read_bytes() for path in root.rglob("*") if path.is_file()}


def everything_shown(error: BaseException) -> str:
    """The exception's text, its notes, its traceback and what IPython would render for it."""
    render = getattr(error, "_render_traceback_", None)
    return "\n".join([str(error), repr(error), *getattr(error, "__notes__", ()),
                      *traceback.format_exception(error), *(render() if render else ())])


@pytest.fixture
def shell():
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "kinetic_nb")
    yield shell
    InteractiveShell.clear_instance()


# --- abbreviations ------------------------------------------------------------------------------------------


def kinetic_parsers() -> list[MagicArgumentParser]:
    """Every parser of every kinetic magic that exists: found among live objects, so a new one is walked too."""
    # type(), not isinstance(): isinstance reads an object's __class__, which some of torch's deprecated objects
    # answer with a FutureWarning.
    found = [obj for obj in gc.get_objects() if issubclass(type(obj), MagicArgumentParser)
             and obj.prog.startswith(("%kinetic", "kinetic"))]
    assert len(found) >= 1 + len(magics.SUBCOMMANDS)  # %%kinetic and each %kinetic subcommand
    return found


def _words(action) -> list[str]:
    """Words that give ``action`` a value its type and choices accept (none for a switch)."""
    if action.nargs == 0:
        return []
    if action.choices:
        return [str(next(iter(action.choices)))]
    return ["1" if action.type in (int, float) else "X=1"]


def _abbreviations(parser: MagicArgumentParser) -> list[tuple[object, str]]:
    """Each long option with its shortest unambiguous abbreviation, which argparse would take by default."""
    options = [option for action in parser._actions for option in action.option_strings if option.startswith("--")]
    found = []
    for action in parser._actions:
        for option in (o for o in action.option_strings if o.startswith("--")):
            prefixes = [option[:end] for end in range(3, len(option))
                        if [o for o in options if o.startswith(option[:end])] == [option]]
            if prefixes:
                found.append((action, prefixes[0]))
    return found


def test_no_magic_parser_takes_an_abbreviated_option():
    walked = 0
    for parser in kinetic_parsers():
        needed = [word for action in parser._actions if not action.option_strings for word in ["kn-x"]]
        needed += [word for action in parser._actions if action.option_strings and action.required
                   for word in [action.option_strings[-1], "1d"]]
        for action, abbreviation in _abbreviations(parser):
            spelled_out = " ".join([*needed, action.option_strings[-1], *_words(action)])
            parser.parse_argstring(spelled_out)  # the whole name is taken...
            with pytest.raises(UsageError, match="unrecognized arguments"):  # ...an abbreviation never
                parser.parse_argstring(" ".join([*needed, abbreviation, *_words(action)]))
            walked += 1
    assert walked > 30


@pytest.mark.parametrize("abbreviation", ["--en", "--e"])
def test_an_abbreviated_env_option_is_refused_and_stores_nothing(shell, storage_root, abbreviation):
    value = f"abbreviated-{abbreviation.strip('-')}-secret-value"
    result = shell.run_cell(f"%%kinetic -n 1 {abbreviation} TOKEN={value} --keep --quiet\nimport os\n1\n")
    assert type(result.error_in_exec).__name__ == "UsageError"
    root = pathlib.Path(storage_root.removeprefix("file://"))
    for path in root.rglob("payload.pkl"):  # read raw: as found, the value was in a job's payload
        assert_absent(value, path.read_bytes(), str(path))


def test_every_spelling_of_env_is_masked_in_the_stored_cell(shell):
    values = {f"T{i}": f"spelled-{i}-{LINE_VALUE}" for i in range(5)}
    spellings = ["-e{}={}", "--env={}={}", "-e={}={}", "-e {}={}", "--env {}={}"]
    line = " ".join(spelling.format(name, value) for spelling, (name, value) in zip(spellings, values.items(), strict=True))
    result = shell.run_cell(f"%%kinetic -n 1 {line} --keep --quiet\nimport os\n"
                            f"[os.environ[name] for name in {sorted(values)!r}]\n")
    assert result.error_in_exec is None and result.result == [values[name] for name in sorted(values)]
    payload = stored_files(kinetic_nb.last_job())["payload.pkl"]
    for name, value in values.items():
        assert_absent(value, payload, "payload.pkl")
        assert f"{name}=***".encode() in payload  # the names stay: they are not secrets


# --- escaped forms ------------------------------------------------------------------------------------------


CELLS = {
    "a worker raises KeyError(value)": HOST + (
        "print('host', host, KeyError(os.environ['TOKEN']), file=sys.stderr, flush=True)\n"
        "if host == 1:\n"
        "    raise KeyError(os.environ['TOKEN'])\n"
        "'the leader is fine'\n"),
    "every host prints repr(value)": HOST + (
        "import json\n"
        "print(repr(os.environ['TOKEN']), flush=True)\n"
        "print(json.dumps({'token': os.environ['TOKEN']}), flush=True)\n"
        "host\n"),
}


@pytest.mark.parametrize("cell", list(CELLS), ids=["raises", "prints"])
def test_a_secrets_escaped_forms_reach_no_stored_object_and_no_error(cell):
    handle = kinetic_nb.submit(CELLS[cell], hosts=2, env={"TOKEN": VALUE}, keep=True)
    if cell.startswith("a worker"):
        with pytest.raises(KeyError) as info:
            handle.result()
        assert info.value.args == ("***",)
        assert_absent(VALUE, everything_shown(info.value), "the exception the client raised")
    else:
        assert handle.result() == 0
        assert "***" in handle.logs(0) and "***" in handle.logs(1)
    stored = stored_files(handle)
    expected = {"result.pkl", "hosts/0/exit.json", "hosts/1/exit.json"} | (
        {"result-worker-1.pkl"} if cell.startswith("a worker") else set())
    assert expected <= set(stored) and any("/log/" in name for name in stored)
    for name, data in stored.items():
        assert_absent(VALUE, data, name)
    assert_absent(VALUE, handle.logs(0) + handle.logs(1), "the hosts' logs")


# --- %xmode Verbose -----------------------------------------------------------------------------------------


def strings(content) -> list[str]:
    """Every string in a message's content (decoded: a JSON escape would hide a form of the secret)."""
    if isinstance(content, str):
        return [content]
    items = content.values() if isinstance(content, dict) else content if isinstance(content, list) else ()
    return [text for item in items for text in strings(item)]


def _cell_output(client, code: str) -> list[dict]:
    """Every iopub message of one cell, up to its idle status."""
    msg_id = client.execute(code)
    messages = []
    while True:
        try:
            message = client.get_iopub_msg(timeout=120)
        except queue.Empty:
            pytest.fail(f"no idle status after {code!r}")
        if message["parent_header"].get("msg_id") != msg_id:
            continue
        messages.append(message)
        if message["msg_type"] == "status" and message["content"]["execution_state"] == "idle":
            return messages


def test_a_launch_failure_under_xmode_verbose_prints_no_secret(tmp_path):
    cache = tmp_path / "cache"
    (cache / "kinetic_nb").mkdir(parents=True)
    # The local backend keeps its agent records here; as a file, the launch fails after the key is made.
    (cache / "kinetic_nb" / "agents").write_text("")
    env = {**os.environ, "XDG_CACHE_HOME": str(cache), "KINETIC_TEST_SECRET": LINE_VALUE,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(WORKTREE), os.environ.get("PYTHONPATH")]))}
    manager, client = start_new_kernel(kernel_name="python3", env=env)
    try:
        where = _cell_output(client, "import kinetic_nb\nprint(kinetic_nb.__file__)")
        assert str(WORKTREE) in json.dumps([m["content"] for m in where])  # this tree's code, not another's
        for setup in ("%load_ext kinetic_nb", "%xmode Verbose", "import os\ntoken = os.environ['KINETIC_TEST_SECRET']"):
            _cell_output(client, setup)
        output = _cell_output(client, "%%kinetic -n 2 -e TOKEN=$token\n1\n")
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    text = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(strings([message["content"] for message in output])))
    assert "FileExistsError" in text  # the launch failed after the key was made
    assert_absent(LINE_VALUE, text, "the cell's output")
    assert "env={'TOKEN': '***'}" in text  # Verbose did print the frames' variables: the value masked
    [key_file] = (cache / "kinetic_nb" / "keys").glob("*.key")  # made before the launch failed
    key = bytes.fromhex(key_file.read_text().strip())
    # needs JobKey (lead's change): the key is a masked bytes, so no frame prints it
    assert all(form not in text for form in (key.hex(), repr(key)[2:-1])), "the job's key is in the traceback"
