"""specsample: lossless speculative sampling for language models."""

import os

# OpenMP threads that spin while they wait (libgomp's default) lose their core to any other job: with
# one core of two busy, plain decoding on the bundled model fell from 27.8 to 1.4 tokens/s (Intel Xeon,
# AVX-512). Passive waiting is set here, before torch loads libgomp, so it holds for the command line,
# the server and a program that imports specsample before torch; a user's own OMP_WAIT_POLICY wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from specsample.api import Chunk, Completion, Generation, SpecSampler  # noqa: E402
from specsample.sampling import SamplingParams  # noqa: E402
from specsample.stats import Stats  # noqa: E402

__all__ = ["Chunk", "Completion", "Generation", "SamplingParams", "SpecSampler", "Stats"]
