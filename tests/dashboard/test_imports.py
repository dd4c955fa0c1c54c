"""Importing `vllm bench serve` results and Mooncake traces (sim/imports.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from see_store import DATA

from kvplane.sim.config import ScenarioError, load_scenario
from kvplane.sim.imports import ImportProblem, import_trace, import_vllm_bench
from kvplane.sim.runner import run_scenario
from kvplane.store import open_store

BENCH = DATA / "vllm_bench"


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'imports.db'}"


def copy_bench(tmp_path: Path) -> Path:
    folder = tmp_path / "bench"
    shutil.copytree(BENCH, folder)
    return folder


def test_a_result_directory_becomes_one_sweep_of_runs(url):
    result = import_vllm_bench(url, BENCH, scenario="seed_push_vs_pull")
    with open_store(url) as store:
        parent = store.run(result["run_id"])
        assert parent.kind == "import" and parent.meta["compare_with"] == "seed_push_vs_pull"
        kids = [r for r in store.runs() if r.parent == parent.id]
        assert len(kids) == 8 and {r.kind for r in kids} == {"import"}
        point = next(r for r in kids if r.meta["point"] == "pull_qps4_in4096_out128_iter0")
        assert point.meta["mode"] == "pull" and point.meta["qps"] == 4.0
        assert point.meta["input_len"] == 4096 and point.meta["arrivals"] == "start_times"
        raw = json.loads((BENCH / "pull_qps4_in4096_out128_iter0.json").read_text())
        assert point.meta["summary"]["mean_ttft_ms"] == raw["mean_ttft_ms"]
        finished = list(store.events(point.id, "RequestFinished"))
        arrived = list(store.events(point.id, "RequestArrived"))
    assert len(arrived) == len(finished) == 16
    failed = [e for e in finished if not e.ok]  # type: ignore[attr-defined]
    assert [e.request for e in failed] == ["req-5"]
    ok = {e.request: e for e in finished if e.ok}  # type: ignore[attr-defined]
    assert ok["req-0"].ttft == pytest.approx(raw["ttfts"][0])  # type: ignore[attr-defined]
    assert ok["req-0"].e2e == pytest.approx(raw["latencies"][0])  # type: ignore[attr-defined]
    starts = raw["start_times"]
    assert arrived[0].at == 0.0 and {a.at for a in arrived} == {s - starts[0] for s in starts}


def test_a_summary_only_file_and_synthesized_arrivals(tmp_path, url):
    folder = tmp_path / "bench"
    folder.mkdir()
    (folder / "push_qps2_in1024_out128_iter0.json").write_text(json.dumps({
        "completed": 10, "request_rate": 2.0, "mean_ttft_ms": 120.0, "p99_ttft_ms": 180.0,
        "mean_tpot_ms": 6.0}))
    detailed = json.loads((BENCH / "push_qps1_in1024_out128_iter0.json").read_text())
    del detailed["start_times"]
    (folder / "push_qps1_in1024_out128_iter0.json").write_text(json.dumps(detailed))
    result = import_vllm_bench(url, folder)
    with open_store(url) as store:
        by_label = {store.run(p["run_id"]).meta["point"]: store.run(p["run_id"])
                    for p in result["points"]}
        summary_only = by_label["push_qps2_in1024_out128_iter0"]
        assert store.count(summary_only.id) == 0
        assert summary_only.meta["summary"]["p99_ttft_ms"] == 180.0
        spaced = by_label["push_qps1_in1024_out128_iter0"]
        assert spaced.meta["arrivals"].startswith("synthesized")
        times = [e.at for e in store.events(spaced.id, "RequestArrived")]
    assert times == [float(i) for i in range(16)]  # 1 QPS, evenly spaced


@pytest.mark.parametrize(("name", "content", "says"), [
    ("push_qps1_in1024_out128_iter0.json", "{not json", "not JSON"),
    ("push_qps1_in1024_out128_iter0.json", "[1, 2]", "JSON object"),
    ("fast_run.json", "{}", "file name is not"),
    ("push_qps1_in1024_out128_iter0.json", '{"completed": 3}', "not a vllm bench serve result"),
    ("push_qps1_in1024_out128_iter0.json",
     '{"ttfts": [0.1, 0.2], "latencies": [1.0], "input_lens": [1, 1], "output_lens": [2, 2]}',
     "latencies: 1 entries"),
    ("push_qps1_in1024_out128_iter0.json",
     '{"ttfts": [0.1], "latencies": [0.05], "input_lens": [1], "output_lens": [2]}',
     "0 < ttft <= latency"),
    ("push_qps1_in1024_out128_iter0.json",
     '{"ttfts": [0.1], "input_lens": [1], "output_lens": [2]}', "not latencies or e2els"),
    ("push_qps1_in1024_out128_iter0.json", '{"mean_ttft_ms": "fast"}', "mean_ttft_ms"),
])
def test_a_bad_file_is_named_and_nothing_is_imported(tmp_path, url, name, content, says):
    folder = copy_bench(tmp_path)
    (folder / name).write_text(content)
    with pytest.raises(ImportProblem) as err:
        import_vllm_bench(url, folder)
    assert name in str(err.value) and says in str(err.value)
    assert "nothing imported" in str(err.value)
    with open_store(url) as store:
        assert store.runs() == []


def test_every_bad_file_is_listed_at_once(tmp_path, url):
    folder = copy_bench(tmp_path)
    (folder / "push_qps9_in1_out1_iter0.json").write_text("{")
    (folder / "pull_qps9_in1_out1_iter0.json").write_text("[]")
    with pytest.raises(ImportProblem) as err:
        import_vllm_bench(url, folder)
    assert len(err.value.problems) == 2


def test_an_import_is_one_transaction(tmp_path, url, monkeypatch):
    """A failure while writing (here: the last file's events) leaves no run behind."""
    from kvplane.sim import imports

    real = imports.bulk_insert
    calls = []

    def failing(conn, run_id, first, rows):  # type: ignore[no-untyped-def]
        calls.append(run_id)
        if len(calls) == 8:
            raise RuntimeError("disk full")
        real(conn, run_id, first, rows)

    monkeypatch.setattr(imports, "bulk_insert", failing)
    with pytest.raises(RuntimeError, match="disk full"):
        import_vllm_bench(url, BENCH)
    with open_store(url) as store:
        assert store.runs() == []


def test_missing_or_empty_directory(tmp_path, url):
    with pytest.raises(ImportProblem, match="not a directory"):
        import_vllm_bench(url, tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ImportProblem, match=r"no \*\.json"):
        import_vllm_bench(url, tmp_path / "empty")
    with pytest.raises(ImportProblem, match="--scenario"):
        import_vllm_bench(url, BENCH, scenario="no_such_scenario")


def test_a_mooncake_trace_becomes_a_scenario_that_runs(tmp_path, url):
    trace = tmp_path / "trace.jsonl"
    shutil.copyfile(DATA / "mooncake_trace.jsonl", trace)
    result = import_trace(trace, db=url, record=True)
    path = Path(result["scenario"])
    assert path == tmp_path / "trace.scenario.yaml" and result["requests"] == 12
    sc = load_scenario(path)
    assert sc.workload.kind == "trace" and sc.requests == 12
    assert "path: trace.jsonl" in path.read_text()  # relative: the pair can move together
    summary = run_scenario(path, db=url, jobs=1, progress=False)
    assert summary["points"][0]["finished"] == 12
    with open_store(url) as store:
        run = store.run(result["run_id"])
        assert run.kind == "import" and store.count(run.id, "RequestArrived") == 12


def test_a_bad_trace_line_names_file_and_line(tmp_path):
    trace = tmp_path / "bad.jsonl"
    lines = (DATA / "mooncake_trace.jsonl").read_text().splitlines()
    lines[3] = lines[3].replace('"input_length": ', '"input_length": -')
    trace.write_text("\n".join(lines) + "\n")
    with pytest.raises(ScenarioError) as err:
        import_trace(trace)
    assert "bad.jsonl:4:" in str(err.value)
    assert "input_length" in str(err.value)
    assert not (tmp_path / "bad.scenario.yaml").exists()
    with pytest.raises(ScenarioError, match="mooncake"):
        import_trace(DATA / "mooncake_trace.jsonl", fmt="sharegpt")
