"""Pyflakes' checks (through ruff) over the code: an undefined name is a crash waiting on the line that
reaches it (`bench run --llamacpp-baselines` on the project's own backends called a function it no longer
imported, and no test took that path). F811 is left out: pytest fixtures imported from another test
module read as redefined by the tests that take them."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_pyflakes_finds_nothing():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is a test dependency (pip install -e '.[test]')"
    result = subprocess.run([ruff, "check", "--no-cache", "--select", "F", "--ignore", "F811", "src", "tests", "benchmarks"],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
