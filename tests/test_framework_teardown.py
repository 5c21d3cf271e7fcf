"""A framework's teardown noise after a peer's failure stays in the host's log (#39): real torch (gloo) processes.

At b3f2552 gloo's "Connection closed by peer ... GLHF!" was echoed into the
cell above the real traceback and shown on the rows of ranks that succeeded
(their teardown's barrier fails once a peer is gone), and a host's row showed
its first process's line, not its failing one's.
"""

from __future__ import annotations

import pytest

import kinetic_nb
from kinetic_nb.client.echo import LeaderEcho
from kinetic_nb.notebook.display.panel import host_summary, text_summary
from kinetic_nb.runner import protocol
from kinetic_nb.runner.logs import LogChunkWriter, read_log_segments
from kinetic_nb.storage import open_storage

#: 2 hosts x 2 processes: rank 3 raises; the leader waits on a message from it (and loses its peer); ranks 1
#: and 2 are done and meet the others at teardown's barrier, which fails once rank 3 is gone.
RANK_THREE_RAISES = (
    "import time, torch, torch.distributed as dist\n"
    "rank = dist.get_rank()\n"
    "x = torch.ones(1)\n"
    "dist.all_reduce(x)\n"
    "print(f'rank {rank} reduced {x.item():g}', flush=True)\n"
    "if rank == 3:\n"
    "    time.sleep(1)\n"
    "    raise ValueError('rank three fails')\n"
    "if rank == 0:\n"
    "    dist.recv(x, src=3)\n"
    "rank\n"
)
#: What gloo says when a peer is gone (the end of its message: "... GLHF!").
GLOO_WORDS = ("Connection closed by peer", "Connection reset by peer", "GLHF", "gloo")


def gloo_in(text: str) -> bool:
    return any(words in text for words in GLOO_WORDS)


def test_gloo_teardown_after_a_peer_failed_stays_in_the_logs_never_the_cell_nor_a_succeeded_rows_line():
    shown: list[tuple[str, str]] = []
    handle = kinetic_nb.submit(RANK_THREE_RAISES, hosts=2, procs_per_host=2, framework="torch", grace=10,
                               echo=lambda text, stream=protocol.STDOUT: shown.append((stream, text)))
    with pytest.raises(ValueError, match="rank three fails"):
        handle.result()
    handle.wait(timeout=120)  # every rank ended: its whole log is in, and the echo has had all of the leader's
    snapshot = handle.snapshot()
    states = [host.state for host in snapshot.hosts]
    # Rank 3's exit breaks the others' gloo connections; its failure also reaches the client, which stops the ranks
    # still running. On a busy machine the stop can come first: the leader is then stopped in its recv (not failed
    # on it), ranks 1 and 2 in their teardown (which otherwise fails). Either way no row shows gloo's words.
    assert states[3] == "failed" and states[0] in ("failed", "stopped"), text_summary(snapshot)
    assert all(host.state == "succeeded" or (host.state == "stopped" and host.phase == protocol.Phase.TEARDOWN.value)
               for host in snapshot.hosts[1:3]), text_summary(snapshot)

    echoed = "".join(text for _, text in shown)
    assert "rank 0 reduced 4" in echoed and not gloo_in(echoed), shown
    for host in snapshot.hosts[1:3]:  # the ranks that succeeded: their own last line, not their teardown's
        assert host.row_line == f"rank {host.index} reduced 4", text_summary(snapshot)
    rows = {index: host_summary(index, processes) for index, processes in snapshot.by_host()}
    assert rows[1].last_line == "[rank 3] ValueError: rank three fails"  # host 1's row: its failing process's line
    if states[0] == "failed":  # its own failure, gloo's words and all
        assert rows[0].last_line.startswith("[rank 0] RuntimeError") and gloo_in(rows[0].last_line)
    else:
        assert not gloo_in(rows[0].last_line), text_summary(snapshot)

    for rank in (rank for rank in (1, 2) if states[rank] == "succeeded"):  # the teardown's words are in the log
        log = handle.logs(rank)
        assert f"host {rank // 2}, process {rank % 2} (rank {rank}): teardown after success failed" in log, log
        assert gloo_in(log)
    assert gloo_in(handle.logs(0)) or states[0] == "stopped"
    assert "rank three fails" in handle.logs(3)


