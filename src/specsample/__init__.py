"""specsample: lossless speculative sampling for language models."""

import os

from specsample.openmp import busy_cores, choose_wait_policy

if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ.update(choose_wait_policy(os.environ, busy_cores(), os.cpu_count() or 1))

from specsample.api import Chunk, Completion, Generation, Interrupted, SpecSampler  # noqa: E402
from specsample.sampling import SamplingParams  # noqa: E402
from specsample.stats import Stats  # noqa: E402

__all__ = ["Chunk", "Completion", "Generation", "Interrupted", "SamplingParams", "SpecSampler", "Stats"]
