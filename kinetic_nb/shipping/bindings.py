"""Which global names a cell may bind: what ``-o/--out`` can bring back from the leader.

An ``-o`` name the cell can never bind, and that the notebook does not send
with it, is a typo that would otherwise cost the whole run: it is refused
before any host starts. The cell's bindings are read from its AST: the
targets of assignments, loops, ``with``, ``import``, ``def``, ``class``,
``except ... as``, ``match`` captures and walrus expressions at the top level
(in any branch, taken or not), and every name a function declares
``global``. A cell that may bind names no AST shows (``exec``, ``eval``,
``globals()``, ``vars()``, ``locals()``, ``from m import *``) is given the
benefit of the doubt.

This module never imports IPython.
"""

from __future__ import annotations

import ast
from collections.abc import Collection, Iterable

from kinetic_nb.errors import UnboundOutputError

__all__ = ["check_out_names", "global_bindings"]

#: Names whose use means the cell may bind globals that its AST does not show.
_DYNAMIC_BINDERS = frozenset({"exec", "eval", "globals", "vars", "locals"})


class _GlobalBindings(ast.NodeVisitor):
    """Collects the module-level names a cell binds, and whether it may bind others dynamically."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.dynamic = False
        self._scopes = ["module"]

    def _bind(self, name: str | None, *, walrus: bool = False) -> None:
        scopes = [scope for scope in self._scopes if scope != "comprehension"] if walrus else self._scopes
        if name and scopes[-1] == "module":
            self.names.add(name)

    def _nested(self, node: ast.AST, scope: str) -> None:
        self._scopes.append(scope)
        self.generic_visit(node)
        self._scopes.pop()

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Store):
            self._bind(node.id)
        elif node.id in _DYNAMIC_BINDERS:
            self.dynamic = True

    def visit_NamedExpr(self, node: ast.NamedExpr) -> None:
        self._bind(node.target.id, walrus=True)
        self.visit(node.value)

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self._bind(node.name)
        self._nested(node, "function")

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self._nested(node, "function")

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._bind(node.name)
        self._nested(node, "class")

    def _comprehension(self, node: ast.AST) -> None:
        self._nested(node, "comprehension")

    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _comprehension

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._bind(alias.asname or alias.name.partition(".")[0])

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for alias in node.names:
            if alias.name == "*":
                self.dynamic = True
            self._bind(alias.asname or alias.name)

    def visit_Global(self, node: ast.Global) -> None:
        self.names.update(node.names)  # from any scope: the function may run

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        self._bind(node.name)
        self.generic_visit(node)

    def visit_MatchAs(self, node: ast.MatchAs) -> None:
        self._bind(node.name)
        self.generic_visit(node)

    def visit_MatchStar(self, node: ast.MatchStar) -> None:
        self._bind(node.name)

    def visit_MatchMapping(self, node: ast.MatchMapping) -> None:
        self._bind(node.rest)
        self.generic_visit(node)


def global_bindings(tree: ast.Module) -> tuple[set[str], bool]:
    """The global names a cell may bind, and whether it may bind others that its AST does not show.

    Parameters
    ----------
    tree : ast.Module
        The parsed cell.

    Returns
    -------
    names : set of str
        Every name bound at the top level (in any branch) or declared ``global``.
    dynamic : bool
        True when the cell uses ``exec``, ``eval``, ``globals``, ``vars``,
        ``locals`` or a star import.
    """
    visitor = _GlobalBindings()
    visitor.visit(tree)
    return visitor.names, visitor.dynamic


def check_out_names(tree: ast.Module, out: Iterable[str], shipped: Collection[str]) -> None:
    """Refuse ``-o`` names the leader can never hold: neither bound by the cell nor sent from the notebook.

    Parameters
    ----------
    tree : ast.Module
        The parsed cell.
    out : iterable of str
        The ``-o/--out`` names.
    shipped : collection of str
        The notebook variables that travel with the cell.

    Raises
    ------
    UnboundOutputError
        One line naming the names, before any host starts.
    """
    names, dynamic = global_bindings(tree)
    if dynamic:
        return
    never = [name for name in out if name not in names and name not in shipped]
    if never:
        them = "it" if len(never) == 1 else "them"
        raise UnboundOutputError(f"-o/--out {', '.join(never)}: the cell never assigns {them} nor reads {them} "
                                 f"from the notebook, so the leader cannot bring {them} back")
