"""``%%kinetic`` and ``%kinetic``: parse, call the plain API, show, return.

Everything else is the client (``kinetic_nb.client``): launching, handles, sessions and the catalog.
"""

from __future__ import annotations

import datetime
import keyword
import re
import shlex
import sys
from collections.abc import Callable
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import (
    MagicArgumentParser,
    argument,
    argument_group,
    magic_arguments,
    parse_argstring,
)
from IPython.display import display
from IPython.utils.process import arg_split
from traitlets import Float, Unicode

from kinetic_nb.accelerators import accelerator_table
from kinetic_nb.client import backend_options, catalog, sessions
from kinetic_nb.client.catalog_records import printable
from kinetic_nb.client.cell_handle import CellHandle
from kinetic_nb.client.launch import submit
from kinetic_nb.client.outcome import cell_words
from kinetic_nb.client.plan import check_shape
from kinetic_nb.client.sessions import Session, SessionEndedError, attach_session
from kinetic_nb.errors import (
    CaptureError,
    IntegrityError,
    KineticError,
    ObjectNotFoundError,
    PostMortemError,
    StorageError,
    UnknownAcceleratorError,
)
from kinetic_nb.notebook.display import live_view
from kinetic_nb.notebook.session_commands import (
    SLICE_FLAGS,
    check_cell_fits_session,
    choose_backend_name,
    doctor_parser,
    session_start_parser,
    start_session,
    with_start_panel,
)
from kinetic_nb.runner import protocol
from kinetic_nb.runner.redact import MASK, SecretValue
from kinetic_nb.runner.stacks import readable_stacks

#: The ``%kinetic`` line magic's subcommands, in the order its help lists them.
SUBCOMMANDS = ("start", "stop", "restart", "profile", "pm", "sessions", "jobs", "attach", "cancel", "logs", "stacks", "gc",
               "doctor", "accelerators")


def _names(values: list[str]) -> list[str]:
    names = [name.strip() for value in values for name in value.split(",") if name.strip()]
    for name in names:
        if not name.isidentifier() or keyword.iskeyword(name):
            raise UsageError(f"-o/--out expects variable names, got {name!r}")
    return names


def _environment(values: list[str]) -> dict[str, SecretValue]:
    env = {}
    for value in values:
        key, sep, setting = value.partition("=")
        if not sep or not key.strip():
            # The value is not shown: without its name, it may be the secret itself.
            raise UsageError(f"-e/--env expects KEY=VALUE, got {len(value)} characters with no KEY= before them")
        env[key.strip()] = SecretValue(setting)
    return env


#: What the stored magic line says when its ``-e`` values could not be told apart from the rest of it.
_HIDDEN_OPTIONS = "(options not kept: a -e value could not be masked in them)"


def without_env_values(line: str, parser: MagicArgumentParser) -> str:
    """The magic line with each ``-e KEY=VALUE`` as ``-e KEY=***``: values are secrets, names are not.

    Every spelling the parser takes is masked (``-e K=V``, ``-eK=V``,
    ``-e=K=V``, ``--env K=V``, ``--env=K=V``, ``-e`` at the end of a group
    of short switches): a word that ends with a parsed ``K=V`` has its value
    replaced. The result is parsed again, and if any ``-e`` value survived
    it, no option is kept at all.

    Parameters
    ----------
    line : str
        The magic's line, as the user wrote it.
    parser : MagicArgumentParser
        The parser that reads ``line``; its ``-e`` values are ``env``.
    """
    try:
        entries = [str(entry).partition("=") for entry in getattr(parser.parse_argstring(line), "env", [])]
        words = arg_split(line, strict=True)  # as the parser splits it
        for name, _, value in entries:
            if value:
                words = [word[: -len(value)] + MASK if word.endswith(f"{name}={value}") else word for word in words]
        masked = " ".join(words)
        if all(str(entry).endswith(f"={MASK}") or str(entry).endswith("=")
               for entry in getattr(parser.parse_argstring(masked), "env", [])):
            return masked
    except UsageError:
        pass
    return _HIDDEN_OPTIONS


