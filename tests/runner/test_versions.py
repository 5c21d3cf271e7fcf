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
