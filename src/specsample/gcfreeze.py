"""Keep Python's full garbage collections out of the decode loop.

Importing torch and transformers and loading a model leave a few hundred thousand objects that
the cyclic garbage collector tracks, and a full (generation 2) collection walks every one of them:
150 to 190 ms on the bundled model (AMD EPYC, 2026-11-25), as long as a whole 64-token answer at
340 tokens/s. Plain decoding allocates little and rarely triggers one; a drafter that allocates (the
suffix tree adds a node per new substring) triggers one within the first answer, and README's
example then ran at 165 tokens/s with the default drafter against 338 with `--drafter none`.

`freeze_loaded` moves every object alive now into the permanent generation (`gc.freeze`), which
collections skip. `generate`, `serve`, `bench` and each Ray Serve replica call it once the model
is loaded; the library does not: an object frozen while alive and later left in an unreachable
cycle is never freed, so a process that loads many samplers one after another (a test suite)
decides for itself.
"""

from __future__ import annotations

import gc


def freeze_loaded() -> None:
    """Collect once, then exempt every object alive now from later collections."""
    gc.collect()
    gc.freeze()