def refuse_abbreviations(parser: MagicArgumentParser) -> MagicArgumentParser:
    """``parser``, taking each long option only when spelled out: ``--en X=1`` is an error, never ``--env``.

    An abbreviation would slip past everything that looks for an option by
    its name (the masking of ``-e`` values above). ``MagicArgumentParser``
    does not take ``allow_abbrev``, so it is set after construction.
    """
    parser.allow_abbrev = False
    return parser


def _parser(prog: str, *arguments: tuple[tuple, dict]) -> MagicArgumentParser:
    parser = refuse_abbreviations(MagicArgumentParser(prog=prog, add_help=False))
    parser.add_argument("--storage", default=None, metavar="URI", help="The storage root (default: per-user).")
    for args, kwargs in arguments:
        parser.add_argument(*args, **kwargs)
    return parser


_LINE_PARSERS = {
    "jobs": _parser("%kinetic jobs", (("-n", "--limit"), dict(type=int, default=20, help="How many jobs."))),
    "attach": _parser("%kinetic attach", (("job_id",), {}),
                      (("-o", "--out"), dict(action="append", default=[], metavar="NAME[,NAME]")),
                      (("--key-file",), dict(default=None, metavar="PATH",
                                             help="The job's key, copied from the machine that submitted it.")),
                      (("--trust-unsigned",), dict(action="store_true",
                                                   help="Read a job stored before records were signed."))),
    "cancel": _parser("%kinetic cancel", (("job_id",), dict(nargs="?", default=None))),
    "logs": _parser("%kinetic logs", (("job_id",), dict(nargs="?", default=None)), (("--host",), dict(
        type=int, default=0, metavar="RANK", help="The process, by its rank (the host's index where each host runs "
                                                  "one process); default: the leader, rank 0."))),
    "stacks": _parser("%kinetic stacks", (("job_id",), dict(nargs="?", default=None)), (("--host",), dict(
        type=int, default=None, metavar="RANK", help="The process, by its rank (the host's index where each host "
                                                     "runs one process); default: every process."))),
    "start": session_start_parser(_parser),
    "stop": _parser("%kinetic stop"),
    "profile": _parser("%kinetic profile"),
    # Its help; the line itself is read by ``_line_pm``, which keeps the expression as written (quotes and all).
    "pm": refuse_abbreviations(MagicArgumentParser(prog="%kinetic pm", add_help=False)),
    "restart": _parser("%kinetic restart"),
    "sessions": _parser("%kinetic sessions", (("-n", "--limit"), dict(type=int, default=20, help="How many."))),
    "gc": _parser("%kinetic gc", (("--older-than",), dict(required=True, metavar="DURATION",
                                                          help="e.g. 7d, 12h, 30m"))),
    "doctor": doctor_parser(_parser),
    "accelerators": _parser("%kinetic accelerators"),
}


_LINE_PARSERS["pm"].add_argument("--cell", action="store_true",
                                 help="In the cell's own innermost frame (default: where it was raised, as %%debug).")
_LINE_PARSERS["pm"].add_argument("host", metavar="RANK", help="The process, by its rank (the host's index where "
                                 "each host runs one process), whose last failure to look into.")
_LINE_PARSERS["pm"].add_argument("expression", nargs="+", help="What to evaluate there, as Python.")


def _arguments(flags: tuple[tuple[tuple, dict], ...]) -> Callable[[Any], Any]:
    """``flags`` as a magic's ``@argument`` lines, in their order."""
    def add(func: Any) -> Any:
        for names, options in reversed(flags):
            func = argument(*names, **options)(func)
        return func
    return add


def _backend_flags(func: Any) -> Any:
    """Add every registered backend's flags to a magic, grouped under the backend's name in its help."""
    shared = backend_options.shared_flags()
    added: set[str] = set()
    groups = []
    for backend in backend_options.backends():  # a flag several backends take: once, in the first one's group
        own = [flag for flag in backend.flags if flag.flag not in added]
        added.update(flag.flag for flag in own)
        groups.append((backend, own))
    for backend, own in reversed(groups):
        for flag in reversed(own):
            also = [name for name in shared.get(flag.flag, ()) if name != backend.name]
            suffix = f" (also -b {', -b '.join(also)})" if also else ""
            func = argument(flag.flag, **flag.argparse_options(suffix))(func)
        if own:
            func = argument_group(f"-b {backend.name}")(func)
    return func


