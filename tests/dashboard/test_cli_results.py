"""`kvplane runs`, `show`, `compare`, `export`, `--version`, `sim run --out`: on a store of real
simulated runs and the recorded live run, through the real `kvplane` app."""

from __future__ import annotations

import csv
import json
import math

import pytest
from see_store import copy_live_run
from typer.testing import CliRunner

from kvplane import __version__
from kvplane.cli import app

pytestmark = pytest.mark.timeout(300)


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.output


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("results") / "r.db"
    db = f"sqlite:///{path}"
    copy_live_run(db)
    out = path.parent / "summary.json"
    code, text = run("sim", "run", "seed_bidirectional", "--requests", "18", "--db", db,
                     "--out", str(out), "--jobs", "1")
    assert code == 0, text
    return db, json.loads(out.read_text())


def test_version():
    code, out = run("--version")
    assert code == 0 and out.strip() == f"kvplane {__version__}"


def test_sim_run_out_is_strict_json_with_null_for_no_samples(store):
    _, summary = store
    text = json.dumps(summary, allow_nan=False)  # raises on NaN
    off = next(p for p in summary["points"] if not p["bidirectional"])
    assert off["reuse_read_ms"]["mean"] is None  # reuse off reads nothing: null, not NaN
    assert off["rate_unit"] == "conversations/s"
    assert "NaN" not in text


def test_runs_is_a_table_with_short_ids_and_key_figures(store):
    db, summary = store
    code, out = run("runs", "--db", db)
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["ID", "KIND", "STARTED", "REQS"]
    assert "TTFT p50" in lines[0] and "TPOT p50" in lines[0]
    point = summary["points"][0]["run_id"]
    row = next(line for line in lines if line.startswith(point[:8]))
    assert point not in row  # the short id only
    assert "conv/s" in row and "qps" not in row  # a multi-turn rate says its unit
    assert row.split()[4] == "18"  # ID KIND DATE TIME REQS
    assert any(line.startswith("live-sam") for line in lines)


def test_show_accepts_a_prefix_and_refuses_an_ambiguous_one(store):
    db, summary = store
    point = summary["points"][1]["run_id"]
    code, out = run("show", point[:6], "--db", db, "--json")
    assert code == 0, out
    got = json.loads(out)
    assert got["id"] == point and got["requests"] == 18 and got["multi_turn"]
    assert got["rate_unit"] == "conversations/s"
    assert math.isclose(got["ttft_ms"]["p90"], summary["points"][1]["ttft_ms"]["p90"],
                        rel_tol=1e-6)
    code, out = run("show", "", "--db", db)
    assert code == 2 and "more than one run" in out
    code, out = run("show", "nosuchrun", "--db", db)
    assert code == 2 and "no run 'nosuchrun'" in out


def test_compare_says_what_differs(store):
    db, summary = store
    a = summary["points"][0]["run_id"]
    code, out = run("compare", a[:8], "live", "--db", db)
    assert code == 0, out
    assert "TTFT p90" in out and "what differs between the runs" in out
    assert "requests: 18 vs 6" in out


def test_export_csv_and_parquet(store, tmp_path):
    db, summary = store
    sweep = summary["run_id"]
    target = tmp_path / "sweep.csv"
    code, out = run("export", sweep[:8], "--db", db, "--out", str(target))
    assert code == 0, out
    with open(target, newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 36 and {r["run"] for r in rows} == {p["run_id"]
                                                              for p in summary["points"]}
    assert all(r["ttft"] and float(r["ttft"]) > 0 for r in rows)
    import pyarrow.parquet as pq  # the dashboard extra brings it
    target = tmp_path / "live.parquet"
    code, out = run("export", "live", "--db", db, "--format", "parquet", "--out", str(target))
    assert code == 0, out
    table = pq.read_table(target)
    assert table.num_rows == 6 and table.column("prompt_tokens").to_pylist()[0] == 200
    code, out = run("export", "live", "--db", db, "--format", "xlsx")
    assert code == 2 and "--format must be" in out


def test_twin_of_the_bundled_live_run_needs_no_arguments(tmp_path):
    """tests/data/live_run/live.db ships with the scenario it ran (meta.scenario)."""
    import shutil

    from see_store import DATA

    from kvplane.store import open_store

    path = tmp_path / "live.db"
    shutil.copyfile(DATA / "live_run" / "live.db", path)
    db = f"sqlite:///{path}"
    with open_store(db) as store:
        assert store.run("live-sample").meta["scenario"]["name"] == "live_sample_cpu"
    code, out = run("twin", "--db", db)  # `latest`: the newest run with requests
    assert code == 0, out
    assert "of live-sample: 6 requests" in out
    with open_store(db) as store:
        twin = store.runs("replay")[0]
        assert twin.parent == "live-sample"
        assert twin.meta["scenario"]["name"] == "live_sample_cpu"
    code, out = run("twin", "--db", db)  # again: the live run again, never the twin
    assert code == 0 and "of live-sample" in out


def test_plan_states_its_workload_runs_seeds_and_writes_a_deploy_topology(tmp_path):
    from kvplane.live.deploy import load_topology

    db = f"sqlite:///{tmp_path / 'plan.db'}"
    topo = tmp_path / "topo.yaml"
    code, out = run("plan", "seed_push_vs_pull", "--qps", "4", "--input-len", "4096",
                    "--requests", "20", "--seeds", "2", "--max-instances", "3",
                    "--ttft-p90-ms", "1500", "--tpot-p90-ms", "20", "--gpu-hour-price", "3.5",
                    "--jobs", "1", "--no-curve", "--db", db, "--topology-out", str(topo))
    assert code == 0, out
    assert ("for 4 requests/s, input 4096 tokens, output 128 tokens, 20 requests per run, "
            "seeds 20250101, 20250102") in out
    assert "+-" in out  # intervals over seeds
    row = next(line for line in out.splitlines() if "1P1D push" in line)
    assert row.split()[:2] == ["16", "56.00"]  # 16 GPUs x $3.5
    chosen = next(line for line in out.splitlines() if line.startswith("cheapest: "))
    label = chosen.removeprefix("cheapest: ").split(" on ")[0]
    t = load_topology(topo)  # what `kvplane deploy` reads
    roles = [i.role for i in t.instances]
    assert f"{roles.count('prefill')}P{roles.count('decode')}D" == label.split()[0]
    assert t.mode == label.split()[1] and all(i.tp == 8 for i in t.instances)
    code, out = run("deploy", str(topo))
    assert code == 0 and "KvplaneConnector" in out
    code, out = run("plan", "seed_push_vs_pull", "--qps", "4", "--ttft-p90-ms", "1",
                    "--tpot-p90-ms", "1", "--max-instances", "2", "--seeds", "1",
                    "--requests", "10", "--jobs", "1", "--no-record", "--json")
    assert code == 1  # nothing meets an impossible SLO
    got = json.loads(out)
    assert got["chosen"] is None and got["workload"]["input_len"] == 16384  # longest swept


def test_replay_takes_a_short_id(store):
    db, summary = store
    point = summary["points"][0]["run_id"]
    code, out = run("replay", point[:8], "--db", db)
    assert code == 0, out
    assert point in out and "no invariant violated" in out
    code, out = run("replay", "zz", "--db", db)
    assert code == 2 and "no run 'zz'" in out
