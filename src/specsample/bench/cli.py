"""`specsample bench`: benchmark commands (a thin layer over the bench modules)."""

from __future__ import annotations

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, rich_markup_mode=None)