def _setting_trait(backend: str, flag: Any) -> Any:
    """A ``%config KineticMagics.<option>`` trait for a backend's setting: unset (None) unless configured."""
    trait = Float if flag.type is float else Unicode
    return trait(None, allow_none=True, help=f"For -b {backend}, the notebook's default for {flag.flag} (the flag "
                                             f"and its environment variable come first): {flag.help}").tag(config=True)


#: The backends' ``%config`` settings, declared by each backend (``BackendFlag.setting``), not named here.
_BackendSettings = type("_BackendSettings", (Magics,), {
    flag.option: _setting_trait(backend, flag) for backend, flag in backend_options.settings()})


@magics_class
class KineticMagics(_BackendSettings):
    #: The session this notebook's cells run on (``%kinetic start``), or None.
    session: Session | None = None
    #: ``%kinetic profile``: the session's next cell runs under its framework's profiler.
    profile_next: bool = False
    #: The last cell this notebook ran, one-shot or a session's: what ``%kinetic logs``, ``stacks`` and ``cancel``
    #: take without a job id.
    last_cell: CellHandle | None = None
    #: ``%config KineticMagics.backend = "ssh"``: where a cell with no ``-b`` runs (before ``$KINETIC_BACKEND``).
    backend = Unicode(None, allow_none=True, help="The backend a cell or session runs on when -b does not say "
                                                  "(then $KINETIC_BACKEND, then local).").tag(config=True)

    def _backend_options(self, args: Any, backend: str | None = None) -> dict[str, Any]:
        """The chosen backend's options (``backend``'s, else ``-b``'s) from its flags, with this notebook's
        ``%config`` settings as defaults."""
        config = {flag.option: getattr(self, flag.option) for _, flag in backend_options.settings()}
        try:
            return backend_options.chosen_options(backend or args.backend, vars(args), config)
        except ValueError as error:
            raise UsageError(str(error)) from None

    @magic_arguments(name="%kinetic")  # its usage reads %%kinetic, as it is typed (not %kinetic_cell)
    @_arguments(SLICE_FLAGS)
    @argument("--framework", default="auto", choices=["auto", "jax", "torch", "none"],
              help="What to initialize before the cell; auto decides by the cell's imports.")
    @argument("-o", "--out", action="append", default=[], metavar="NAME[,NAME]",
              help="Copy these leader variables into the notebook.")
    @argument("--timeout", type=float, default=None, metavar="S", help="Stop the job after S seconds.")
    @argument("--grace", type=float, default=None, metavar="S",
              help="After a host fails, the others get S seconds (default 10) to report before they are stopped.")
    @argument("--storage", default=None, metavar="URI", help="Where the job's objects live (file://...).")
    @argument("--detach", action="store_true",
              help="Return a CellHandle at once, with its live panel; an interrupt never cancels it.")
    @argument("--keep", action="store_true", help="Keep all of the job's objects after a success.")
    @argument("--quiet", action="store_true",
              help="No panel and no kinetic notices; the leader's output and the outcome still show.")
    @argument("--profile", action="store_true",
              help="Run the cell under its framework's profiler (JAX's, torch's) on every host, and merge the hosts' "
                   "traces into one, aligned on the cell's barrier.")
    @argument("--profile-dir", default=None, metavar="DIR",
              help="Where the merged trace of --profile (or %%kinetic profile) is saved (default: the notebook's folder).")
    @argument("--once", action="store_true",
              help="Run a one-shot job beside the session this notebook is on (%%kinetic start), on purpose.")
    @_backend_flags
    @cell_magic("kinetic")
    def kinetic_cell(self, line: str, cell: str) -> Any:
        """Run this cell on every host of a (local or simulated) multi-host slice.

        Every host runs the same cell (SPMD) with jax.distributed or
        torch.distributed initialized across them. The leader's (host 0) last
        expression becomes the cell's value (a trailing ``;`` hides it); a
        failure on any host raises that host's own exception with its traceback.

        The hosts run plain Python: no ``!`` or ``%`` lines. The leader's
        stdout and stderr, ``display(...)`` calls and matplotlib figures show
        in the cell as they would in any cell. ``sys.exit(0)`` ends a host
        successfully; any other ``sys.exit(n)`` fails it (``HostExitError``).

        Examples
        --------
        ::

            %%kinetic -n 4
            import jax
            jax.process_count()

            %%kinetic -a tpu-v5e-16 -o losses
            ...
        """
        args = parse_argstring(self.kinetic_cell, line)
        # The magic line stays, as a comment, so line numbers in syntax errors
        # and tracebacks are the ones the user sees in the cell; -e values never
        # travel, and this frame's own `line` (which %xmode Verbose prints) no longer holds them.
        line = without_env_values(line, self.kinetic_cell.parser)
        try:
            check_shape(hosts=args.hosts, timeout=args.timeout, grace=args.grace, procs_per_host=args.procs_per_host,
                        flags=True)
        except ValueError as error:
            raise UsageError(str(error)) from None
        out = _names(args.out)
        source = f"# %%kinetic {line}\n{cell}"
        if self.session is not None and not args.once:
            # A session cell's backend flags are checked as they were given (-b, else local's: none).
            check_cell_fits_session(self.session, args, self._backend_options(args, args.backend or "local"),
                                    _environment(args.env))
            try:
                handle = self.session.run(source, out=out, namespace=self.shell.user_ns, timeout=args.timeout,
                                          cell_name=f"kinetic In[{self._cell_number()}]",
                                          profile=args.profile or self.profile_next)
                handle.profile_dir = args.profile_dir
                self.profile_next = False
            except (CaptureError, SessionEndedError, ValueError) as error:
                raise UsageError(str(error)) from None
            return self._wait_and_show(handle, out, quiet=args.quiet)
        args.backend = choose_backend_name(args.backend, self.backend)
        try:
            handle = submit(
                source,
                hosts=args.hosts,
                accelerator=args.accelerator,
                backend=args.backend,
                framework=args.framework,
                namespace=self.shell.user_ns,
                out=out,
                env=_environment(args.env),
                timeout=args.timeout,
                storage=args.storage,
                cell_name=f"kinetic In[{self._cell_number()}]",
                echo=True,
                quiet=args.quiet,
                grace=args.grace,
                detach=args.detach and not args.quiet,
                keep=args.keep,
                backend_options=self._backend_options(args),
                procs_per_host=args.procs_per_host,
                profile=args.profile,
            )
        except (CaptureError, UnknownAcceleratorError, ValueError) as error:
            raise UsageError(str(error)) from None
        handle.profile_dir = args.profile_dir
        if args.detach:
            handle.group.detached = True
            self.last_cell = handle
            return handle
        return self._wait_and_show(handle, out, quiet=args.quiet)

    def _wait_and_show(self, handle: CellHandle, out: list[str], *, quiet: bool = False) -> Any:
        """Wait with a live view; its final update lands before the cell returns, so a saved notebook keeps it."""
        self.last_cell = handle
        if handle.one_shot:  # a session's cell is interrupted on its hosts, never cancelled
            handle.group.shutting_down = lambda: bool(getattr(self.shell, "exit_now", False))  # set by a shutdown request
        # A session's cell keeps a one-line panel once it succeeded: its output and value say the rest.
        view = None if quiet else live_view(handle.plan.world_size, brief=not handle.one_shot,
                                            procs_per_host=handle.plan.procs_per_host)
        try:
            value = handle.result(on_snapshot=view.update if view else None)
        finally:
            if view is not None:  # the outcome, and each host as it ended or as being stopped
                final = handle.final or handle.snapshot()
                view.close(final)
                view.settle(final, handle.settled)  # each host as it ended, once those being stopped have
            if handle.profiled:
                self._say_profile(handle)
        # Names the cell did not bind when it ran were warned about; others were never asked for.
        missing = [name for name in out if name not in handle.outputs and name not in handle.missing_outputs]
        if missing:
            raise UsageError(f"job {handle.job_id} did not bring back {', '.join(missing)}: "
                             f"it was submitted with -o {','.join(handle.outputs) or '(nothing)'}")
        self.shell.user_ns.update({name: handle.outputs[name] for name in out if name in handle.outputs}
                                  if out else handle.outputs)
        return value

    @staticmethod
    def _say_profile(handle: CellHandle) -> None:
        """Where the merged profile is, after the cell's outcome (a failed cell's too); a profile that cannot be
        merged is one line, never in place of the cell's own outcome."""
        try:
            notice = handle.profile().notice(handle.poller.plan.name_of)
        except Exception as error:  # noqa: BLE001 - the cell's outcome comes first
            print(f"kinetic_nb: the cell's profile could not be merged: {type(error).__name__}: {error}",
                  file=sys.stderr, flush=True)
            return
        display(notice, raw=True)  # news, not an error: a link to the trace, which JupyterLab opens

    def _cell_number(self) -> int:
        """This cell's ``In[n]``: IPython stores the input before running it (and
        versions differ on when they bump ``execution_count``)."""
        history = getattr(self.shell, "history_manager", None)
        if history is not None and len(history.input_hist_parsed) > 1:
            return len(history.input_hist_parsed) - 1
        return self.shell.execution_count

    @line_magic("kinetic")
    def kinetic_line(self, line: str) -> Any:
        """Manage kinetic jobs from any kernel.

        ::

            %kinetic start [-n N] [-a NAME] ...      keep a slice up: every %%kinetic cell runs on it
                           [--idle-timeout S]        (its hosts, framework and variables stay warm)
            %kinetic stop / restart                  stop this notebook's session / start it afresh
            %kinetic profile                         profile the session's next cell on every host
            %kinetic pm RANK [--cell] EXPR           evaluate EXPR where process RANK's last session cell failed
                                                     (as %debug would; its frame is kept until the next cell)
            %kinetic sessions                        this user's sessions, from any kernel
            %kinetic jobs [-n LIMIT]                 recent jobs and their state
            %kinetic attach JOB_ID [-o NAME[,NAME]]  wait for a job again (also after a restart);
                                                     with a session id (ks-...), bind this notebook to it
            %kinetic cancel [JOB_ID]                 stop every host of a job (no JOB_ID: as logs)
            %kinetic logs [JOB_ID] [--host RANK]     one process's output, by rank (0 = leader; a host's
                                                     index where each host runs one process); no
                                                     JOB_ID: this notebook's last cell, a session's too
            %kinetic stacks [JOB_ID] [--host RANK]   every running process's Python stacks (a hang's where)
            %kinetic gc --older-than 7d              remove old jobs that have ended; prune the kinetic_nb
                                                     cache of the ssh / TPU VM hosts they ran on
            %kinetic doctor [-b B] [-a NAME]         are the hosts ready (-b kubernetes: the cluster; -b ssh
                                                     / tpu-vm: reached, their Python, host 0's port, free
                                                     chips), and the storage? each failure with the command
                                                     that fixes it
            %kinetic accelerators                    every -a name: hosts x chips, topology, machine type,
                                                     and keras-kinetic's spelling of the same slice

        Each also takes ``--storage URI``.
        """
        if line.split(None, 1)[:1] == ["pm"]:  # the expression is Python, taken as written (quotes and all)
            return self._line_pm(line.split(None, 1)[1] if len(line.split(None, 1)) > 1 else "")
        words = shlex.split(line)
        if not words or words[0] not in _LINE_PARSERS:
            given = f" {words[0]!r}" if words else ""
            raise UsageError(f"%kinetic expects a subcommand{given and ', not' + given}: {', '.join(SUBCOMMANDS)}")
        command, rest = words[0], words[1:]
        args = _LINE_PARSERS[command].parse_argstring(shlex.join(rest))
        line = f"{command} {without_env_values(shlex.join(rest), _LINE_PARSERS[command])}"  # what Verbose may print
        del words, rest
        try:
            return getattr(self, f"_line_{command}")(args)
        except (ObjectNotFoundError, IntegrityError) as error:
            raise UsageError(str(error)) from None
        except ValueError as error:
            raise UsageError(str(error)) from None

    def _line_start(self, args: Any) -> Any:
        if self.session is not None and self.session.ended() is None:
            raise UsageError(f"this notebook is on session {self.session.session_id} already: %kinetic stop first")
        args.backend = choose_backend_name(args.backend, self.backend)
        self.session = start_session(args, self._backend_options(args), _environment(args.env))
        return self.session

    def _line_stop(self, args: Any) -> None:
        if self.session is None:
            raise UsageError("this notebook is on no session (%kinetic start starts one)")
        # Back where it was before %kinetic start: the next %%kinetic cell is a one-shot cell. (A session that
        # ended on its own stays this notebook's, and its next cell says so: no one loses state unknowingly.)
        print(self.session.stop())
        self.session = None

    def _line_restart(self, args: Any) -> Any:
        if self.session is None:
            raise UsageError("this notebook is on no session (%kinetic start starts one)")
        session = self.session
        self.session = with_start_panel(session.plan.world_size, session.plan.procs_per_host,
                                        lambda show: session.restart(on_snapshot=show))
        return self.session

    def _line_pm(self, rest: str) -> None:
        """``%kinetic pm HOST [--cell] EXPRESSION``: the expression is the rest of the line, as written."""
        # --cell before HOST or, as the help writes it, after it.
        match = re.fullmatch(r"\s*(?P<cell>--cell\s+)?(?P<host>\S+)(?:\s+(?P<cell_after>--cell)(?=\s))?\s*"
                             r"(?P<expression>.*)", rest, re.DOTALL)
        host = match["host"] if match else ""
        if not host.isdigit() or not match["expression"].strip():
            raise UsageError("%kinetic pm expects a host and an expression, e.g. %kinetic pm 1 batch.shape"
                             + (f", not {rest.strip()!r}" if rest.strip() else ""))
        if self.session is None:
            raise UsageError("%kinetic pm looks into a session's failed cell: this notebook is on no session "
                             "(%kinetic start starts one)")
        try:
            answer = self.session.post_mortem(int(host), match["expression"].strip(),
                                              frame="cell" if match["cell"] or match["cell_after"] else "raised")
        except (PostMortemError, ValueError) as error:
            raise UsageError(str(error)) from None
        # A remote repr is the host's text: its lines are kept, a control character in them (an escape that
        # clears the screen, a carriage return that hides what came before) is shown as the jobs listing shows it.
        print("\n".join(printable(line) for line in answer.split("\n")))

    def _line_profile(self, args: Any) -> None:
        if self.session is None:
            raise UsageError("%kinetic profile profiles a session's next cell: this notebook is on no session "
                             "(a one-shot cell takes %%kinetic --profile)")
        self.profile_next = True
        print(f"the next cell on session {self.session.session_id} runs under its framework's profiler on every host")

    def _line_sessions(self, args: Any) -> None:
        found = sessions.sessions(storage=args.storage, limit=args.limit)
        if not found:
            print("no kinetic sessions yet")
            return
        print(f"{'session':<26}  {'hosts':>5}  {'accelerator':<12}  {'cells':>5}  state")
        for record in found:
            print(printable(f"{record['session_id']:<26}  {record['hosts']:>5}  {record['accelerator']:<12}  "
                            f"{record['cells']:>5}  {record['state']}"))

    def _line_jobs(self, args: Any) -> None:
        records = catalog.jobs(storage=args.storage, limit=args.limit)
        if not records:
            print("no kinetic jobs yet")
            return
        print(f"{'job':<26}  {'cell':<9}  {'submitted':<19}  {'hosts':>5}  {'accelerator':<12}  state")
        for record in records:  # each field checked by jobs(); no control character can start a row of its own
            when = (datetime.datetime.fromtimestamp(record.submitted_at).strftime("%Y-%m-%d %H:%M:%S")
                    if record.submitted_at else "-")
            print(printable(f"{record.job_id:<26}  {record.cell or '-':<9}  {when:<19}  {record.hosts:>5}  "
                            f"{record.accelerator:<12}  "
                            f"{record.status}"))

    def _line_attach(self, args: Any) -> Any:
        if args.job_id.startswith("ks-"):  # a session: this notebook's cells run on it from now on
            self.session = attach_session(args.job_id, storage=args.storage)
            return self.session
        handle = catalog.attach(args.job_id, storage=args.storage, echo=True, key_file=args.key_file,
                                trust_unsigned=args.trust_unsigned)
        return self._wait_and_show(handle, _names(args.out))

    def _line_cancel(self, args: Any) -> None:
        handle = self._named_or_last(args, "cancel")
        handle.cancel()  # a session's cell is interrupted, its session stays up
        print(f"{cell_words(handle.job_id, handle.cell_name)}: {handle.status()}")

    def _line_stacks(self, args: Any) -> None:
        handle = self._named_or_last(args, "stacks")
        stacks = handle.stacks(args.host)
        if not stacks:
            print(f"{handle.name}: no host is running")
        for index, text in stacks.items():
            print(f"--- rank {index} ---\n{readable_stacks(text).rstrip()}\n")

    def _line_logs(self, args: Any) -> None:
        print(self._named_or_last(args, "logs").logs(args.host), end="")

    def _named_or_last(self, args: Any, command: str) -> CellHandle:
        """The job ``args.job_id`` names, or without one this notebook's last cell (``UsageError`` when none ran)."""
        if args.job_id is not None:
            return catalog.attach(args.job_id, storage=args.storage)
        if self.last_cell is None:
            raise UsageError(f"no %%kinetic cell has run in this notebook yet: %kinetic {command} JOB_ID "
                             "(%kinetic jobs lists them)")
        return self.last_cell

    def _line_accelerators(self, args: Any) -> None:
        print(accelerator_table())

    def _line_doctor(self, args: Any) -> None:
        report = backend_options.doctor(args.backend, args.accelerator, args.storage, self._backend_options(args))
        print(report.table())

    def _line_gc(self, args: Any) -> None:
        report = catalog.gc_report(args.older_than, storage=args.storage)
        removed = report.removed
        jobs = [job_id for job_id, _ in removed if not job_id.startswith("ks-")]
        ended = len(removed) - len(jobs)
        freed = sum(size for _, size in removed)
        print(f"removed {len(jobs)} job{'s' if len(jobs) != 1 else ''} and {ended} "
              f"session{'s' if ended != 1 else ''}, {freed / 1e6:.1f} MB"
              + (": " + ", ".join(job_id for job_id, _ in removed) if removed else ""))
        for line in report.hosts:  # the ssh and TPU VM hosts' caches, each pruned or skipped
            print(line)


