"""How a function, lambda, class or comprehension sees names: its frame, and what it reads of the module.

The parts of a cell's scope analysis (``shipping.scopes``) below the cell's
own top-level statements.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable

SCOPE_NODES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
COMPREHENSION_NODES = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


class Frame:
    """The names one nested scope (function, lambda, comprehension, class) binds and reads."""

    def __init__(self, kind: str) -> None:
        self.kind = kind  # "function", "class" or "comprehension"
        self.bound: set[str] = set()
        self.reads: set[str] = set()
        self.global_decls: set[str] = set()
        self.nonlocal_decls: set[str] = set()
        #: walrus targets in a comprehension: they belong to the enclosing function
        self.passthrough: set[str] = set()
        self.children: list[ast.AST] = []

    @property
    def local(self) -> set[str]:
        return self.bound - self.global_decls - self.nonlocal_decls - self.passthrough

    @classmethod
    def of(cls, node: ast.AST) -> Frame:
        """Build the frame of ``node``, a scope node, without descending into nested scopes."""
        if isinstance(node, COMPREHENSION_NODES):
            frame = cls("comprehension")
            builder = FrameBuilder(frame)
            first, *rest = node.generators
            builder.visit(first.target)
            for condition in first.ifs:
                builder.visit(condition)
            for generator in rest:
                builder.visit(generator)
            for part in (node.key, node.value) if isinstance(node, ast.DictComp) else (node.elt,):
                builder.visit(part)
            return frame
        if isinstance(node, ast.ClassDef):
            frame = cls("class")
            FrameBuilder(frame).visit_statements(node.body)
            return frame
        frame = cls("function")
        frame.bound |= {parameter.arg for parameter in parameters(node.args)}
        builder = FrameBuilder(frame)
        if isinstance(node, ast.Lambda):
            builder.visit(node.body)
        else:
            builder.visit_statements(node.body)
        return frame

    def owns(self, name: str) -> bool:
        """Whether ``name`` is this function's or comprehension's own (a local, or a ``nonlocal`` cell)."""
        return name in self.local or name in self.nonlocal_decls

    def resolves_to_global(self, name: str, enclosing: tuple[Frame, ...]) -> bool:
        """Whether a read of ``name`` here may reach the module namespace."""
        if name in self.global_decls:
            return True
        if self.kind == "class":
            if name in self.bound:  # looked up in the class dict, then globals: may fall through
                return True
        elif self.owns(name):
            return False
        for outer in reversed(enclosing):
            if outer.kind == "class":  # class bodies are invisible to the scopes they contain
                continue
            if name in outer.global_decls:
                return True
            if outer.owns(name):
                return False
        return True


def parameters(arguments: ast.arguments) -> list[ast.arg]:
    every = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs, arguments.vararg, arguments.kwarg]
    return [argument for argument in every if argument is not None]


def evaluated_at_definition(node: ast.AST) -> list[ast.AST]:
    """The parts of a def, lambda or class that run in the enclosing scope, in order."""
    parts: list[ast.AST] = []
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        parts += node.decorator_list
    if isinstance(node, ast.ClassDef):
        return parts + node.bases + node.keywords
    arguments = node.args  # type: ignore[attr-defined]
    parts += arguments.defaults + [default for default in arguments.kw_defaults if default is not None]
    if not isinstance(node, ast.Lambda):
        parts += [parameter.annotation for parameter in parameters(arguments) if parameter.annotation is not None]
        parts += [node.returns] if node.returns is not None else []
    return parts


def walrus_targets(comprehension: ast.AST) -> set[str]:
    """Names bound by ``:=`` inside a comprehension (and comprehensions nested in it)."""
    targets: set[str] = set()
    pending = [comprehension]
    while pending:
        for child in ast.iter_child_nodes(pending.pop()):
            if isinstance(child, ast.NamedExpr) and isinstance(child.target, ast.Name):
                targets.add(child.target.id)
            if not isinstance(child, SCOPE_NODES):
                pending.append(child)
    return targets


class FrameBuilder(ast.NodeVisitor):
    """Fills a :class:`Frame` from the statements of its scope."""

    def __init__(self, frame: Frame) -> None:
        self.frame = frame

    def visit_statements(self, statements: list[ast.stmt]) -> None:
        for statement in statements:
            self.visit(statement)

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load):
            self.frame.reads.add(node.id)
        else:  # Store, or Del (which needs the name to exist: a read as well)
            self.frame.bound.add(node.id)
            if isinstance(node.ctx, ast.Del):
                self.frame.reads.add(node.id)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        if isinstance(node.target, ast.Name):
            self.frame.reads.add(node.target.id)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is None and isinstance(node.target, ast.Name):
            # ``x: int`` alone binds nothing (``(x): int`` does not even make x local).
            self.visit(node.annotation)
        else:
            self.generic_visit(node)

    def visit_NamedExpr(self, node: ast.NamedExpr) -> None:
        self.visit(node.value)
        if self.frame.kind == "comprehension":
            self.frame.passthrough.add(node.target.id)
        else:
            self.frame.bound.add(node.target.id)

    def visit_Global(self, node: ast.Global) -> None:
        self.frame.global_decls.update(node.names)

    def visit_Nonlocal(self, node: ast.Nonlocal) -> None:
        self.frame.nonlocal_decls.update(node.names)

    def _nested_scope(self, node: ast.AST) -> None:
        for part in evaluated_at_definition(node):
            self.visit(part)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            self.frame.bound.add(node.name)
        self.frame.children.append(node)

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = visit_ClassDef = _nested_scope

    def _comprehension(self, node: ast.AST) -> None:
        self.visit(node.generators[0].iter)  # type: ignore[attr-defined]
        targets = walrus_targets(node)
        if self.frame.kind == "comprehension":
            self.frame.passthrough |= targets
        else:
            self.frame.bound |= targets
        self.frame.children.append(node)

    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _comprehension

    def _import(self, node: ast.Import | ast.ImportFrom) -> None:
        self.frame.bound.update(imported_names(node))

    visit_Import = visit_ImportFrom = _import

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        if node.name:
            self.frame.bound.add(node.name)
        self.generic_visit(node)

    def _pattern_capture(self, node: ast.MatchAs | ast.MatchStar | ast.MatchMapping) -> None:
        name = node.rest if isinstance(node, ast.MatchMapping) else node.name
        if name:
            self.frame.bound.add(name)
        self.generic_visit(node)

    visit_MatchAs = visit_MatchStar = visit_MatchMapping = _pattern_capture


def imported_names(node: ast.Import | ast.ImportFrom) -> set[str]:
    """Names an import statement binds (``import a.b`` binds ``a``; ``*`` binds none we can know)."""
    return {alias.asname or alias.name.partition(".")[0] for alias in node.names if alias.name != "*"}


def module_reads_of_scope(node: ast.AST, enclosing: tuple[Frame, ...] = ()) -> set[str]:
    """Names a nested scope (and the scopes inside it) may read from the module namespace."""
    frame = Frame.of(node)
    reads = {name for name in frame.reads if frame.resolves_to_global(name, enclosing)}
    for child in frame.children:
        reads |= module_reads_of_scope(child, (*enclosing, frame))
    return reads


def names_deleted_from_module(tree: ast.Module) -> set[str]:
    """Names the cell may delete from the module namespace: ``del x`` at top level or after ``global x``."""
    deleted: set[str] = set()

    def walk(node: ast.AST, global_decls: set[str] | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (*SCOPE_NODES, *COMPREHENSION_NODES)):
                walk(child, {name for stmt in ast.walk(child) if isinstance(stmt, ast.Global) for name in stmt.names})
            elif isinstance(child, ast.Name) and isinstance(child.ctx, ast.Del):
                if global_decls is None or child.id in global_decls:
                    deleted.add(child.id)
            else:
                walk(child, global_decls)

    walk(tree, None)
    return deleted


def names_unbound_in(nodes: Iterable[ast.AST]) -> set[str]:
    """Names a block may unbind in its own namespace: ``del`` targets and ``except ... as`` names."""
    unbound: set[str] = set()
    pending: list[ast.AST] = list(nodes)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Del):
            unbound.add(node.id)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            unbound.add(node.name)
        if not isinstance(node, (*SCOPE_NODES, *COMPREHENSION_NODES)):
            pending.extend(ast.iter_child_nodes(node))
    return unbound


class ClassBody:
    """A class body run at definition time, in the module namespace's shadow."""

    def __init__(self, module_bound: set[str], global_decls: set[str]) -> None:
        self.module_bound = module_bound
        self.global_decls = global_decls
        #: module reads of its methods, resolved once the class name is bound
        self.deferred_reads: set[str] = set()
