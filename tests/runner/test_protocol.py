import dataclasses
import json
import pickle
import re

import pytest

from kinetic_nb.runner import protocol
from kinetic_nb.runner.protocol import ExitSummary, HostStatus, JobPlan, ResultPayload


def test_exit_records_keep_the_platforms_reason_and_tolerate_newer_fields():
    summary = ExitSummary(2, None, "SIGKILL", reason="OOMKilled", ended_at=5.0)
    assert ExitSummary.from_json(summary.to_json()) == summary
    assert summary.describe() == "was killed by SIGKILL (OOMKilled)"
    newer = json.dumps({**json.loads(summary.to_json()), "from_a_later_version": 1}).encode()
    assert ExitSummary.from_json(newer) == summary


@pytest.mark.parametrize(
    ("summary", "failed"),
    [
        (ExitSummary(1, 1), True),
        (ExitSummary(1, 0), True),  # ended without recording success
        (ExitSummary(1, 0, recorded_success=True), False),
        (ExitSummary(1, None, "SIGABRT", recorded_success=True), False),  # a teardown crash
        # Exit code 3 is the host's own (a cell's os._exit(3)): only a record says kinetic_nb stopped it.
        (ExitSummary(1, protocol.EXIT_STOPPED), True),
        (ExitSummary(1, protocol.EXIT_STOPPED, stopped=True), False),
        (ExitSummary(1, None, "SIGKILL", stopped=True), False),
    ],
)
def test_which_exits_are_a_hosts_own_failure(summary, failed):
    assert summary.failed is failed


def test_object_names_parse_back():
    for host in (0, 9, 10, 255):
        assert protocol.parse_host_object(protocol.host_status(host)) == (host, "status", None)
        assert protocol.parse_host_object(protocol.host_heartbeat(host)) == (host, "heartbeat", None)
        assert protocol.parse_host_object(protocol.host_log_chunk(host, 12)) == (host, "log", 12)
        assert protocol.parse_cell_log_chunk(protocol.cell_log_chunk(205, host, 3)) == (205, host, 3)
        assert protocol.parse_host_object(protocol.cell_log_chunk(205, host, 3)) is None
        assert protocol.result_object(host) == ("result.pkl" if host == 0 else f"result-worker-{host}.pkl")
    assert protocol.parse_cell_log_chunk(protocol.host_log_chunk(1, 3)) is None
    assert protocol.parse_worker_result("result-worker-10.pkl") == 10
    assert protocol.parse_worker_result("result.pkl") is None


def test_records_round_trip():
    plan = JobPlan("kn-x", 4, "tpu-v5e-16", 4, "jax", "127.0.0.1:1234", 300.0, 30, 10, env_names=("A",))
    assert JobPlan.from_json(plan.to_json()) == plan and plan.coordinator_port == 1234
    status = HostStatus(1, "running", "execute", 1.0, 2.0, 42, "h", history=[["startup", 1.0]])
    assert HostStatus.from_json(status.to_json()) == status


def test_result_payloads_keep_todays_keys_and_round_trip():
    success = ResultPayload(success=True, result=[1, 2], outputs={"w": 3}, phase="execute", host_index=0)
    assert set(success.to_dict()) == {"success", "result", "outputs", "phase", "host_index"}
    failure = ResultPayload(success=False, exception=b"pickled", exception_type="ValueError", exception_message="bad",
                            traceback="Traceback ...", phase="execute", host_index=3, stopped=True)
    assert set(failure.to_dict()) == {"success", "exception", "exception_type", "exception_message", "traceback",
                                      "phase", "host_index", "stopped"}
    unpicklable = dataclasses.replace(failure, serialization_failed=True, result_repr="<lock>")
    assert unpicklable.to_dict()[protocol.SERIALIZATION_FAILED] and unpicklable.to_dict()[protocol.RESULT_REPR] == "<lock>"
    for record in (success, failure, unpicklable):
        assert ResultPayload.from_dict(pickle.loads(pickle.dumps(record.to_dict()))) == record


def test_result_payloads_tolerate_unknown_and_missing_keys():
    newer = {protocol.SUCCESS: True, protocol.RESULT_VALUE: 7, "from_a_later_version": 1}
    assert ResultPayload.from_dict(newer) == ResultPayload(success=True, result=7)
    assert ResultPayload.from_dict({}).success is False
    with pytest.raises(TypeError, match="a list, not a dict"):
        ResultPayload.from_dict([])


def test_every_name_the_protocol_makes_has_words_a_user_reads():
    """What the notebook says of a stored object names what it is, never its name (#39)."""
    seq, host = 7, 3
    names = [protocol.PLAN, protocol.PAYLOAD, protocol.RESULT, protocol.HANDLE, protocol.CHANNEL, protocol.LEADER_READY,
             protocol.CANCEL, protocol.FAILED, protocol.ENVIRONMENT_INSTALL, protocol.WORKDIR,
             protocol.worker_result(host), protocol.host_status(host), protocol.host_exit(host),
             protocol.host_heartbeat(host), protocol.host_log_chunk(host, 2), protocol.host_log_prefix(host),
             protocol.host_stacks(host, 1), protocol.stacks_request(1), f"{protocol.cell_dir(seq)}/{protocol.PAYLOAD}",
             f"{protocol.cell_dir(seq)}/{protocol.RESULT}", f"{protocol.cell_dir(seq)}/{protocol.LEADER_READY}",
             f"{protocol.cell_dir(seq)}/{protocol.cell_ready(host)}", protocol.cell_done(seq, host),
             protocol.cell_output_stored(seq, host), protocol.cell_log_chunk(seq, host, 0),
             protocol.cell_control(seq, "submitted"), protocol.cell_control(seq, "interrupt"),
             protocol.post_mortem_request(seq, host, 1), f"{protocol.cell_dir(seq)}/{protocol.CELL_ENDS}"]
    words = {name: protocol.object_words(name) for name in names}
    for name, said in words.items():
        assert said != "the job's records" and not re.search(r"[./_]|\d{2}", said), (name, said)
    assert words[protocol.host_exit(host)] == "host 3's end"
    assert words[f"{protocol.cell_dir(seq)}/{protocol.PAYLOAD}"] == "the cell's code"
    assert protocol.object_words("some/thing/new.bin") == "the job's records"
