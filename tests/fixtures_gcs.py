"""Fixtures for ``gs://`` tests: a real fake-gcs-server for the session, and a fresh root per test.

Used from ``tests/storage/conftest.py``; any other test directory can import
them the same way (``from tests.fixtures_gcs import gcs_emulator, gcs_root``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from .gcs_emulator import GcsEmulator

#: The bucket every gs:// test works in; each test gets its own prefix.
TEST_BUCKET = "kinetic-tests"


@pytest.fixture(scope="session")
def gcs_emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GcsEmulator]:
    """A fake-gcs-server on a free loopback port, with ``TEST_BUCKET``, stopped after the session."""
    emulator = GcsEmulator(tmp_path_factory.mktemp("gcs-emulator"))
    emulator.start()
    try:
        emulator.create_bucket(TEST_BUCKET)
        yield emulator
    finally:
        emulator.stop()


@pytest.fixture
def gcs_root(gcs_emulator: GcsEmulator, monkeypatch: pytest.MonkeyPatch,
             tmp_path_factory: pytest.TempPathFactory) -> str:
    """A fresh ``gs://`` root in the emulator; ``STORAGE_EMULATOR_HOST`` is set for this test.

    The prefix repeats the session's temporary directory, so a job URI below it
    names that directory as a ``file://`` one would: the check that no job
    process outlives its test recognises gs:// jobs too.
    """
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator.url)
    session = str(tmp_path_factory.getbasetemp()).strip("/")
    return f"gs://{TEST_BUCKET}/{session}/{os.urandom(6).hex()}"


@pytest.fixture
def storage_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The notebook has no route to a session's hub: its cells travel through storage, the fallback a test of
    the storage path measures (the hosts still use their channel among themselves)."""
    from kinetic_nb.backends.local import LocalBackend

    monkeypatch.setattr(LocalBackend, "channel_route", lambda self, plan, announced: None)
