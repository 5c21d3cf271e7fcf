"""What measuring each host's memory at a cell's end adds to a warm session's trivial cell, against its round trip.

Every host of a session measures its memory once per cell, as its status
records the cell's end (``kinetic_nb.runner.memory.measure``: its resident
memory and peak, and its accelerator's where a framework reports it). The
hosts measure at once, each in its own process, so a cell waits for one
measurement at most. This prints, measured in the same run:

1. the median round trip of a trivial cell (``x = 1; x``) on a 4-host local
   session with no framework, and with JAX initialized (whose devices are then
   asked too: CPU devices report nothing);
2. the median cost of one measurement in a process like a host's (with JAX
   imported and its backends up, for the JAX row);
3. their ratio; goal <= 5% (issue 28).

    python benchmarks/memory_figures.py [--cells 41] [--calls 2000]
"""

from __future__ import annotations

import argparse
import statistics
import time

import kinetic_nb
from kinetic_nb.runner.memory import measure


def round_trip(framework: str, cells: int) -> float:
    session = kinetic_nb.start(hosts=4, framework=framework, echo=False)
    try:
        session.run("x = 1" + ("\nimport jax\nn = len(jax.devices())" if framework == "jax" else "")).result(timeout=300)
        times = []
        for _ in range(cells):
            started = time.perf_counter()
            session.run("x").result(timeout=60)
            times.append(time.perf_counter() - started)
        return statistics.median(times)
    finally:
        session.stop()


def measurement(calls: int) -> float:
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        measure()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cells", type=int, default=41, help="trivial cells timed per session (median)")
    parser.add_argument("--calls", type=int, default=2000, help="measurements timed (median)")
    args = parser.parse_args()
    print(f"{'4-host local session':>24}  {'cell ms':>8}  {'measure ms':>10}  {'ratio':>6}  (goal <= 5%)")
    for framework in ("none", "jax"):
        cell = round_trip(framework, args.cells)
        if framework == "jax":
            import jax

            jax.devices()  # as on a JAX host: its backends up, so its devices are asked
        cost = measurement(args.calls)
        print(f"{'framework ' + framework:>24}  {cell * 1e3:8.2f}  {cost * 1e3:10.4f}  {cost / cell:6.2%}")


if __name__ == "__main__":
    main()
