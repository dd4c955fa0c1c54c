"""The one `kvplane` command. Each sub-command imports its room lazily, so `--help` is fast."""

from __future__ import annotations

import typer

app = typer.Typer(
    help="kvplane: plan, run and see KV-cache movement in vLLM prefill/decode disaggregation.",
    no_args_is_help=True,
    add_completion=False,
)


def main() -> None:
    app()
