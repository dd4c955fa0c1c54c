"""Checks on the file options of the `kvplane` commands, made before any work starts."""

from __future__ import annotations

from pathlib import Path

import typer


def writable_file(value: Path | None) -> Path | None:
    """An output file's option: its folder must exist and it must not be a folder itself, so
    a long run does not end by failing to write what it computed (`-`, stdout, passes)."""
    if value is None or str(value) == "-":
        return value
    if value.is_dir():
        raise typer.BadParameter(f"{value} is a folder; give a file name")
    folder = value.parent
    if not folder.is_dir():
        raise typer.BadParameter(f"the folder {folder} does not exist")
    return value
