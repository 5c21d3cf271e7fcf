"""What a cell reads from the notebook, and the checks done before any host starts."""

from __future__ import annotations

import ast
import builtins
import json
import pickle
import subprocess
import symtable
import sys
import textwrap
import threading
import xml.etree.ElementTree
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import cloudpickle
import pytest

from kinetic_nb.errors import CaptureError, CellSyntaxError, UnpicklableValueError
from kinetic_nb.shipping.capture import (
    imported_modules,
    module_roots,
    names_read_from_notebook,
    parse_cell,
    pickle_namespace,
)

CELL = "<kinetic-cell>"
REPOSITORY_ROOT = Path(__file__).resolve().parents[1]
IMPORT_BOTH_AND_REPORT_IPYTHON = (
    "import sys, kinetic_nb.accelerators, kinetic_nb.shipping.capture; print('IPython' in sys.modules)"
)


class EveryNameNotebook(Mapping[str, Any]):
    """A notebook namespace in which every name exists; builtins are the builtins themselves."""

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str)

    def __getitem__(self, name: str) -> Any:
        return getattr(builtins, name, f"notebook value of {name}")

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


def reads(source: str, user_ns: Mapping[str, Any] | None = None) -> list[str]:
    """The names a cell reads from a notebook (by default one that defines every name)."""
    tree = parse_cell(textwrap.dedent(source), CELL)
    return names_read_from_notebook(tree, EveryNameNotebook() if user_ns is None else user_ns)


def notebook(code: str) -> dict[str, Any]:
    """A notebook namespace after running ``code`` as a cell: its functions and classes live in ``__main__``."""
    namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
    exec(textwrap.dedent(code), namespace)
    return namespace


def run_in_fresh_interpreter(script: str, data: Any) -> str:
    """Run ``script`` in a new Python, with ``data`` pickled on stdin as ``DATA``; return its stdout."""
    prelude = "import pickle, sys\nDATA = pickle.loads(sys.stdin.buffer.read())\n"
    completed = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(script)],
        input=pickle.dumps(data),
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr.decode()
    return completed.stdout.decode().strip()


# --------------------------------------------------------------------------- parse_cell


def test_parse_cell_returns_the_module_ast():
    tree = parse_cell("x = 1\nx + 1\n", CELL)
    assert isinstance(tree, ast.Module)
    assert [type(statement) for statement in tree.body] == [ast.Assign, ast.Expr]


def test_syntax_error_names_the_cell_line_and_shows_it():
    with pytest.raises(CellSyntaxError) as caught:
        parse_cell("a = 1\nb = 2\nx = = 1\n", CELL)
    error = caught.value
    assert str(error) == "syntax error in the cell at line 3 ('x = = 1'): invalid syntax"
    assert (error.filename, error.lineno, error.offset) == (CELL, 3, 5)
    assert error.text.strip() == "x = = 1"
    assert isinstance(error, SyntaxError)
    assert isinstance(error, CaptureError)


def test_syntax_error_line_of_an_unclosed_bracket():
    with pytest.raises(CellSyntaxError, match=r"^syntax error in the cell at line 2 \('values = \[1,'\): '\[' was never closed") as caught:
        parse_cell("import math\nvalues = [1,\n\n", CELL)
    assert caught.value.lineno == 2


def test_compiler_errors_are_caught_before_any_host_starts():
    with pytest.raises(CellSyntaxError, match=r"^syntax error in the cell at line 2 \('return x'\): 'return' outside function"):
        parse_cell("x = 1\nreturn x\n", CELL)


def test_top_level_await_is_rejected_as_the_hosts_would():
    with pytest.raises(CellSyntaxError, match="'await' outside function"):
        parse_cell("import asyncio\nawait asyncio.sleep(0)\n", CELL)


def test_syntax_error_does_not_chain_the_parsers_error():
    with pytest.raises(CellSyntaxError) as caught:
        parse_cell("def f(:\n    pass\n", CELL)
    assert caught.value.__cause__ is None
    assert caught.value.__suppress_context__


