"""``make test``'s two lanes: the second lane names real test files, and a test's lane is its file's."""

from __future__ import annotations

from .conftest import SECOND_LANE, TESTS_FOLDER, lane_of


def test_every_file_of_the_second_lane_is_a_test_file():
    assert sorted(name for name in SECOND_LANE if not (TESTS_FOLDER / name).is_file()) == []


def test_a_tests_lane_is_its_files():
    assert lane_of("tests/faults/test_lost.py::test_a_silent_host_is_lost[jax]") == "second"
    assert lane_of("tests/backends/test_kubernetes_scale.py::test_256_pods") == "second"
    assert lane_of("tests/backends/test_ray_backend.py::test_a_cell") == "main"
    assert lane_of("tests/lost.py::test_elsewhere") == "main"
