"""benchmarks/sim_peers.py builds valid kvplane scenarios for the peers' workloads (no timing)."""

from __future__ import annotations

import csv
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from kvplane.sim.workloads import requests_for_point

REPO = Path(__file__).resolve().parents[2]


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sim_peers", REPO / "benchmarks/sim_peers.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["sim_peers"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("key", ["vidur", "distserve"])
def test_scenario_is_valid_and_carries_the_workload(key: str, tmp_path: Path) -> None:
    sp = _bench()
    w = sp.WORKLOADS[key]
    sc = sp.build_scenario(w, tmp_path)
    (point,) = sc.points()
    assert sc.cluster.colocated and sc.cluster.prefill_instances == sc.cluster.decode_instances == 1
    assert not sc.connector.prefix_caching.prefill and not sc.connector.prefix_caching.decode
    assert sc.profiles.hardware.device.name == "NVIDIA A100 SXM4 80GB"
    batch = requests_for_point(point)
    assert len(batch) == w.requests
    total = batch.prompt_tokens + batch.output_tokens
    if key == "distserve":
        assert sc.profiles.model.name == "opt-13b" and sc.cluster.prefill_tp == 2
        assert int(total.max()) < 2048
    else:
        assert sc.profiles.model.name == "llama-3-8b" and sc.engine.max_num_batched_tokens == 512
        assert int(total.max()) <= 16384
    # Poisson at the peer's rate: the mean gap within 20 % of 1/qps over hundreds of requests.
    gap = float(np.diff(batch.arrival).mean())
    assert abs(gap * w.qps - 1.0) < 0.2
    # The lengths follow the recorded trace quantiles: the median within 15 % of the trace's.
    lengths = sp.recorded()["lengths"]
    if key == "vidur":
        assert abs(float(np.median(batch.prompt_tokens)) / lengths["prompt"][50] - 1) < 0.15
        assert abs(float(np.median(batch.output_tokens)) / lengths["output"][50] - 1) < 0.15


def test_distserve_file_holds_the_same_requests_as_kvplanes_trace(tmp_path: Path) -> None:
    sp = _bench()
    trace, custom = sp.write_trace(sp.DISTSERVE, tmp_path)
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    items = json.loads(custom.read_text())
    assert len(lines) == len(items) == sp.DISTSERVE.requests
    for a, b in zip(lines, items, strict=True):
        assert (a["input_length"], a["output_length"]) == (b["prompt_len"], b["output_len"])
        assert a["timestamp"] == pytest.approx(b["start_time"] * 1000.0)
    ids = [i for x in lines for i in x["hash_ids"]]
    assert len(ids) == len(set(ids)), "no two requests share a prefix block"


def test_vidur_stand_in_has_the_columns_vidurs_predictor_reads(tmp_path: Path) -> None:
    sp = _bench()
    path = tmp_path / "attention.csv"
    rows = sp.vidur_attention_stand_in(path)
    with path.open() as f:
        reader = csv.DictReader(f)
        got = list(reader)
    assert len(got) == rows > 1000
    need = {"n_embd", "n_q_head", "n_kv_head", "block_size", "num_tensor_parallel_workers",
            "batch_size", "prefill_chunk_size", "kv_cache_size",
            "time_stats.attn_prefill.median", "time_stats.attn_decode.median",
            "time_stats.attn_kv_cache_save.median"}
    assert need <= set(got[0])
    decode = [r for r in got if r["prefill_chunk_size"] == "0"]
    prefill = [r for r in got if r["prefill_chunk_size"] != "0"]
    assert decode and prefill
    assert all(float(r["time_stats.attn_decode.median"]) > 0 for r in decode)
    assert all(float(r["time_stats.attn_prefill.median"]) > 0 for r in prefill)
    assert sp._is_stand_in(path)
