"""Every `kvplane` command's --help shows its own and each option's help text whole: Typer
renders help through Rich markup, which silently drops a bracketed word it takes for a style
tag (`pip install 'kvplane[ray]'` printed as `pip install 'kvplane'`). And a value no run can
use is refused before any work, naming the option."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from kvplane.cli import app


def commands(cmd: Any, path: list[str]) -> Iterator[tuple[list[str], Any]]:
    yield path, cmd
    for name, sub in getattr(cmd, "commands", {}).items():
        yield from commands(sub, [*path, name])


def words(text: str) -> str:
    """The text's characters other than space and Rich's box drawing, markup escapes undone."""
    return re.sub(r"[\s│╭╮╰╯─]+", "", text.replace("\\[", "["))


def test_every_commands_and_options_help_is_printed_whole() -> None:
    runner = CliRunner()
    checked = 0
    for path, cmd in commands(typer.main.get_command(app), []):
        helps = [p.help for p in cmd.params if getattr(p, "help", None)]
        helps += [cmd.help] if cmd.help else []
        if not helps:
            continue
        got = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "4000"}, terminal_width=4000)
        assert got.exit_code == 0, (path, got.output)
        shown = words(got.output)
        for h in helps:
            assert words(h) in shown, f"kvplane {' '.join(path)} --help lost part of: {h!r}"
            checked += 1
    assert checked > 50  # the walk reached the subcommands' options


@pytest.mark.parametrize("args, option", [
    (["plan", "seed_push_vs_pull", "--qps", "-1"], "'--qps' / '--rate': must be more than 0"),
    (["plan", "seed_push_vs_pull", "--ttft-p90-ms", "0"], "'--ttft-p90-ms': must be more"),
    (["plan", "seed_push_vs_pull", "--input-len", "0"], "'--input-len'"),
    (["plan", "seed_push_vs_pull", "--max-instances", "1"], "'--max-instances'"),
    (["validate", "--seeds", "0"], "'--seeds'"),
    (["calibrate", "live", "A", "--seeds", "0"], "'--seeds'"),
    (["sim", "run", "seed_push_vs_pull", "--out", "/nonexistent/o.json"], "'--out'"),
    (["validate", "--out", "/nonexistent/v.md"], "'--out'"),
    (["plan", "seed_push_vs_pull", "--topology-out", "/"], "'--topology-out'"),
])
def test_an_impossible_value_is_refused_naming_the_option(args: list[str], option: str) -> None:
    """Refused before any work starts (no progress bar, no model error naming internal
    fields, no run that ends by failing to write its result), exit code 2, the option named
    as the user typed it."""
    got = CliRunner().invoke(app, args, env={"COLUMNS": "4000"}, terminal_width=4000)
    assert got.exit_code == 2, got.output
    assert option in got.output, got.output
    assert "planning" not in got.output and "validation error" not in got.output