for _magic in vars(KineticMagics).values():
    if hasattr(_magic, "parser"):  # each @magic_arguments() parser: IPython builds it, this refuses abbreviations
        refuse_abbreviations(_magic.parser)


def show_kinetic_error(shell: Any, etype: type, value: BaseException, tb: Any, tb_offset: int | None = None
                       ) -> list[str]:
    """Show a ``KineticError`` as its message alone; ``%tb`` shows kinetic_nb's own traceback.

    A host's exception re-raised as a ``KineticError`` (``HostExitError``)
    shows the host's traceback, as every host exception does.
    """
    sys.last_type, sys.last_value, sys.last_traceback = etype, value, tb  # what %tb shows
    if hasattr(value, "_render_traceback_"):
        lines = value._render_traceback_()
    elif isinstance(value, StorageError):  # what could not be done, in words: never an object's name
        lines = [f"{etype.__name__}: {protocol.storage_error_words(value)}", *getattr(value, "__notes__", ())]
    else:
        lines = [f"{etype.__name__}: {value}", *getattr(value, "__notes__", ())]
    shell._showtraceback(etype, value, lines)
    return lines


def show_kinetic_errors_briefly(shell: Any) -> None:
    """Have ``shell`` show kinetic_nb's errors in one line, unless it already has a custom exception handler."""
    if not shell.custom_exceptions:
        shell.set_custom_exc((KineticError,), show_kinetic_error)
