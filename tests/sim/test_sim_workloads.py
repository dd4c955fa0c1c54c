"""Workloads: determinism, shapes, growing contexts, prefix hashes, trace errors, speed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvplane.sim.config import (
    LengthSpec,
    MultiTurnWorkload,
    PoissonWorkload,
    TraceWorkload,
    load_scenario,
)
from kvplane.sim.profiles import ScenarioError
from kvplane.sim.workloads import (
    RequestBatch,
    generate,
    hash_strings,
    matching_prefix_blocks,
    read_trace,
    requests_for_point,
    sample_lengths,
)

POISSON = PoissonWorkload(kind="poisson", qps=4.0, input_len=LengthSpec(mean=1000,
                          dist="uniform", range_ratio=0.5), output_len=LengthSpec(mean=100))
CHAT = MultiTurnWorkload(
    kind="multi_turn", conversation_rate=1.0, turns=LengthSpec(mean=6, dist="uniform",
    range_ratio=0.5), first_prompt=LengthSpec(mean=1000, dist="lognormal"),
    user_tokens=LengthSpec(mean=100, dist="exponential"), tool_output_tokens=LengthSpec(mean=300),
    tool_output_fraction=0.1, output_len=LengthSpec(mean=200, dist="exponential", min=1),
    think_time_s=3.0, shared_prefix_tokens=64,
)


def same(a: RequestBatch, b: RequestBatch) -> bool:
    return all(
        np.array_equal(getattr(a, f), getattr(b, f))
        for f in ("arrival", "prompt_tokens", "output_tokens", "conversation", "turn",
                  "think_time", "previous", "shared_stream", "shared_tokens", "stream")
    )


@pytest.mark.parametrize("workload", [POISSON, CHAT])
def test_same_seed_same_requests(workload: PoissonWorkload | MultiTurnWorkload) -> None:
    a = generate(workload, 500, seed=7)
    assert same(a, generate(workload, 500, seed=7))
    assert not same(a, generate(workload, 500, seed=8))
    assert len(a) == 500
    assert list(a)[123] == a[123]


def test_point_seeds_give_push_and_pull_the_same_requests() -> None:
    points = load_scenario("seed_push_vs_pull").points()
    push = next(p for p in points if p.mode == "push" and p.qps == 8 and p.input_len == 16384)
    pull = next(p for p in points if p.mode == "pull" and p.qps == 8 and p.input_len == 16384)
    a, b = requests_for_point(push), requests_for_point(pull)
    assert same(a, b) and len(a) == 110  # 100 measured + 10 warm-up


def test_poisson_shape() -> None:
    batch = generate(POISSON.model_copy(update={"qps": 10.0}), 20000, seed=1)
    assert batch.arrival[0] == 0.0 and np.all(np.diff(batch.arrival) >= 0)
    rate = (len(batch) - 1) / batch.arrival[-1]
    assert rate == pytest.approx(10.0, rel=0.03)
    assert batch.prompt_tokens.min() >= 500 and batch.prompt_tokens.max() <= 1500
    assert np.all(batch.output_tokens == 100)
    assert np.all(batch.conversation == -1) and np.all(batch.previous == -1)


def test_shared_prefix_is_shared_in_block_hashes() -> None:
    workload = POISSON.model_copy(update={"shared_prefix_fraction": 0.5,
                                          "input_len": LengthSpec(mean=1024)})
    batch = generate(workload, 3, seed=1)
    a, b = batch[0].block_hashes(16), batch[1].block_hashes(16)
    assert len(a) == 64 and matching_prefix_blocks(a, b) == 32
    none = generate(POISSON, 2, seed=1)
    assert matching_prefix_blocks(none[0].block_hashes(16), none[1].block_hashes(16)) == 0


def test_block_hashes_follow_their_definition_whatever_the_shared_length() -> None:
    """Block j hashes (shared stream, j) inside the shared prefix, else (own stream, j),
    however much of the prompt the prefix covers (the shared part is computed once)."""
    from dataclasses import replace

    from kvplane.sim.workloads import _mix

    base = generate(POISSON.model_copy(update={"shared_prefix_fraction": 0.5}), 1, seed=2)[0]
    for prompt, shared in ((1024, 512), (1024, 0), (64, 4096), (1000, 999), (8, 8), (16, 16)):
        q = replace(base, prompt_tokens=prompt, shared_tokens=shared, shared_stream=7,
                    stream=11)
        j = np.arange(prompt // 16, dtype=np.int64)
        keys = np.where(j < shared // 16, 7, 11)
        assert q.block_hashes(16).tolist() == _mix(keys, j).tolist()


def test_multi_turn_context_grows_by_output_user_and_tool() -> None:
    batch = generate(CHAT, 3000, seed=3, max_model_len=32768)
    by_rid = list(batch)
    assert np.all(np.diff(batch.arrival) >= 0)
    later = [r for r in by_rid if r.turn > 0]
    assert later
    for r in later:
        prev = by_rid[r.previous]  # type: ignore[index]
        assert prev.conversation == r.conversation and prev.turn == r.turn - 1
        assert prev.rid < r.rid
        history = prev.prompt_tokens + prev.output_tokens
        assert r.prompt_tokens >= history + 300 + int(0.1 * history)
        assert r.arrival == pytest.approx(prev.arrival + r.think_time)
        assert r.prompt_tokens + r.output_tokens <= 32768
        # the previous turn's prompt is a prefix of this one, block for block
        mine, theirs = r.block_hashes(16), prev.block_hashes(16)
        assert matching_prefix_blocks(mine, theirs) == prev.prompt_tokens // 16
    firsts = [r for r in by_rid if r.turn == 0]
    x, y = firsts[0].block_hashes(16), firsts[1].block_hashes(16)
    assert matching_prefix_blocks(x, y) == 64 // 16  # only the shared system prompt


def test_multi_turn_respects_the_prompt_cap() -> None:
    capped = CHAT.model_copy(update={"max_prompt_tokens": 3000})
    batch = generate(capped, 2000, seed=5, max_model_len=32768)
    assert batch.prompt_tokens.max() <= 3000


def test_hash_strings_are_hex() -> None:
    h = generate(POISSON, 1, seed=1)[0].block_hashes(16)
    s = hash_strings(h)
    assert len(s) == len(h) and all(len(x) == 16 for x in s)


def test_hundred_thousand_multi_turn_requests_are_generated() -> None:
    # how fast is a benchmark's business (benchmarks/sim_speed.py), not a test's
    batch = generate(CHAT, 100_000, seed=11, max_model_len=32768)
    count = sum(1 for _ in batch)
    assert count == 100_000


def test_length_distributions_have_their_means() -> None:
    rng = np.random.default_rng(0)
    for dist in ("exponential", "lognormal"):
        x = sample_lengths(LengthSpec(mean=1000, dist=dist), 50000, rng)
        assert x.mean() == pytest.approx(1000, rel=0.03)
    x = sample_lengths(LengthSpec(mean=1000, dist="exponential", min=10, max=1500), 1000, rng)
    assert x.min() >= 10 and x.max() <= 1500


# --- traces -----------------------------------------------------------------------------------------


def write_trace(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_read_a_mooncake_trace(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 2000, "input_length": 1100, "output_length": 10, "hash_ids": [1, 2, 3]},
        {"timestamp": 1000, "input_length": 600, "output_length": 5, "hash_ids": [1, 9]},
        {"timestamp": 3000, "input_length": 1024, "output_length": 7, "hash_ids": [1, 2]},
    ]
    path = write_trace(tmp_path, [json.dumps(r) for r in rows[:2]] + ["", json.dumps(rows[2])])
    batch = read_trace(path, time_scale=0.5)
    assert batch.arrival.tolist() == [0.0, 0.5, 1.0]
    assert batch.prompt_tokens.tolist() == [600, 1100, 1024]
    first, second, third = list(batch)
    assert first.hash_ids == (1, 9)
    # shared hash ids 1,2 cover 1024 tokens = 64 blocks of 16
    assert matching_prefix_blocks(second.block_hashes(16), third.block_hashes(16)) == 64
    assert matching_prefix_blocks(first.block_hashes(16), second.block_hashes(16)) == 32
    scenario_like = TraceWorkload(kind="trace", path=str(path))
    assert len(generate(scenario_like, 2, seed=0)) == 2


@pytest.mark.parametrize(
    ("line", "field", "expected"),
    [
        ("{not json", "", "JSON object"),
        ("[1, 2]", "", "JSON object"),
        ('{"input_length": 5, "output_length": 1}', "timestamp", "field missing"),
        ('{"timestamp": -1, "input_length": 5, "output_length": 1}', "timestamp", "non-negative"),
        ('{"timestamp": 0, "input_length": "5", "output_length": 1}', "input_length", ">= 1"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 0}', "output_length", ">= 1"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1, "x"]}',
         "hash_ids", "list of non-negative integers"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1, 2]}',
         "hash_ids", "at most"),
    ],
)
def test_bad_trace_lines_name_file_line_and_field(
    tmp_path: Path, line: str, field: str, expected: str
) -> None:
    good = json.dumps({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]})
    path = write_trace(tmp_path, [good, good, line])
    with pytest.raises(ScenarioError) as info:
        read_trace(path)
    text = str(info.value)
    assert f"{path}:3:" in text and expected in text
    assert info.value.field == field


def test_missing_trace_file(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match="readable trace file"):
        read_trace(tmp_path / "nope.jsonl")
