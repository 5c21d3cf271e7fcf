"""``%%kinetic``: parse, submit, wait, return. Everything else is ``kinetic_nb.client``."""

from __future__ import annotations

import keyword
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from kinetic_nb.client import submit
from kinetic_nb.errors import CaptureError, UnknownAcceleratorError
from kinetic_nb.panel import live_view


def _names(values: list[str]) -> list[str]:
    names = [name.strip() for value in values for name in value.split(",") if name.strip()]
    for name in names:
        if not name.isidentifier() or keyword.iskeyword(name):
            raise UsageError(f"-o/--out expects variable names, got {name!r}")
    return names


def _environment(values: list[str]) -> dict[str, str]:
    env = {}
    for value in values:
        key, sep, setting = value.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"-e/--env expects KEY=VALUE, got {value!r}")
        env[key.strip()] = setting
    return env


@magics_class
class KineticMagics(Magics):
    @magic_arguments()
    @argument("-n", "--hosts", type=int, default=None, help="Number of hosts (default: the accelerator's, or 1).")
    @argument("-a", "--accelerator", default=None,
              help="Accelerator name, e.g. tpu-v5e-16 or gpu-h100x8 (simulated on CPU locally).")
    @argument("-b", "--backend", default="local", choices=["local"], help="Where the hosts run.")
    @argument("--framework", default="auto", choices=["auto", "jax", "torch", "none"],
              help="What to initialize before the cell; auto decides by the cell's imports.")
    @argument("-o", "--out", action="append", default=[], metavar="NAME[,NAME]",
              help="Copy these leader variables into the notebook.")
    @argument("-e", "--env", action="append", default=[], metavar="KEY=VALUE",
              help="Set an environment variable on every host (repeatable).")
    @argument("--timeout", type=float, default=None, metavar="S", help="Stop the job after S seconds.")
    @argument("--storage", default=None, metavar="URI", help="Where the job's objects live (file://...).")
    @argument("--quiet", action="store_true",
              help="No panel and no kinetic notices; the leader's output and the outcome still show.")
    @cell_magic
    def kinetic(self, line: str, cell: str) -> Any:
        """Run this cell on every host of a (local or simulated) multi-host slice.

        Every host runs the same cell (SPMD) with jax.distributed or
        torch.distributed initialized across them. The leader's (host 0) last
        expression becomes the cell's value; a failure on any host raises
        that host's own exception with its traceback.

        Examples
        --------
        ::

            %%kinetic -n 4
            import jax
            jax.process_count()

            %%kinetic -a tpu-v5e-16 -o losses
            ...
        """
        args = parse_argstring(self.kinetic, line)
        if args.timeout is not None and args.timeout <= 0:
            raise UsageError(f"--timeout must be positive, got {args.timeout:g}")
        if args.hosts is not None and args.hosts < 1:
            raise UsageError(f"-n/--hosts must be at least 1, got {args.hosts}")
        out = _names(args.out)
        # The magic line stays, as a comment, so line numbers in syntax errors
        # and tracebacks are the ones the user sees in the cell.
        source = f"# %%kinetic {line}\n{cell}"
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
            )
        except (CaptureError, UnknownAcceleratorError, ValueError) as error:
            raise UsageError(str(error)) from None
        view = None if args.quiet else live_view(handle.plan.hosts)
        try:
            handle.wait(on_snapshot=view.update if view else None)
        finally:
            if view is not None:
                view.close(handle.snapshot())  # before the cell returns, so a saved notebook keeps it
        value = handle.result()
        self.shell.user_ns.update(handle.outputs)
        return value

    def _cell_number(self) -> int:
        """This cell's ``In[n]``: IPython stores the input before running it (and
        versions differ on when they bump ``execution_count``)."""
        history = getattr(self.shell, "history_manager", None)
        if history is not None and len(history.input_hist_parsed) > 1:
            return len(history.input_hist_parsed) - 1
        return self.shell.execution_count
