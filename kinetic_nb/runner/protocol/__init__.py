"""The job protocol: object names, the plan, host records, payload keys, phases.

One module to import (``from kinetic_nb.runner import protocol``), in three
parts: ``names`` (every name a job's objects are stored under), ``log_chunks``
(a host's output as stored) and ``messages`` (the records, phases, states and
payload keys). Each is defined once; they import only the standard library,
so the runner stays host-safe.

A job lives under ``{storage root}/{job_id}/``::

    plan.json                    client, once, before any host starts
    payload.pkl                  client, once
    (every object but the empty heartbeat and ready markers carries an HMAC under the job's key: runner.envelope)
    hosts/{i}/status.json        host i, whenever its state or phase changes
    hosts/{i}/heartbeat          host i's agent, rewritten (empty) every few seconds while host i's process exists
    cells/{seq}/done-{i}         session host i: its status as cell seq left it (before status.json)
    cells/{seq}/output-{i}       session host i > 0's agent on a local disk: its output of cell seq is all stored
    hosts/{i}/log/{seq:06d}.json host i's stdout and stderr, append-only chunks of [stream, text] segments
    hosts/{i}/exit.json          host i's agent (or the backend, for what only the platform sees), when it ends
    hosts/{i}/stacks/{seq}.txt   host i's agent: every thread's Python stack, on request
    .leader_ready                the leader, after the start barrier (go or abort)
    control/cancel.json          a client or an agent: stop every host (the reason: cancelled, timeout)
    control/failed.json          the first agent to see one of its hosts fail (exclusive create)
    control/stacks-{seq}.json    a client: every agent dumps its live hosts' stacks
    result.pkl                   the leader only, success or failure
    result-worker-{i}.pkl        host i > 0, only when it fails
    outputs/                     the cell's files (KINETIC_OUTPUT_DIR)
    handle.json                  client, for listing and reattaching
    cancel.json                  client, when the job is cancelled

A session lives under ``{storage root}/sessions/{session_id}/``, as a job, and
each cell under ``cells/{seq:06d}/``: ``payload.pkl``, its barrier's
``ready-{i}`` and ``.leader_ready``, its outcome (``result.pkl``,
``result-worker-{i}.pkl``), and ``log/{i}/{n:06d}.json``, host i's output
during the cell (the hosts' own ``hosts/{i}/log/`` holds what they printed
before the first cell).
"""

from __future__ import annotations

from kinetic_nb.runner.protocol.log_chunks import (
    DISPLAY,
    FRAMEWORK_OUTPUT,
    STDERR,
    STDOUT,
    LogChunk,
    decode_log_chunk,
    decode_log_chunk_of_cell,
    encode_log_chunk,
)
from kinetic_nb.runner.protocol.messages import (
    CELL_FILENAME,
    CELL_FRAMEWORK,
    CELL_NAMESPACE,
    CELL_OUT_NAMES,
    CELL_PROFILE,
    CELL_SOURCE,
    EXCEPTION,
    EXCEPTION_MESSAGE,
    EXCEPTION_TYPE,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_STOPPED,
    HOST_INDEX,
    MISSING_OUTPUTS,
    OUTPUTS,
    PHASE,
    PROTOCOL_VERSION,
    RESULT_REPR,
    RESULT_VALUE,
    SERIALIZATION_FAILED,
    STOPPED,
    SUCCESS,
    TRACEBACK,
    CancelRequest,
    ExitSummary,
    FirstFailure,
    Framework,
    HostState,
    HostStatus,
    JobPlan,
    LeaderReady,
    Phase,
    PostMortemRequest,
    ResultPayload,
    process_label,
    process_name,
    stopped_message,
)
from kinetic_nb.runner.protocol.names import (
    CANCEL,
    CELL_DONE_PREFIX,
    CELL_OUTPUT_STORED_PREFIX,
    CELLS_DIR,
    CHANNEL,
    CONTROL_DIR,
    ENVIRONMENT_DIR,
    ENVIRONMENT_INSTALL,
    FAILED,
    HANDLE,
    HOSTS_DIR,
    LEADER_INDEX,
    LEADER_READY,
    OUTPUTS_DIR,
    PAYLOAD,
    PLAN,
    PROFILE_DIR,
    PROFILE_MERGED,
    RESULT,
    SESSIONS_DIR,
    WORKDIR,
    cell_control,
    cell_dir,
    cell_done,
    cell_log_chunk,
    cell_marker_seq,
    cell_of,
    cell_output_stored,
    cell_ready,
    host_exit,
    host_heartbeat,
    host_log_chunk,
    host_log_prefix,
    host_profile,
    host_stacks,
    host_status,
    is_cell_marker,
    object_words,
    parse_cell_control,
    parse_cell_done,
    parse_cell_log_chunk,
    parse_host_object,
    parse_stacks_request,
    parse_worker_result,
    post_mortem_answer,
    post_mortem_request,
    result_object,
    stacks_request,
    storage_error_words,
    worker_result,
)

__all__ = [
    "CANCEL",
    "CELLS_DIR",
    "CELL_DONE_PREFIX",
    "CELL_FILENAME",
    "CELL_FRAMEWORK",
    "CELL_NAMESPACE",
    "CELL_OUTPUT_STORED_PREFIX",
    "CELL_OUT_NAMES",
    "CELL_PROFILE",
    "CELL_SOURCE",
    "CHANNEL",
    "CONTROL_DIR",
    "DISPLAY",
    "ENVIRONMENT_DIR",
    "ENVIRONMENT_INSTALL",
    "EXCEPTION",
    "EXCEPTION_MESSAGE",
    "EXCEPTION_TYPE",
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_STOPPED",
    "FAILED",
    "FRAMEWORK_OUTPUT",
    "HANDLE",
    "HOSTS_DIR",
    "HOST_INDEX",
    "LEADER_INDEX",
    "LEADER_READY",
    "MISSING_OUTPUTS",
    "OUTPUTS",
    "OUTPUTS_DIR",
    "PAYLOAD",
    "PHASE",
    "PLAN",
    "PROFILE_DIR",
    "PROFILE_MERGED",
    "PROTOCOL_VERSION",
    "RESULT",
    "RESULT_REPR",
    "RESULT_VALUE",
    "SERIALIZATION_FAILED",
    "SESSIONS_DIR",
    "STDERR",
    "STDOUT",
    "STOPPED",
    "SUCCESS",
    "TRACEBACK",
    "WORKDIR",
    "CancelRequest",
    "ExitSummary",
    "FirstFailure",
    "Framework",
    "HostState",
    "HostStatus",
    "JobPlan",
    "LeaderReady",
    "LogChunk",
    "Phase",
    "PostMortemRequest",
    "ResultPayload",
    "cell_control",
    "cell_dir",
    "cell_done",
    "cell_log_chunk",
    "cell_marker_seq",
    "cell_of",
    "cell_output_stored",
    "cell_ready",
    "decode_log_chunk",
    "decode_log_chunk_of_cell",
    "encode_log_chunk",
    "host_exit",
    "host_heartbeat",
    "host_log_chunk",
    "host_log_prefix",
    "host_profile",
    "host_stacks",
    "host_status",
    "is_cell_marker",
    "object_words",
    "parse_cell_control",
    "parse_cell_done",
    "parse_cell_log_chunk",
    "parse_host_object",
    "parse_stacks_request",
    "parse_worker_result",
    "post_mortem_answer",
    "post_mortem_request",
    "process_label",
    "process_name",
    "result_object",
    "stacks_request",
    "stopped_message",
    "storage_error_words",
    "worker_result",
]
