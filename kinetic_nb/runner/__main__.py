"""``python -m kinetic_nb.runner --job URI``: run this host's part of a job."""

from __future__ import annotations

import argparse
import os
import sys

from kinetic_nb.runner.execute import run_host


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kinetic_nb.runner", description=__doc__)
    parser.add_argument("--job", required=True, help="the job's storage URI (file://... or gs://...)")
    args = parser.parse_args(argv)
    return run_host(args.job)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter shutdown: after a failure, JAX's atexit hook would wait
    # in its shutdown barrier for peers that will never arrive.
    os._exit(code)