def test_null_byte_is_a_syntax_error_with_its_line():
    with pytest.raises(CellSyntaxError, match=r"^syntax error in the cell at line 2 \(") as caught:
        parse_cell("x = 1\ny = '\0'\n", CELL)
    assert caught.value.lineno == 2


# --------------------------------------------------------------------------- names_read_from_notebook: order


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("x = 1\nprint(x)", []),
        ("print(x)\nx = 1", ["x"]),
        ("x += 1", ["x"]),
        ("x = x + 1", ["x"]),
        ("x, y = y, 2", ["y"]),
        ("first, *rest = items\nprint(first, rest)", ["items"]),
        ("del x", ["x"]),
        ("x = 1\ndel x\nprint(x)", ["x"]),
        ("(n := 10)\nprint(n)", []),
        ("ready and (n := 10)\nprint(n)", ["n", "ready"]),
        ("obj.attr = value", ["obj", "value"]),
        ("table[key] = 1", ["key", "table"]),
        ("x: int = 1\nprint(x)", []),
        ("x: int\nprint(x)", ["x"]),
    ],
)
def test_top_level_statements_are_followed_in_order(source, expected):
    assert reads(source) == expected


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import numpy as np\nnp.zeros(3)", []),
        ("import os.path\nos.getcwd()", []),
        ("from jax import numpy as jnp, random\njnp.ones(2), random", []),
        ("np.zeros(3)\nimport numpy as np", ["np"]),
        ("from m import *\nthing", ["thing"]),
    ],
)
def test_imports_bind_names(source, expected):
    assert reads(source) == expected


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("for i in items:\n    total = i\nprint(i, total)", ["i", "items", "total"]),
        ("for i in range(3):\n    print(j)\n    j = i", ["j"]),
        ("while (line := read()):\n    print(line)", ["read"]),
        ("with open(path) as fh:\n    data = fh.read()\nprint(data, fh)", ["path"]),
        ("if flag:\n    y = 1\nelse:\n    y = 2\nprint(y)", ["flag"]),
        ("if flag:\n    y = 1\nprint(y)", ["flag", "y"]),
        ("if flag:\n    y = 1\nelse:\n    raise Oops\nprint(y)", ["Oops", "flag"]),
        ("try:\n    import foo\nexcept ImportError:\n    foo = None\nfoo", []),
        ("try:\n    v = compute()\nexcept Exception as e:\n    print(e)\nprint(v, e)", ["compute", "e", "v"]),
        ("try:\n    pass\nfinally:\n    z = 3\nprint(z)", []),
        ("match cmd:\n case Point(x=px):\n  print(px)\n case _:\n  px = 0\nprint(px)", ["Point", "cmd"]),
        ("match cmd:\n case [a, *rest]:\n  pass\n case {'k': v, **kw}:\n  pass\nprint(a, kw)", ["a", "cmd", "kw"]),
    ],
)
def test_bindings_in_branches_count_only_when_every_path_makes_them(source, expected):
    assert reads(source) == expected


