"""What -o can bring back (kinetic_nb.shipping.bindings): names the cell may bind, checked before any host starts."""

from __future__ import annotations

import ast

import pytest

from kinetic_nb.errors import CaptureError, UnboundOutputError
from kinetic_nb.shipping.bindings import check_out_names, global_bindings

CELL = """
import os.path, numpy as np
from json import dumps as to_json
x = 1
for i, (j, k) in enumerate([]):
    pass
with open('f') as handle:
    pass
def train():
    global trained
    local_only = 1
class Model:
    attribute = 1
try:
    pass
except ValueError as error:
    pass
[(kept := n) for n in range(3)]
if (flag := True):
    first, *rest = 1, 2
match x:
    case {'a': 1, **others}:
        pass
    case [head, *tail] as whole:
        pass
obj.attribute = 3
items[0] = 1
"""


def test_every_way_a_cell_binds_a_global_is_seen():
    names, dynamic = global_bindings(ast.parse(CELL))
    assert names == {"os", "np", "to_json", "x", "i", "j", "k", "handle", "train", "trained", "Model", "error",
                     "kept", "flag", "first", "rest", "others", "head", "tail", "whole"}
    assert not dynamic  # local_only, attribute and n stay in their own scopes


@pytest.mark.parametrize("cell", ["exec('made = 1')", "globals()['made'] = 1", "vars()['made'] = 1",
                                  "from os.path import *", "eval('(made := 1)')", "g = locals\ng()['made'] = 1"])
def test_a_cell_that_may_bind_names_dynamically_gets_the_benefit_of_the_doubt(cell):
    check_out_names(ast.parse(cell), ["made"], shipped=())


def test_a_name_sent_from_the_notebook_can_come_back():
    check_out_names(ast.parse("total = base * 2"), ["base", "total"], shipped=["base"])


def test_a_name_the_cell_never_binds_is_one_line_naming_it():
    with pytest.raises(UnboundOutputError) as raised:
        check_out_names(ast.parse("def f():\n    inner = 1\nresult = f()"), ["result", "inner", "typo"], shipped=())
    assert str(raised.value) == ("-o/--out inner, typo: the cell never assigns them nor reads them from the "
                                 "notebook, so the leader cannot bring them back")
    assert isinstance(raised.value, (CaptureError, NameError))
