"""The see-room commands (kvplane/cli_see.py), registered on a Typer app as kvplane/cli.py
will: `import vllm-bench`, `import trace`, `twin`, `dashboard --help`."""

from __future__ import annotations

import shutil

import pytest
import typer
from see_store import DATA
from typer.testing import CliRunner

from kvplane.cli_see import register
from kvplane.store import open_store

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def cli() -> typer.Typer:
    app = typer.Typer()

    @app.command()
    def version() -> None:  # a second command, so typer keeps the sub-command names
        typer.echo("0")

    register(app)
    return app


def run(app: typer.Typer, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.output


def test_import_then_twin(cli, tmp_path):
    db = f"sqlite:///{tmp_path / 'cli.db'}"
    code, out = run(cli, "import", "vllm-bench", str(DATA / "vllm_bench"), "--db", db,
                    "--scenario", "seed_push_vs_pull")
    assert code == 0, out
    assert "imported 8 points" in out and "push_qps4_in4096_out128_iter0" in out
    with open_store(db) as store:
        point = next(r.id for r in store.runs("import")
                     if r.scenario.endswith("pull_qps1_in1024_out128_iter0"))
    code, out = run(cli, "twin", point, "--db", db)
    assert code == 0, out
    assert f"of {point}: 16 requests, mean TTFT" in out
    code, out = run(cli, "twin", "latest", "--db", db, "--mode", "push")
    assert code == 0, out
    with open_store(db) as store:
        twins = store.runs("replay")
        assert len(twins) == 2
        modes = {e.mode for e in store.events(twins[-1].id, "RequestRouted")}  # type: ignore[attr-defined]
    assert modes == {"push"}


def test_errors_exit_2_and_say_what_is_wrong(cli, tmp_path):
    db = f"sqlite:///{tmp_path / 'cli.db'}"
    bad = tmp_path / "bench"
    shutil.copytree(DATA / "vllm_bench", bad)
    (bad / "push_qps1_in1024_out128_iter0.json").write_text("{")
    code, out = run(cli, "import", "vllm-bench", str(bad), "--db", db)
    assert code == 2 and "push_qps1_in1024_out128_iter0.json: not JSON" in out
    assert "nothing imported" in out
    code, out = run(cli, "twin", "nope", "--db", db)
    assert code == 2 and "nope" in out
    code, out = run(cli, "twin", "latest", "--db", db)
    assert code == 2 and "no run with requests" in out
    code, out = run(cli, "twin", "latest", "--db", db, "--mode", "sideways")
    assert code == 2 and "--mode" in out


def test_import_trace_writes_a_scenario(cli, tmp_path):
    trace = tmp_path / "t.jsonl"
    shutil.copyfile(DATA / "mooncake_trace.jsonl", trace)
    db = f"sqlite:///{tmp_path / 'cli.db'}"
    code, out = run(cli, "import", "trace", str(trace), "--format", "mooncake", "--record",
                    "--db", db)
    assert code == 0, out
    assert "12 requests; scenario written to" in out and "arrivals stored as run" in out
    assert (tmp_path / "t.scenario.yaml").is_file()
    code, out = run(cli, "import", "trace", str(trace), "--format", "sharegpt")
    assert code == 2 and "mooncake" in out


def test_dashboard_help(cli):
    code, out = run(cli, "dashboard", "--help")
    assert code == 0 and "--port" in out and "--db" in out
