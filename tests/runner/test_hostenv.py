import logging

import pytest

from kinetic_nb.runner.hostenv import resolve_host_index


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, None),
        ({"KINETIC_HOST_INDEX": "3"}, 3),
        ({"TPU_WORKER_ID": "2", "LWS_WORKER_INDEX": "5"}, 2),  # TPU_WORKER_ID first
        ({"LWS_WORKER_INDEX": "5", "JOB_COMPLETION_INDEX": "6"}, 5),
        ({"JOB_COMPLETION_INDEX": "6", "KINETIC_HOST_INDEX": "7"}, 6),
        ({"TPU_WORKER_ID": "", "KINETIC_HOST_INDEX": "1"}, 1),
        ({"TPU_WORKER_ID": " 4 "}, 4),
    ],
)
def test_first_valid_variable_wins(environ, expected):
    assert resolve_host_index(environ) == expected


@pytest.mark.parametrize("bad", ["-1", "abc", "1.5"])
def test_invalid_values_are_logged_and_skipped_never_taken_as_the_leader(bad, caplog):
    with caplog.at_level(logging.WARNING):
        assert resolve_host_index({"TPU_WORKER_ID": bad, "LWS_WORKER_INDEX": "3"}) == 3
        assert resolve_host_index({"TPU_WORKER_ID": bad}) is None
    assert f"TPU_WORKER_ID={bad!r}" in caplog.text