#: Host 1 raises; host 0 says something as it is stopped, as JAX does ("preemption_notifier.cc] SIGTERM caught").
#: JAX's line comes from a thread of its own that does not always get there before the SIGKILL that follows the
#: SIGTERM; this handler prints at once.
STOPPED_AFTER_A_PEER = (
    "import os, signal, sys, time\n"
    "def stopped(signum, frame):\n"
    "    print('W1203 preemption_notifier.cc:90] SIGTERM caught', file=sys.stderr, flush=True)\n"
    "    os._exit(143)\n"
    "signal.signal(signal.SIGTERM, stopped)\n"
    "if os.environ['KINETIC_HOST_INDEX'] == '1':\n"
    "    raise ValueError('host one fails')\n"
    "print('host 0 waits', flush=True)\n"
    "time.sleep(60)\n"
)


def test_what_a_host_says_as_it_is_stopped_after_a_peer_failed_stays_in_its_log_off_its_row():
    handle = kinetic_nb.submit(STOPPED_AFTER_A_PEER, hosts=2, framework="none", grace=1)
    with pytest.raises(ValueError, match="host one fails"):
        handle.result()
    handle.wait(timeout=120)
    leader = handle.snapshot().hosts[0]
    assert leader.state == "stopped"
    assert "SIGTERM caught" in handle.logs(0)
    assert leader.row_line == "host 0 waits", leader


def test_what_a_host_prints_once_its_teardown_began_is_stored_apart_until_its_next_cell(tmp_path):
    storage = open_storage(f"file://{tmp_path}")
    writer = LogChunkWriter(storage, 1, None)
    writer.feed(b"the cell's line\n", protocol.STDOUT)
    writer.start_framework_teardown()
    writer.feed(b"Connection closed by peer\n", protocol.STDERR)
    writer.feed(b"a last word\n", protocol.STDOUT)
    writer.start_cell(2)
    writer.feed(b"the next cell's line\n", protocol.STDERR)
    writer.flush(final=True)
    assert read_log_segments(storage, 1, None, session=True) == [
        (protocol.STDOUT, "the cell's line\n"),
        (protocol.FRAMEWORK_OUTPUT, "Connection closed by peer\na last word\n"),
        (protocol.STDERR, "the next cell's line\n"),
    ]


def test_the_echo_leaves_the_frameworks_teardown_out():
    shown: list[tuple[str, str]] = []
    echo = LeaderEcho(lambda text, stream: shown.append((stream, text)))
    echo.feed(protocol.STDERR, "the leader's own\n")
    echo.feed(protocol.FRAMEWORK_OUTPUT, "Connection closed by peer\n")
    echo.close()
    assert shown == [(protocol.STDERR, "the leader's own\n")]


def test_a_hosts_row_shows_the_process_that_failed_on_its_own_before_one_that_lost_it():
    from kinetic_nb.state import HostSnapshot

    lost = HostSnapshot(index=2, state="failed", phase="execute", last_line="rank 2 reduced 4",
                        message="RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:6022. GLHF!")
    own = HostSnapshot(index=3, state="failed", phase="execute", last_line="rank 3 reduced 4",
                       message="ValueError: rank three fails")
    assert host_summary(1, (lost, own)).last_line == "[rank 3] ValueError: rank three fails"
    assert lost.row_line == lost.message  # a failed process's row: its failure's own line, not its last print
    assert HostSnapshot(index=0, state="succeeded", phase="teardown", last_line="done").row_line == "done"
