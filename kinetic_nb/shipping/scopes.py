"""Scope analysis of a cell: which global names it may read before binding them.

Top-level statements (and class bodies) are followed in execution order, so a
name the cell binds before it reads it is not a read; function, lambda and
comprehension bodies read every global name that is not their own. Where the
analysis cannot be sure, it counts the name as read: shipping one value too
many costs bytes, one too few breaks the cell.

``cell_reads(tree)`` is the entry point; ``capture`` filters its answer by
what the notebook actually holds.
"""

from __future__ import annotations

import ast
from collections.abc import Callable

from kinetic_nb.shipping.scope_frames import (
    COMPREHENSION_NODES,
    ClassBody,
    evaluated_at_definition,
    imported_names,
    module_reads_of_scope,
    names_deleted_from_module,
    names_unbound_in,
)

__all__ = ["cell_reads"]

class _CellReads:
    """Follows the cell's top-level statements in execution order.

    ``bound`` holds the names definitely bound, at this point, in the namespace
    now executing (the module, or a class body run at definition time). A read
    of a name not in it may reach the notebook: that name is recorded in
    ``reads``.
    """

    def __init__(self, tree: ast.Module) -> None:
        self.reads: set[str] = set()
        self.bound: set[str] = set()
        self.class_body: ClassBody | None = None
        self.deleted_from_module = names_deleted_from_module(tree)

    @classmethod
    def of(cls, tree: ast.Module) -> set[str]:
        walker = cls(tree)
        walker.run_block(tree.body)
        return walker.reads

    # ---- names

    def _module_bound(self) -> set[str]:
        return self.class_body.module_bound if self.class_body else self.bound

    def read(self, name: str) -> None:
        body = self.class_body
        if body is not None and name in body.global_decls:
            self.read_module(name)
        elif name not in self.bound and (body is None or name not in body.module_bound):
            self.reads.add(name)

    def read_module(self, name: str) -> None:
        """A read from a nested scope: class bodies are skipped, and a later ``del`` may undo a binding."""
        if name not in self._module_bound() or name in self.deleted_from_module:
            self.reads.add(name)

    def bind(self, name: str) -> None:
        if self.class_body is not None and name in self.class_body.global_decls:
            return  # binds the module name from inside a class: not counted as definite
        self.bound.add(name)

    def unbind(self, name: str) -> None:
        self.bound.discard(name)

    # ---- statements

    def run_block(self, statements: list[ast.stmt]) -> bool:
        """Run statements in order; False when the block cannot fall through to what follows."""
        return all(self.run(statement) for statement in statements)

    def run(self, node: ast.stmt) -> bool:
        handler = getattr(self, f"run_{type(node).__name__}", None)
        if handler is not None:
            return handler(node)
        for child in ast.iter_child_nodes(node):  # Expr, Return, Assert, Pass, ...
            self.evaluate(child)
        return not isinstance(node, (ast.Raise, ast.Return, ast.Break, ast.Continue))

    def run_Assign(self, node: ast.Assign) -> bool:
        self.evaluate(node.value)
        for target in node.targets:
            self.assign(target)
        return True

    def run_AugAssign(self, node: ast.AugAssign) -> bool:
        if isinstance(node.target, ast.Name):
            self.read(node.target.id)
        else:
            self.assign(node.target)
        self.evaluate(node.value)
        return True

    def run_AnnAssign(self, node: ast.AnnAssign) -> bool:
        if node.value is not None:
            self.evaluate(node.value)
        self.evaluate(node.annotation)
        if isinstance(node.target, ast.Name):
            if node.value is not None:
                self.bind(node.target.id)
        else:
            self.assign(node.target)
        return True

    def run_Delete(self, node: ast.Delete) -> bool:
        for target in node.targets:
            if isinstance(target, ast.Name):
                self.read(target.id)
                self.unbind(target.id)
            else:
                self.assign(target)
        return True

    def run_Import(self, node: ast.Import | ast.ImportFrom) -> bool:
        for name in imported_names(node):
            self.bind(name)
        return True

    run_ImportFrom = run_Import

    def run_Global(self, node: ast.Global) -> bool:
        if self.class_body is not None:
            self.class_body.global_decls.update(node.names)
        return True

    def run_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
        for part in evaluated_at_definition(node):
            self.evaluate(part)
        module_reads = module_reads_of_scope(node)
        self.bind(node.name)
        if self.class_body is not None:
            self.class_body.deferred_reads |= module_reads
        else:
            # The function can run only once defined, so its own name counts as bound.
            for name in module_reads:
                self.read_module(name)
        return True

    run_AsyncFunctionDef = run_FunctionDef

    def run_ClassDef(self, node: ast.ClassDef) -> bool:
        for part in evaluated_at_definition(node):
            self.evaluate(part)
        outer_bound, outer_body = self.bound, self.class_body
        body = ClassBody(self._module_bound(), set())
        self.bound, self.class_body = set(), body
        self.run_block(node.body)
        self.bound, self.class_body = outer_bound, outer_body
        self.bind(node.name)
        if outer_body is not None:
            outer_body.deferred_reads |= body.deferred_reads
        else:
            for name in body.deferred_reads:
                self.read_module(name)
        return True

    def run_If(self, node: ast.If) -> bool:
        self.evaluate(node.test)
        return self._join([node.body, node.orelse])

    def run_For(self, node: ast.For | ast.AsyncFor) -> bool:
        self.evaluate(node.iter)
        return self._loop(node, start_pass=lambda: self.assign(node.target))

    run_AsyncFor = run_For

    def run_While(self, node: ast.While) -> bool:
        return self._loop(node, start_pass=lambda: self.evaluate(node.test))

    def _loop(self, node: ast.For | ast.AsyncFor | ast.While, start_pass: Callable[[], None]) -> bool:
        # The body may run zero times or many: each pass starts with only what every
        # pass is sure to have, and nothing the body binds is definite after the loop.
        loop_start = self.bound - names_unbound_in(node.body)
        self.bound = set(loop_start)
        start_pass()
        self.run_block(node.body)
        self.bound = set(loop_start)
        self.run_block(node.orelse)
        self.bound = loop_start - names_unbound_in(node.orelse)
        return True

    def run_With(self, node: ast.With | ast.AsyncWith) -> bool:
        for item in node.items:
            self.evaluate(item.context_expr)
            if item.optional_vars is not None:
                self.assign(item.optional_vars)
        return self.run_block(node.body)

    run_AsyncWith = run_With

    def run_Try(self, node: ast.Try) -> bool:
        before = set(self.bound)
        ends: list[set[str]] = []
        if self.run_block(node.body) and self.run_block(node.orelse):
            ends.append(self.bound)
        interrupted = before - names_unbound_in(node.body)
        for handler in node.handlers:
            self.bound = set(interrupted)
            if handler.type is not None:
                self.evaluate(handler.type)
            if handler.name:
                self.bind(handler.name)
            falls_through = self.run_block(handler.body)
            if handler.name:
                self.unbind(handler.name)  # Python deletes the ``as`` name after the handler
            if falls_through:
                ends.append(self.bound)
        if not node.finalbody:
            return self._settle(ends, before)
        final_start = interrupted - names_unbound_in([*node.handlers, *node.orelse])
        self.bound = set(final_start)
        if not self.run_block(node.finalbody) or not ends:
            self.bound = final_start
            return False
        final_end = self.bound
        self.bound = (set.intersection(*ends) - names_unbound_in(node.finalbody)) | (final_end - final_start)
        return True

    run_TryStar = run_Try

    def run_Match(self, node: ast.Match) -> bool:
        self.evaluate(node.subject)
        start = set(self.bound)
        ends: list[set[str]] = []
        exhaustive = False
        for case in node.cases:
            self.bound = set(start)
            self.match_pattern(case.pattern)
            if case.guard is not None:
                self.evaluate(case.guard)
            if self.run_block(case.body):
                ends.append(self.bound)
            irrefutable = isinstance(case.pattern, ast.MatchAs) and case.pattern.pattern is None
            exhaustive = exhaustive or (irrefutable and case.guard is None)
        if not exhaustive:
            ends.append(start)
        return self._settle(ends, start)

    def _join(self, blocks: list[list[ast.stmt]]) -> bool:
        start = set(self.bound)
        ends = []
        for block in blocks:
            self.bound = set(start)
            if self.run_block(block):
                ends.append(self.bound)
        return self._settle(ends, start)

    def _settle(self, ends: list[set[str]], fallback: set[str]) -> bool:
        """After branches: what every branch that falls through has bound."""
        if not ends:
            self.bound = fallback
            return False
        self.bound = set.intersection(*ends)
        return True

    # ---- patterns, targets, expressions

    def match_pattern(self, pattern: ast.pattern) -> None:
        if isinstance(pattern, ast.MatchValue):
            self.evaluate(pattern.value)
        elif isinstance(pattern, ast.MatchClass):
            self.evaluate(pattern.cls)
        elif isinstance(pattern, ast.MatchMapping):
            for key in pattern.keys:
                self.evaluate(key)
        for child in ast.iter_child_nodes(pattern):
            if isinstance(child, ast.pattern):
                self.match_pattern(child)
        name = pattern.rest if isinstance(pattern, ast.MatchMapping) else getattr(pattern, "name", None)
        if name:
            self.bind(name)

    def assign(self, target: ast.expr) -> None:
        """Store to a target: names bind; attributes and subscripts read their parts."""
        if isinstance(target, ast.Name):
            self.bind(target.id)
        elif isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                self.assign(element)
        elif isinstance(target, ast.Starred):
            self.assign(target.value)
        else:
            for child in ast.iter_child_nodes(target):
                self.evaluate(child)

    def evaluate(self, node: ast.AST, conditional: bool = False) -> None:
        """Read what an expression reads, in evaluation order.

        ``conditional`` marks code that may not run (the right of ``and``, an
        ``if`` arm), whose ``:=`` bindings are not definite.
        """
        if isinstance(node, ast.Name):
            if isinstance(node.ctx, ast.Load):
                self.read(node.id)
        elif isinstance(node, ast.NamedExpr):
            self.evaluate(node.value, conditional)
            if not conditional:
                self.bind(node.target.id)
        elif isinstance(node, ast.BoolOp):
            first, *rest = node.values
            self.evaluate(first, conditional)
            for value in rest:
                self.evaluate(value, conditional=True)
        elif isinstance(node, ast.IfExp):
            self.evaluate(node.test, conditional)
            self.evaluate(node.body, conditional=True)
            self.evaluate(node.orelse, conditional=True)
        elif isinstance(node, ast.Lambda):
            for part in evaluated_at_definition(node):
                self.evaluate(part, conditional)
            for name in module_reads_of_scope(node):  # may run at once: resolved here, not after binding
                self.read_module(name)
        elif isinstance(node, COMPREHENSION_NODES):
            self.evaluate(node.generators[0].iter, conditional)
            for name in module_reads_of_scope(node):
                self.read_module(name)
        else:
            for child in ast.iter_child_nodes(node):
                self.evaluate(child, conditional)


def cell_reads(tree: ast.Module) -> set[str]:
    """Every global name the cell may read before (or without) binding it itself."""
    return _CellReads.of(tree)

