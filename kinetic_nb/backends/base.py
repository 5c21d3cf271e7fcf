"""The small interface a backend implements."""

from __future__ import annotations

import abc

from kinetic_nb.runner.protocol import ExitSummary, JobPlan
from kinetic_nb.storage import ObjectInfo, Storage


class Backend(abc.ABC):
    """Starts a job's hosts, stops them, and says how each one ended."""

    name: str

    @abc.abstractmethod
    def coordinator_address(self, job_id: str) -> str:
        """The ``host:port`` the hosts' distributed framework meets at."""

    @abc.abstractmethod
    def launch(self, storage: Storage, plan: JobPlan) -> None:
        """Start every host of ``plan``; plan.json and payload.pkl are already stored."""

    @abc.abstractmethod
    def cancel(self, storage: Storage, plan: JobPlan, reason: str) -> None:
        """Ask for every host of the job to be stopped."""

    @abc.abstractmethod
    def exit_summaries(self, storage: Storage, plan: JobPlan, listing: list[ObjectInfo]) -> dict[int, ExitSummary]:
        """How each host that has ended ended, from a listing of the job's objects."""