# --------------------------------------------------------------------------- names_read_from_notebook: scopes


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("def f(a, *args, b=1, **kw):\n    c = 2\n    return a + b + c + args[0] + kw['k'] + g", ["g"]),
        ("def f():\n    return y\nf()\ny = 2", ["y"]),
        ("y = 1\ndef f():\n    return y", []),
        ("def fact(n):\n    return n * fact(n - 1) if n else 1", []),
        ("f = lambda a, b=default: a + b + y", ["default", "y"]),
        ("[x * k for x in xs]", ["k", "xs"]),
        ("{k: v * scale for k, v in pairs.items() if k not in skip}", ["pairs", "scale", "skip"]),
        ("sum(x * w for x in xs)", ["w", "xs"]),
        ("total = 0\n[total := total + x for x in xs]", ["xs"]),
        ("x = [i for i in range(3)]\nprint(i)", ["i"]),
        ("@decorate\ndef f(a: A = dflt) -> R:\n    pass", ["A", "R", "decorate", "dflt"]),
        ("def outer():\n    z = 1\n    def inner():\n        return z + w\n    return inner", ["w"]),
        ("def f():\n    return [lambda: a + b for a in range(3)]", ["b"]),
        ("def f():\n    counter = 0\n    counter += 1", []),
        ("def f():\n    if cond:\n        late = 1\n    return late", ["cond"]),
        ("y = 1\ndef f():\n    return y\ndel y\nf()", ["y"]),
        ("def f():\n    nl = 1\n    def g():\n        nonlocal nl\n        nl += 1\n    return g", []),
        ("def f():\n    (g): int\n    return g", ["g"]),
        ("def f():\n    x: int = 1\n    return x", []),
    ],
)
def test_nested_scopes_read_their_free_names_from_the_notebook(source, expected):
    assert reads(source) == expected


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("def bump():\n    global counter\n    counter += 1", ["counter"]),
        ("def reset():\n    global counter\n    counter = 0", []),
        ("def f():\n    global seen\n    def g():\n        return seen\n    seen = 1", ["seen"]),
        ("def forget():\n    global cache\n    del cache", ["cache"]),
    ],
)
def test_global_statements_mean_the_module_namespace(source, expected):
    assert reads(source) == expected


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("class A:\n    lr = 0.1\n    scaled = lr * 2", []),
        ("class A:\n    scaled = lr * 2\n    lr = 0.1", ["lr"]),
        ("class A(Base, metaclass=Meta):\n    pass", ["Base", "Meta"]),
        ("class A:\n    xs = [1]\n    ys = [x * k for x in xs]", ["k"]),
        ("class A:\n    lr = 0.1\n    def step(self):\n        return lr, A, helper", ["helper", "lr"]),
        ("class A:\n    class B:\n        pass\n    def make(self):\n        return B()", ["B"]),
        ("def f():\n class C:\n  q = z\n  def m(self):\n   return q\n z = 1\n return C", ["q"]),
    ],
)
def test_class_bodies_run_in_order_and_hide_their_names_from_methods(source, expected):
    assert reads(source) == expected


def test_scope_analysis_agrees_with_the_compilers_symbol_table():
    source = textwrap.dedent(
        """
        import math

        def norm(vector, *, order=DEFAULT_ORDER):
            total = sum(abs(v) ** order for v in vector)
            return total ** (1 / order) * UNIT

        def make_scaler(factor):
            def scale(values):
                nonlocal factor
                factor = factor or FALLBACK
                return [factor * v + OFFSET for v in values if keep(v)]
            return scale

        async def fetch(client):
            async with client.session() as session:
                return await session.get(URL, timeout=math.ceil(TIMEOUT))

        class Model:
            def forward(self, x):
                return activation(x @ self.weights)
        """
    )
    table = symtable.symtable(source, CELL, "exec")
    symbols = table.get_symbols()
    module_bound = {symbol.get_name() for symbol in symbols if symbol.is_assigned() or symbol.is_imported()}

    def global_reads(scope: symtable.SymbolTable) -> set[str]:
        names = {s.get_name() for s in scope.get_symbols() if s.is_global() and s.is_referenced()}
        return names.union(*(global_reads(child) for child in scope.get_children()))

    module_reads = {symbol.get_name() for symbol in symbols if symbol.is_referenced()}
    every_read = module_reads.union(*(global_reads(child) for child in table.get_children()))
    expected = {name for name in every_read if name not in module_bound and not hasattr(builtins, name)}
    assert expected == {"DEFAULT_ORDER", "UNIT", "FALLBACK", "OFFSET", "keep", "URL", "TIMEOUT", "activation"}
    assert set(reads(source)) == expected


# --------------------------------------------------------------------------- names_read_from_notebook: filters


def test_names_missing_from_the_notebook_are_not_captured():
    assert reads("print(x + y + z)", {"x": 1, "z": 3}) == ["x", "z"]


def test_result_is_sorted():
    assert reads("zeta + alpha + mid") == ["alpha", "mid", "zeta"]


