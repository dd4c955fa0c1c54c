"""Twins (sim/replay_sim.py): re-simulating a recorded run's arrivals and conversations."""

from __future__ import annotations

import pytest

from kvplane.core.events import RequestArrived, RequestFinished
from kvplane.sim.config import ScenarioError
from kvplane.sim.replay_sim import parse_label, replay_into_sim
from kvplane.store import RunNotFound, open_store

pytestmark = pytest.mark.timeout(300)


def finished(store, run_id):  # type: ignore[no-untyped-def]
    return {e.request: e for e in store.events(run_id, "RequestFinished")}


def test_the_twin_of_a_simulated_run_is_that_run(see_store):
    """Same arrivals, same scenario, same seeds: every request's figures come back."""
    with open_store(see_store.url) as store:
        for original in (see_store.push_point, see_store.pull_point):
            twin = replay_into_sim(store, original)
            info = store.run(twin)
            assert info.kind == "replay" and info.parent == original
            assert info.meta["replay_of"] == original and info.meta["scenario"]["name"]
            a, b = finished(store, original), finished(store, twin)
            assert set(a) == set(b) and len(a) == 12
            for req, e in a.items():
                assert b[req].ttft == pytest.approx(e.ttft, rel=1e-9)
                assert b[req].e2e == pytest.approx(e.e2e, rel=1e-9)
            assert info.meta["summary"]["finished"] == 12


def test_later_turns_are_released_by_the_previous_turn_closed_loop(see_store):
    with open_store(see_store.url) as store:
        twin = replay_into_sim(store, see_store.reuse_on)
        a, b = finished(store, see_store.reuse_on), finished(store, twin)
        arrivals = {e.request: e for e in store.events(twin, RequestArrived)}
        outcomes = [e.outcome for e in store.events(twin, "ReuseDecided")]  # type: ignore[attr-defined]
    assert set(a) == set(b) and len(b) == 27
    for req, e in a.items():
        assert b[req].ttft == pytest.approx(e.ttft, rel=1e-6)
    turns = {e.conversation for e in arrivals.values() if e.turn > 0}  # type: ignore[attr-defined]
    assert len(turns) > 1 and outcomes.count("read") > 0


def test_a_twin_under_another_mode_and_model(see_store):
    with open_store(see_store.url) as store:
        twin = replay_into_sim(store, see_store.push_point, mode="pull",
                               profiles=["llama-3.3-70b"])
        routed = {e.mode for e in store.events(twin, "RequestRouted")}  # type: ignore[attr-defined]
        meta = store.run(twin).meta
        a, b = finished(store, see_store.push_point), finished(store, twin)
    assert routed == {"pull"} and meta["scenario"]["profiles"]["model"]["name"] == "llama-3.3-70b"
    assert set(a) == set(b)
    assert any(b[r].ttft != pytest.approx(a[r].ttft, rel=1e-3) for r in a)


def test_a_twin_of_an_imported_run_follows_its_arrivals(see_store):
    with open_store(see_store.url) as store:
        want = [(e.request, e.at, e.prompt_tokens)  # type: ignore[attr-defined]
                for e in store.events(see_store.measured, RequestArrived)]
        got = [(e.request, e.at, e.prompt_tokens)  # type: ignore[attr-defined]
               for e in store.events(see_store.twin, RequestArrived)]
        modes = {e.mode for e in store.events(see_store.twin, "RequestRouted")}  # type: ignore[attr-defined]
    assert [(r, pytest.approx(t), p) for r, t, p in want] == got
    assert modes == {"push"}  # push_qps4_in4096: the point's mode, from its label


def test_what_cannot_be_replayed_says_why(see_store):
    with open_store(see_store.url) as store:
        with pytest.raises(RunNotFound):
            replay_into_sim(store, "no-such-run")
        with pytest.raises(ScenarioError, match="RequestArrived"):
            replay_into_sim(store, see_store.sweep)  # a sweep run holds no event
        mystery = store.create_run("live", "somebody's cluster")
        store.append(mystery, [
            RequestArrived(at=0.0, instance="router", request="a", prompt_tokens=100,
                           output_tokens=8),
            RequestFinished(at=0.5, instance="decode-0", request="a", output_tokens=8,
                            ttft=0.1, tpot=0.05, e2e=0.5),
        ])
        with pytest.raises(ScenarioError, match="--scenario"):
            replay_into_sim(store, mystery)
        twin = replay_into_sim(store, mystery, "seed_push_vs_pull")
        assert set(finished(store, twin)) == {"a"}
        with pytest.raises(ScenarioError, match="cpu-test"):
            replay_into_sim(store, mystery, "seed_push_vs_pull", profiles=["cpu-test"])


def test_point_labels():
    assert parse_label("pull_bidi_qps0.01_iter0") == {
        "mode": "pull", "bidirectional": True, "qps": 0.01, "input_len": None,
        "output_len": None, "iteration": 0}
    assert parse_label("push_qps8_in16384_out128_iter2")["input_len"] == 16384  # type: ignore[index]
    assert parse_label("run_3") is None
