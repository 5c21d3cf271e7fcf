"""The doctor's report: one row per check, each failure with the command that fixes it."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["FAIL", "OK", "WARN", "Check", "DoctorReport"]

OK, WARN, FAIL = "ok", "warn", "fail"


@dataclasses.dataclass(frozen=True)
class Check:
    """One line of the doctor's table.

    Attributes
    ----------
    name : str
        What was checked.
    status : str
        ``ok``, ``warn`` or ``fail``.
    detail : str
        What was found, in one line.
    fix : str
        The command that fixes a failure (or a warning), else "".
    """

    name: str
    status: str
    detail: str
    fix: str = ""


@dataclasses.dataclass(frozen=True)
class DoctorReport:
    """Every check, in order; printed as a table with each failure's fix under it."""

    checks: tuple[Check, ...]

    @property
    def ok(self) -> bool:
        """No check failed (warnings allowed)."""
        return all(check.status != FAIL for check in self.checks)

    def table(self) -> str:
        width = max([len(check.name) for check in self.checks] + [5])
        lines = [f"{'check':<{width}}  status  detail"]
        for check in self.checks:
            lines.append(f"{check.name:<{width}}  {check.status:<6}  {check.detail}")
            if check.fix:
                lines.append(f"{'':<{width}}  {'fix:':<6}  {check.fix}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(self.table())
