"""``python -m kinetic_nb.agent.warm``: a notebook's warm agent, past its imports, that forks each local job's agent.

A local job's agent spends most of its start importing itself (about 100 ms
of a trivial job's 150-250). The local backend keeps one warm agent per
notebook process instead: it imports what an agent needs once, then waits on
a unix socket; for each job it forks, and the child becomes that job's agent
(``python -m kinetic_nb.agent --all-hosts``) as a freshly started one would:
its own session, the notebook's working directory and environment, its log as
its output, the job's key in memory only.

The socket is in Linux's abstract namespace under a random name, and both
ends check the other's credentials (``SO_PEERCRED``): only this user's
notebook that started it is served. It ends with the notebook (a parent-death
signal); the agents it forked do not: like any job's agent they live until
their job ends, so a kernel restart leaves a job running.

On an ssh host (``--stdio``) the warm agent runs in the host's kept
environment and takes its requests as JSON lines on standard input, the
notebook's ssh channel (ssh has authenticated the other end), answering one
line each: a job's agent to fork (its variables over the host's own), or
free ports for a job's coordinator and hub. It ends when standard input
does: the notebook or its connection is gone. Host-safe.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import select
import socket
import struct
import sys
import time

from kinetic_nb.agent import __main__ as agent_main  # the imports every job's agent needs, made once here
from kinetic_nb.agent.local_state import AgentState
from kinetic_nb.agent.processes import die_with_parent, process_start
from kinetic_nb.runner.encryption import load_cipher
from kinetic_nb.runner.ports import free_ports

#: A request is one JSON object (the agent's arguments, environment, working directory, key); it is small.
MAX_REQUEST_BYTES = 4 * 1024 * 1024
#: How long the server waits for a connected notebook to finish its request.
REQUEST_TIMEOUT_S = 5.0
#: Children are reaped at least this often (a dead agent must not look alive for long as a zombie).
REAP_EVERY_S = 0.5
_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_credentials(connection: socket.socket) -> tuple[int, int]:
    """The pid and uid of the process at the other end of a unix socket."""
    pid, uid, _ = _CREDENTIALS.unpack(connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                            _CREDENTIALS.size))
    return pid, uid


def read_request(connection: socket.socket) -> dict:
    chunks, size = [], 0
    while True:
        chunk = connection.recv(65536)
        if not chunk:
            break
        size += len(chunk)
        if size > MAX_REQUEST_BYTES:
            raise ValueError("request too large")
        chunks.append(chunk)
    request = json.loads(b"".join(chunks))
    if not isinstance(request, dict):
        raise ValueError("a request is a JSON object")
    return request


def serve(parent: int, name: str) -> int:
    die_with_parent(parent)  # armed before anything else: it never outlives its notebook
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + name)
    listener.listen(16)
    while True:
        _reap()
        readable, _, _ = select.select([listener], [], [], REAP_EVERY_S)
        if not readable:
            continue
        connection, _ = listener.accept()
        with connection:
            try:
                _, uid = peer_credentials(connection)
                if uid != os.getuid():
                    continue  # only this user's notebook is served
                connection.settimeout(REQUEST_TIMEOUT_S)
                request = read_request(connection)
            except (OSError, ValueError):
                continue
            pid = os.fork()
            if pid == 0:
                listener.close()
                connection.close()
                os._exit(_become_agent(request))
            connection.sendall(f"{pid}\n".encode())


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _become_agent(request: dict) -> int:
    """In the forked child: start as ``python -m kinetic_nb.agent ARGV`` would have, and run."""
    try:
        os.setsid()  # its own session: whatever ends the notebook's spares the job
        output = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(output, 1)
        os.dup2(output, 2)
        os.close(output)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.path[0] = request["cwd"]  # as ``python -m`` puts the working directory first
        sys.argv = [agent_main.__file__, *request["argv"]]
        sys.stdin = io.StringIO(request["key"] + "\n")  # --key-stdin: the key, in memory only
        code = agent_main.main(request["argv"])
    except BaseException as error:  # noqa: BLE001 - said in the agent's log, which the notebook quotes
        print(f"kinetic agent: could not start from the warm agent: {type(error).__name__}: {error}",
              file=sys.stderr)
        _record_ended(request)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code if isinstance(code, int) else 1


def _record_ended(request: dict) -> None:
    """Say in the agent's own record that it ended (before it started any host, unless its record says
    otherwise): the notebook then reports it at once, with its log's tail, instead of after the start timeout."""
    argv = request.get("argv") or []
    if "--state" not in argv[:-1]:
        return
    path = argv[argv.index("--state") + 1]
    with contextlib.suppress(Exception):
        if AgentState.read(path) is None:
            AgentState(pid=os.getpid(), started_at=time.time(), process_start=process_start(os.getpid()),
                       finished=True).write(path)


def serve_stdio() -> int:
    """An ssh host's warm agent: one JSON request a line on standard input, one JSON answer a line on standard
    output (the first, ``{"ready": ...}``, once its imports are done); it ends when standard input does."""
    base = dict(os.environ)  # the host's login environment, this environment's bin first (as the bootstrap's)
    base["PATH"] = os.path.join(sys.prefix, "bin") + os.pathsep + base.get("PATH", "/usr/bin:/bin")
    base["VIRTUAL_ENV"] = sys.prefix
    cwd = os.getcwd()
    _answer_line({"ready": True, "pid": os.getpid()})
    load_cipher()  # while it waits: every host it forks decrypts the notebook's folder shipped to it
    pending = b""
    while True:
        _reap()
        readable, _, _ = select.select([0], [], [], REAP_EVERY_S)
        if not readable:
            continue
        chunk = os.read(0, 65536)
        if not chunk:
            return 0
        pending += chunk
        if len(pending) > MAX_REQUEST_BYTES:
            return 1
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            _answer_line(_answer(line, base, cwd))


def _answer_line(answer: dict) -> None:
    os.write(1, (json.dumps(answer) + "\n").encode())


def _answer(line: bytes, base: dict[str, str], cwd: str) -> dict:
    """What one ``--stdio`` request asks: ``{"ports": N}`` (N free ports, distinct) or ``{"launch": {"argv",
    "env", "key", "log"}}`` (fork that job's agent: the pid; ``log`` under the host's cache directory)."""
    try:
        request = json.loads(line)
        if "ports" in request:  # as the ssh probe finds them: below the ephemeral range, distinct
            return {"ports": free_ports(int(request["ports"]))}
        job = request["launch"]
        log = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), job["log"])
        os.makedirs(os.path.dirname(log), mode=0o700, exist_ok=True)
        forked = {"argv": list(job["argv"]), "env": {**base, **job["env"]}, "cwd": cwd, "key": job["key"],
                  "log": log}
    except (ValueError, KeyError, TypeError, OSError) as error:
        return {"error": f"{type(error).__name__}: {error}"}
    pid = os.fork()
    if pid == 0:
        os._exit(_become_agent(forked))
    return {"pid": pid}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kinetic_nb.agent.warm", description=__doc__)
    parser.add_argument("--parent", type=int, help="the notebook's pid: this ends with it")
    parser.add_argument("--name", help="the socket's name in the abstract namespace")
    parser.add_argument("--stdio", action="store_true",
                        help="an ssh host's: requests on standard input, answers on standard output")
    args = parser.parse_args(argv)
    if args.stdio:
        return serve_stdio()
    if args.parent is None or not args.name:
        parser.error("--parent and --name are needed (or --stdio)")
    return serve(args.parent, args.name)


if __name__ == "__main__":
    sys.exit(main())
