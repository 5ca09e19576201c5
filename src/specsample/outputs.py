"""Where a command writes its results, checked before it spends its time.

A benchmark or a training run that finds only at its end that it cannot write
its results loses them; `check_output_dir` and `check_output_file` refuse such
a place first, with the option's name: an empty path (which Path reads as the
current directory), a file where a directory is meant or the reverse, a path
under a file, or a directory this process cannot write to.
"""

from __future__ import annotations

import os
from pathlib import Path


def check_output_dir(path: str | Path, option: str) -> Path:
    """`path` as the directory `option` names: it is one, or it can be made where its nearest existing
    ancestor is a writable directory."""
    path = checked_path(path, option)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{option} {path} is a file, not a directory for the results")
    check_writable_ancestor(path, path, option)
    return path


def check_output_file(path: str | Path, option: str) -> Path:
    """`path` as the file `option` names: not a directory, and under a writable directory (made at the
    end where it does not exist yet)."""
    path = checked_path(path, option)
    if path.is_dir():
        raise ValueError(f"{option} {path} is a directory, not a file for the results")
    check_writable_ancestor(path, path.parent, option)
    return path


def checked_path(path: str | Path, option: str) -> Path:
    if not str(path).strip():
        raise ValueError(f"{option} is empty: name a path (an empty one is not taken as the current directory)")
    return Path(path).expanduser()


def check_writable_ancestor(path: Path, directory: Path, option: str) -> None:
    """The nearest existing one of `directory` (where `path` goes) and its ancestors must be a directory this
    process can write in."""
    existing = next(p for p in (directory, *directory.parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"{option} {path}: {existing} is a file, so nothing can be written under it")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{option} {path}: the directory {existing} is not writable")


def write_text(path: Path, text: str) -> None:
    """Write `text` to `path` (checked by `check_output_file`), making its directory where it is missing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
