"""specsample: lossless speculative sampling for language models."""

import os

# How OpenMP threads wait between parallel regions decides the speed of a small model, whose pass is
# hundreds of short regions. Measured on the bundled model, `--backend gguf`, plain decoding, 2 threads
# (Intel Xeon VM, 2026-11-25), tokens/s quiet / with one core busy: OMP_WAIT_POLICY=PASSIVE 61 / 91
# (a sleeping thread takes long to wake on a VM); ACTIVE 212 / 39 (but idle threads spin forever, a
# server's cores included); libgomp's default (spin 300,000 rounds, then sleep) 211 / 9.6; spin
# 10,000,000 rounds, then sleep: 199 / 36. The last is set here, before torch loads libgomp: close to
# ACTIVE while decoding, asleep when idle. A user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT wins
# (PASSIVE on a machine whose cores other jobs keep busy).
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "10000000")

from specsample.api import Chunk, Completion, Generation, SpecSampler  # noqa: E402
from specsample.sampling import SamplingParams  # noqa: E402
from specsample.stats import Stats  # noqa: E402

__all__ = ["Chunk", "Completion", "Generation", "SamplingParams", "SpecSampler", "Stats"]