def test_builtins_and_ipython_names_are_never_captured():
    def ipython_open(file: Any, *args: Any, **kwargs: Any) -> Any:  # IPython's stand-in for open
        return builtins.open(file, *args, **kwargs)

    ipython_open.__module__ = "IPython.core.interactiveshell"
    user_ns = {
        "print": print, "len": len, "open": ipython_open,
        "In": [""], "Out": {}, "get_ipython": object(), "exit": object(), "quit": object(),
        "_": 1, "__": 2, "___": 3, "_i": "", "_ii": "", "_iii": "", "_i7": "x", "_7": 7,
        "_oh": {}, "_ih": [], "_dh": [], "_exit_code": 0,
        "__name__": "__main__", "__builtins__": builtins, "__doc__": None,
        "data": [1],
    }  # fmt: skip
    source = (
        "print(len(data), open, In, Out, get_ipython(), exit, quit, _, __, ___, _i, _ii, _iii, _i7, _7,"
        " _oh, _ih, _dh, _exit_code, __name__, __builtins__, __doc__)"
    )
    assert reads(source, user_ns) == ["data"]


def test_a_real_ipython_namespace_yields_only_the_users_variables():
    # In a fresh interpreter: an IPython shell leaves its marks on builtins and sys.modules.
    script = """
        import json
        from IPython.core.interactiveshell import InteractiveShell
        from kinetic_nb.shipping.capture import names_read_from_notebook, parse_cell

        shell = InteractiveShell.instance()
        for cell in ["x = 41", "x + 1", "import json", "!true", "def f():\\n    return x"]:
            assert shell.run_cell(cell, store_history=True).success, cell
        user_ns = shell.user_ns
        machinery = {"In", "Out", "_", "_2", "_i2", "_oh", "get_ipython", "open", "__builtins__"}
        assert machinery <= set(user_ns), sorted(user_ns)
        cell = "print(" + ", ".join(name for name in user_ns if name.isidentifier()) + ")"
        print(json.dumps(names_read_from_notebook(parse_cell(cell, "<cell>"), user_ns)))
    """
    completed = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        cwd=REPOSITORY_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    assert json.loads(completed.stdout.strip().splitlines()[-1]) == ["f", "json", "x"]


def test_a_builtin_the_notebook_rebound_is_captured():
    assert reads("print(id, max)", {"id": 7, "max": max}) == ["id"]


# --------------------------------------------------------------------------- imported_modules, module_roots


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import jax.numpy as jnp", {"jax"}),
        ("from torch import nn", {"torch"}),
        ("import os, xml.etree.ElementTree as ET", {"os", "xml"}),
        ("from flax.linen import Dense\nfrom optax import adam", {"flax", "optax"}),
        ("from . import sibling\nfrom .pkg import thing\nfrom .. import up", set()),
        ("def f():\n    import numpy\n    return numpy", {"numpy"}),
        ("x = 1", set()),
    ],
)
def test_imported_modules_are_top_level_package_names(source, expected):
    assert imported_modules(parse_cell(source, CELL)) == expected


def test_module_roots_names_the_top_package_of_module_values():
    assert module_roots([json, xml.etree.ElementTree, 3, "os", print]) == {"json", "xml"}
    assert module_roots([]) == set()


# --------------------------------------------------------------------------- pickle_namespace


def test_each_value_is_pickled_once_into_bytes_in_name_order():
    class CountsPickling:
        calls = 0

        def __reduce__(self) -> tuple[Any, ...]:
            CountsPickling.calls += 1
            return (int, (5,))

    user_ns = {"b": CountsPickling(), "a": [1, 2], "unread": object()}
    pickled = pickle_namespace(["b", "a"], user_ns)
    assert list(pickled) == ["b", "a"]
    assert CountsPickling.calls == 1
    assert {name: cloudpickle.loads(data) for name, data in pickled.items()} == {"b": 5, "a": [1, 2]}


