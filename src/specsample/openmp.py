"""How OpenMP threads wait between parallel regions, chosen before torch loads libgomp.

It decides the speed of a small model, whose pass is hundreds of short parallel regions. Measured
on the bundled model, `--backend gguf`, plain decoding, 2 threads (Intel Xeon VM, 2026-11-25),
tokens/s on an idle machine / with one core busy / under a load average of 9-12:

- OMP_WAIT_POLICY=PASSIVE (sleep at once): 61 / 91 / 26-82; a sleeping thread takes long to wake on a VM;
- GOMP_SPINCOUNT=10000000 (spin, then sleep): 199 / 36 / 1.1-2.9; a thread spins at a barrier while
  the thread it waits for is off its core;
- libgomp's default (300,000 rounds): 211 / 9.6 / not measured.

No one setting is good on both kinds of machine, so the threads spin where the machine looks idle
when the process starts and sleep otherwise. This module imports nothing that loads libgomp.
"""

from __future__ import annotations

from collections.abc import Mapping

IDLE_LOAD_PER_CORE = 0.5  # a 1-minute load average below this per core counts as idle
SPIN = {"GOMP_SPINCOUNT": "10000000"}
SLEEP = {"OMP_WAIT_POLICY": "PASSIVE"}


def choose_wait_policy(environ: Mapping[str, str], load_average: float, cores: int) -> dict[str, str]:
    """The variables to set: none if the user set OMP_WAIT_POLICY or GOMP_SPINCOUNT (theirs wins);
    spinning under a load average below `IDLE_LOAD_PER_CORE` per core; sleeping above."""
    if "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        return {}
    return dict(SPIN if load_average < IDLE_LOAD_PER_CORE * cores else SLEEP)
