"""The notebook's versions in the plan, and hosts that refuse what they could not load, in one line."""

from __future__ import annotations

import platform

import cloudpickle
import pytest

import kinetic_nb
from kinetic_nb.client import plan as plan_module
from kinetic_nb.errors import PlanError
from kinetic_nb.runner import versions
from kinetic_nb.runner.protocol import JobPlan

HOST = {"python": "3.11.9", "cloudpickle": "3.1.1", "jax": "0.4.35"}


def test_the_plan_records_the_notebooks_versions_and_they_survive_the_wire():
    acc, hosts = plan_module.resolve_slice(2, None)
    plan = plan_module.make_plan(job_id="kn-x", acc=acc, hosts=hosts, framework="none",
                                 coordinator_address="127.0.0.1:1", simulated=True)
    assert plan.client_versions["python"] == platform.python_version()
    assert plan.client_versions["cloudpickle"] == cloudpickle.__version__
    assert JobPlan.from_json(plan.to_json()).client_versions == plan.client_versions
    old = plan.to_json().replace(b'"client_versions"', b'"ignored_by_old_readers"')
    assert JobPlan.from_json(old).client_versions == {}  # a plan without versions is never refused


@pytest.mark.parametrize(("notebook", "expected"), [
    ({**HOST, "python": "3.11.4"}, None),  # another patch release: the same bytecode
    ({**HOST, "jax": "0.5.0"}, None),  # a framework is only noted
    ({}, None),  # a plan from before versions were recorded
    ({**HOST, "python": "3.12.1"},
     "this host has Python 3.11.9 and the notebook Python 3.12.1: functions and classes shipped from the notebook "
     "are bytecode of one Python minor version (use an image with Python 3.12)"),
    ({**HOST, "cloudpickle": "2.2.1"},
     "this host has cloudpickle 3.1.1 and the notebook cloudpickle 2.2.1: cloudpickle loads only what the same "
     "cloudpickle version wrote (install cloudpickle==2.2.1 on the hosts)"),
])
def test_a_host_refuses_only_what_would_break_shipped_functions(notebook, expected):
    assert versions.refusal(notebook, HOST) == expected


def test_a_framework_that_differs_is_noted():
    assert versions.framework_notes({**HOST, "jax": "0.5.0"}, HOST) == [
        "note: this host has jax 0.4.35, the notebook jax 0.5.0"]
    assert versions.framework_notes(HOST, HOST) == []


def test_every_host_refuses_a_plan_from_another_python_and_the_cell_says_why(monkeypatch):
    """End to end, on real local hosts: the plan says Python 2.7; each host stops in its plan check."""
    monkeypatch.setattr(plan_module, "installed_versions",
                        lambda: {**versions.installed_versions(), "python": "2.7.18"})
    handle = kinetic_nb.submit("1", hosts=2, quiet=True)
    with pytest.raises(PlanError) as caught:
        handle.result(timeout=120)
    here = platform.python_version()
    assert str(caught.value) == (f"this host has Python {here} and the notebook Python 2.7.18: functions and classes "
                                 "shipped from the notebook are bytecode of one Python minor version (use an image "
                                 "with Python 2.7)")
    assert {host.state for host in handle.hosts()} <= {"failed", "stopped"}


def test_a_framework_version_is_read_as_importlib_metadata_reads_it(tmp_path, monkeypatch):
    import importlib.metadata

    for package in ("jax", "jaxlib", "cloudpickle", "numpy"):  # installed here (the test extra)
        assert versions.installed_version(package) == importlib.metadata.version(package)
    assert versions.installed_version("no-such-framework") is None
    # The first directory on sys.path that holds the distribution wins, as it does for an import; a name that
    # only starts the same (jax_cuda12_plugin, jaxlib for jax) is another distribution.
    first, second = tmp_path / "first", tmp_path / "second"
    (first / "Torch-9.1.0+cpu.dist-info").mkdir(parents=True)
    (first / "torch_extra-1.0.dist-info").mkdir()
    (second / "torch-8.0.0.dist-info").mkdir(parents=True)
    (tmp_path / "plain-file").write_text("not a directory on the path")
    monkeypatch.setattr("sys.path", [str(tmp_path / "plain-file"), str(tmp_path / "gone"), str(first), str(second)])
    assert versions.installed_version("torch") == "9.1.0+cpu"
    assert versions.installed_version("torch_extra") == "1.0"
    assert versions.installed_version("jax") is None
