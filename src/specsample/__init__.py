"""specsample: lossless speculative sampling for language models.

The public names load on first use (PEP 562), so that `import specsample.cli` is light: a command
line interrupted while torch loads exits with 130, not a traceback, and `--help` answers at once.
"""

import os
from importlib import import_module

from specsample.openmp import busy_cores, choose_wait_policy

if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:  # before torch loads
    os.environ.update(choose_wait_policy(os.environ, busy_cores(), os.cpu_count() or 1))

EXPORTS = {
    "Chunk": "specsample.api", "Completion": "specsample.api", "Generation": "specsample.api",
    "Interrupted": "specsample.api", "SpecSampler": "specsample.api", "SamplingParams": "specsample.sampling",
    "Stats": "specsample.stats",
}
__all__ = sorted(EXPORTS)


def __getattr__(name: str) -> object:
    if name in EXPORTS:
        return getattr(import_module(EXPORTS[name]), name)
    raise AttributeError(f"module 'specsample' has no attribute {name!r}")