def test_an_unpicklable_value_is_named_with_its_type_and_reason():
    lock = threading.Lock()
    with pytest.raises(UnpicklableValueError) as caught:
        pickle_namespace(["ok", "lock"], {"ok": 1, "lock": lock})
    error = caught.value
    assert str(error) == (
        "cannot ship variable 'lock' (a _thread.lock) to the hosts: cannot pickle '_thread.lock' object"
    )
    assert isinstance(error.__cause__, TypeError)
    assert isinstance(error, TypeError)
    assert isinstance(error, CaptureError)
    assert any("inside the cell" in note for note in error.__notes__)


def test_an_unpicklable_value_of_a_builtin_type_names_the_bare_type():
    with pytest.raises(UnpicklableValueError, match=r"^cannot ship variable 'holder' \(a dict\) to the hosts: "):
        pickle_namespace(["holder"], {"holder": {"lock": threading.Lock()}})


def test_a_multi_line_pickling_error_becomes_one_line():
    class Refuses:
        def __reduce__(self) -> tuple[Any, ...]:
            raise RuntimeError("first line\n  second line")

    with pytest.raises(UnpicklableValueError) as caught:
        pickle_namespace(["thing"], {"thing": Refuses()})
    message = str(caught.value)
    assert "\n" not in message
    assert message.endswith("first line second line")
    assert f"(a {Refuses.__module__}.{Refuses.__qualname__})" in message
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_notebook_functions_and_classes_travel_by_value():
    user_ns = notebook(
        """
        SCALE = 3

        def scaled(x):
            return x * SCALE

        class Counter:
            def __init__(self, start):
                self.value = start

            def bump(self):
                self.value += scaled(1)
                return self.value
        """
    )
    assert user_ns["scaled"].__module__ == "__main__"
    names = names_read_from_notebook(parse_cell("print(scaled(2), Counter(1).bump())", CELL), user_ns)
    assert names == ["Counter", "scaled"]
    pickled = pickle_namespace(names, user_ns)
    output = run_in_fresh_interpreter(
        """
        import cloudpickle
        assert not hasattr(sys.modules["__main__"], "scaled")
        values = {name: cloudpickle.loads(data) for name, data in DATA.items()}
        print(values["scaled"](2), values["Counter"](1).bump())
        """,
        pickled,
    )
    assert output == "6 4"


def test_modules_travel_by_reference_and_are_reimported():
    pickled = pickle_namespace(["json"], {"json": json})
    assert len(pickled["json"]) < 100  # the name, not the module's contents
    assert cloudpickle.loads(pickled["json"]) is json
    output = run_in_fresh_interpreter(
        """
        assert "json" not in sys.modules
        import cloudpickle
        module = cloudpickle.loads(DATA["json"])
        print(module is sys.modules["json"], module.dumps([1]))
        """,
        pickled,
    )
    assert output == "True [1]"


def test_capture_and_accelerators_do_not_import_ipython():
    output = subprocess.run(
        [sys.executable, "-c", IMPORT_BOTH_AND_REPORT_IPYTHON],
        cwd=REPOSITORY_ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    assert output == "False"


@pytest.mark.parametrize(
    ("line", "construct", "advice"),
    [
        ("!ls -l", "!ls", "use subprocess"),
        ("files = !ls", "!ls", "use subprocess"),
        ("%time train()", "%time", "IPython magics do not run there"),
        ("%%capture", "%%capture", "IPython magics do not run there"),
        ("model.fit?", "model.fit?", "help queries do not run there"),
        ("??model", "??model", "help queries do not run there"),
    ],
)
def test_ipython_syntax_is_named_as_such(line, construct, advice):
    with pytest.raises(CellSyntaxError) as raised:
        parse_cell(f"x = 1\n{line}\n", CELL)
    assert str(raised.value).startswith(f"line 2 uses `{construct}`: %%kinetic cells run as plain Python on the "
                                        f"hosts; {advice}")
    assert raised.value.lineno == 2


def test_a_plain_syntax_error_is_not_taken_for_ipython_syntax():
    with pytest.raises(CellSyntaxError, match=r"syntax error in the cell at line 1 \('x = = 2'\)"):
        parse_cell("x = = 2\n", CELL)
