"""An agent's part in a session's channel on a bucket: the leader's agent opens the hub, another host's joins it.

The hub (``runner.channel``) carries the session's cells and records between
the notebook, the hosts and their agents; from the moment it listens (or this
agent has joined it) the agent's records go through it too, with storage
behind (``runner.relayed``). A host or agent leaving it sends everyone back to
storage, together. Host-safe.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

from kinetic_nb.agent.liveness import Liveness
from kinetic_nb.runner import protocol
from kinetic_nb.runner.channel import Address, Channel, Hub, Joining, agent_role
from kinetic_nb.runner.hub_door import local_hub_path
from kinetic_nb.runner.protocol import JobPlan
from kinetic_nb.runner.relayed import Relay, RelayedStorage, hosts_agreed
from kinetic_nb.storage import Storage

#: How long another host's agent keeps trying to join the leader's hub (it starts at about the same time).
HUB_JOIN_S = 60.0


class HubRole:
    """The channel's side of an agent (``agent.supervisor.Agent``): the attributes below are the agent's."""

    storage: Storage
    key: bytes
    plan: JobPlan
    indices: list[int]
    scratch: str
    liveness: Liveness
    #: A session's hub, when this agent runs the leader's host of a session on a bucket.
    hub: Hub | None
    #: The leader's hub, which this agent (another host's) joins once its host is forked.
    _hub_address: tuple[str, int] | None
    _relay: Relay | None

    # The agent's records (``agent.record_keeping``): named here, defined there.
    _storage_failed: Callable[[str, BaseException], None]
    write_record: Callable[..., bool]

    def open_hub(self, address: Address | None = None, agents: int = 0) -> None:
        """Listen for the session's channel before the hosts are forked (they are told where in their
        environment); from here on this agent's records go through it too. ``address``: where the backend told
        the hosts it is (host 0's); None for hosts on this machine, whose hub is a Unix socket in the session's
        own 0700 directory, which no other user can open. ``agents``: how many other hosts' agents join it (a
        backend with an agent per host). Where it cannot listen, it says why and the cells travel by storage."""
        try:
            self.hub = Hub(self.key, address or local_hub_path(self.plan.job_id, self.scratch),
                           hosts=self.plan.world_size, agents=agents, procs_per_host=self.plan.procs_per_host,
                           on_record=self._heard, on_lost=self._left_the_channel)
        except OSError as error:
            print(f"kinetic agent: the session's hub cannot listen ({error}); the session's cells travel through "
                  "storage", file=sys.stderr, flush=True)
            return
        self._relay = Relay(self.storage, serves=lambda name: name.startswith((protocol.HOSTS_DIR + "/",
                                                                             protocol.CELLS_DIR + "/")),
                            on_error=self._storage_failed)
        self.storage = RelayedStorage(self._relay)

    def _start_hub(self) -> None:
        """Accept the hosts and notebooks (threads: only once every host is forked), and say where."""
        self.hub.start()
        self.write_record(protocol.CHANNEL, json.dumps({"address": self.hub.announced}).encode())

    def _heard(self, name: str, data: object) -> None:
        """The hosts' start verdict, through the hub: when it says they use the channel, so does this agent."""
        if name == protocol.LEADER_READY and hosts_agreed(self.hub.mirror, self.key):
            self._relay.attach(lambda name, data: self.hub.publish(name, data), self.hub.mirror)
            self.liveness.beat_now()  # the notebooks read the hosts' heartbeats from the hub from now on

    def join_hub(self, address: Address) -> None:
        """Another host's agent: its records (its host's output, its end) go through the leader's hub too, once
        it has joined (tried in the background, once its host is forked, while the leader's agent starts;
        storage until then). Its reads are storage's, or what the channel carried (its host's status)."""
        self._relay = Relay(self.storage, serves=lambda name: False, on_error=self._storage_failed)
        self.storage = RelayedStorage(self._relay)
        self._hub_address = address

    def _start_joining(self, address: Address) -> None:
        def then(channel: Channel | None, error: str) -> None:
            if channel is not None:
                self._relay.attach(channel.send, channel.mirror)
                self.liveness.beat_now()
            else:
                print(f"kinetic agent: could not join the session's hub ({error}); the session's cells travel "
                      "through storage", file=sys.stderr, flush=True)

        Joining(address, self.key, agent_role(self.plan.host_of(self.indices[0])), on_broken=self._relay.fall_back,
                give_up_after_s=HUB_JOIN_S, then=then)

    def _left_the_channel(self, role: str) -> None:
        """A host or an agent left the channel (it ended, or its link broke): everyone goes back to storage,
        together, so that no host waits on the channel for a record another one stored."""
        if self.hub is not None:
            self.hub.close()
        if self._relay is not None:
            self._relay.fall_back(f"{role} left the channel")
