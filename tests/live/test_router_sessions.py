"""The router's conversation table over real HTTP: turns, tenants, signed handles, leases, and a
restart that rebuilds the table from a real SQLite store."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from pathlib import Path
from typing import Any

import pytest
from test_router import make_config, post, run, serving, stop
from test_router_standins import KEY, MODEL, standins

from kvplane.core.events import (
    KVLoadFailed,
    SessionDropped,
    SessionMissed,
    SessionRenewed,
    SessionStored,
    SessionTaken,
)
from kvplane.core.replay import replay
from kvplane.live.router import Router, resume_run
from kvplane.live.router_config import Leases
from kvplane.live.router_handles import HandleError, sign_wire, verify_wire
from kvplane.store import BatchingRecorder, ListRecorder, open_store

pytestmark = pytest.mark.timeout(60)


def chat(conversation: str | None, text: str, **kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 2,
                            "messages": [{"role": "user", "content": text}], **kw}
    if conversation is not None:
        body["conversation_id"] = conversation
    return body


def test_conversation_table_across_turns() -> None:
    async def go() -> None:
        p, d0, d1 = await standins("prefill-0", "decode-0", "decode-1")
        rec = ListRecorder()
        router = Router(make_config([p], [d0, d1], mode="bidirectional", policy=_affinity()),
                        recorder=rec)
        history = "one two three four five six seven eight nine"
        try:
            async with serving(router) as url:
                for turn in range(3):
                    history += f" turn{turn} a b c d"
                    status, body, _ = await post(url + "/v1/chat/completions",
                                                 chat("conv-1", history))
                    assert status == 200, body
                    assert "kv_transfer_params" not in body
            legs = p.completions_seen()
            assert [leg.kvplane["reuse"] is None for leg in legs] == [True, False, False]
            # turn n's prefill got turn n-1's retained handle, scoped and signed by the router
            decodes = d0.completions_seen() + d1.completions_seen()
            assert len(decodes) == 3
            by_id = {leg.request_id: leg for leg in decodes}
            for prev, leg in itertools.pairwise(legs):
                reuse = leg.kvplane["reuse"]
                assert verify_wire(KEY, reuse) == ("default", "conv-1")
                assert reuse["xfer"] == prev.request_id
                assert reuse["lease"] == f"{prev.request_id}#0/retained"
                # kv_affinity: the turn goes to the decode that retains the conversation's KV
                assert by_id[leg.request_id].body["kv_transfer_params"]["kvplane"]["retain"]
            assert p.forged == []
            kinds = [type(e).__name__ for e in rec.events if type(e).__name__.startswith("Sess")]
            assert kinds == ["SessionMissed", "SessionStored", "SessionTaken", "SessionStored",
                             "SessionTaken", "SessionStored"]
            h = router.table.handle_of("default", "conv-1")
            assert h is not None and h.lease == f"{legs[-1].request_id}#0/retained"
            # superseded leases were released on their decode, with a signed handle
            await asyncio.sleep(0.05)
            released = d0.released + d1.released
            assert sorted(lease for lease, _ in released) == sorted(
                f"{leg.request_id}#0/retained" for leg in legs[:2])
            assert d0.forged == d1.forged == []
            assert replay(rec.events).ok
        finally:
            await stop(p, d0, d1)

    run(go)


def _affinity() -> Any:
    from kvplane.core.routing import Policy

    return Policy("kv_affinity")


def test_streamed_turn_gets_its_handle_from_decodes_side_channel() -> None:
    async def go() -> None:
        p, d = await standins("prefill-0", "decode-0")  # like vLLM 0.32: no params in streams
        router = Router(make_config([p], [d], mode="bidirectional"))
        try:
            async with serving(router) as url:
                for _ in range(2):
                    status, _, _ = await post(url + "/v1/chat/completions",
                                              chat("c", "a b c d e f g h", stream=True))
                    assert status == 200
            second = p.completions_seen()[1].kvplane["reuse"]
            assert second is not None and second["xfer"] == p.completions_seen()[0].request_id
        finally:
            await stop(p, d)

    run(go)


def test_one_tenants_conversation_never_reaches_anothers_kv() -> None:
    async def go() -> None:
        p, d = await standins("prefill-0", "decode-0")
        router = Router(make_config([p], [d], mode="bidirectional",
                                    api_keys={"sk-acme": "acme"}))
        text = "shared prefix words one two three four five six"
        acme = {"Authorization": "Bearer sk-acme"}
        other = {"Authorization": "Bearer sk-someone-else", "X-Tenant": "acme"}
        try:
            async with serving(router) as url:
                async def turn(headers: dict[str, str], conv: str = "c1") -> Any:
                    status, _, _ = await post(url + "/v1/chat/completions", chat(conv, text),
                                              headers=headers)
                    assert status == 200
                    return p.completions_seen()[-1].kvplane["reuse"]

                assert await turn(acme) is None
                # same conversation id, another key (and a header claiming acme): a miss
                assert await turn(other) is None
                # with API keys configured, a keyless request is anonymous whatever it claims
                assert await turn({"X-Tenant": "acme"}) is None
                # acme's next turn gets acme's handle, scoped to acme
                reuse = await turn(acme)
                assert reuse is not None and verify_wire(KEY, reuse) == ("acme", "c1")
                # the conversation id also comes from a header
                assert await turn({"X-Conversation-Id": "c1", **acme}, conv=None) is not None
            tenants = sorted(t for t, _ in router.table.handles)
            assert tenants[:2] == ["acme", "anonymous"] and tenants[2].startswith("key-")
            assert len(tenants) == 3
            assert "sk-someone-else" not in json.dumps(tenants)  # keys are never kept
        finally:
            await stop(p, d)

    run(go)


def test_forged_or_altered_handle_is_detected() -> None:
    wire = {"lease": "x#0/retained", "blocks": [1, 2, 3], "num_tokens": 12,
            "source": {"instance": "decode-0", "host": "10.0.0.3", "port": 5600}}
    signed = sign_wire(KEY, wire, "acme", "c1")
    assert verify_wire(KEY, signed) == ("acme", "c1")
    for change in ({"blocks": [7, 8, 9]}, {"tenant": "evil"}, {"lease": "y#0/retained"},
                   {"num_tokens": 999}):
        with pytest.raises(HandleError, match="forged or altered"):
            verify_wire(KEY, {**signed, **change})
    with pytest.raises(HandleError, match="forged or altered"):
        verify_wire(b"another-key-0123456789", signed)
    with pytest.raises(HandleError, match="no signature"):
        verify_wire(KEY, wire | {"tenant": "acme", "conversation": "c1"})


def test_expired_handle_falls_back_to_recompute_and_is_recorded() -> None:
    async def go() -> None:
        p, d = await standins("prefill-0", "decode-0", ttl=0.2)
        rec = ListRecorder()
        router = Router(make_config([p], [d], mode="bidirectional"), recorder=rec)
        try:
            async with serving(router) as url:
                await post(url + "/v1/chat/completions", chat("c", "a b c d e f"))
                await asyncio.sleep(0.3)
                status, _, _ = await post(url + "/v1/chat/completions", chat("c", "a b c d e f"))
                assert status == 200
            assert p.completions_seen()[1].kvplane["reuse"] is None
            dropped = rec.of_type(SessionDropped)
            missed = rec.of_type(SessionMissed)
            assert [e.reason for e in dropped] == ["lease expired"]  # type: ignore[attr-defined]
            assert [e.reason for e in missed][-1] == "expired"  # type: ignore[attr-defined]
        finally:
            await stop(p, d)

    run(go)


def test_failed_reuse_at_prefill_is_recomputed_and_recorded() -> None:
    async def go() -> None:
        p, d = await standins("prefill-0", "decode-0")
        rec = ListRecorder()
        router = Router(make_config([p], [d], mode="bidirectional"), recorder=rec)
        try:
            async with serving(router) as url:
                await post(url + "/v1/chat/completions", chat("c", "a b c d e f"))
                p.reuse_fails = True
                status, body, _ = await post(url + "/v1/chat/completions",
                                             chat("c", "a b c d e f g"))
                assert status == 200, body
            first, retry = p.completions_seen()[1:]
            assert first.kvplane["reuse"] is not None and first.kvplane["attempt"] == 0
            assert retry.kvplane["reuse"] is None and retry.kvplane["attempt"] == 1
            assert retry.request_id == first.request_id
            (failed,) = rec.of_type(KVLoadFailed)
            assert "recompute" in failed.reason  # type: ignore[attr-defined]
            # the decode leg followed the new attempt
            assert d.completions_seen()[-1].body["kv_transfer_params"]["kvplane"]["attempt"] == 1
        finally:
            await stop(p, d)

    run(go)


def test_heartbeats_renew_active_leases_skip_idle_ones_and_drop_refused() -> None:
    async def go() -> None:
        p, d = await standins("prefill-0", "decode-0", renewable=True, ttl=30.0)
        rec = ListRecorder()
        leases = Leases(heartbeat_every=3600, idle_after=0.3)  # rounds driven by the test
        router = Router(make_config([p], [d], mode="bidirectional", leases=leases),
                        recorder=rec)
        try:
            async with serving(router) as url:
                await post(url + "/v1/chat/completions", chat("busy", "a b c d e"))
                await post(url + "/v1/chat/completions", chat("quiet", "f g h i j"))
                before = router.table.handle_of("default", "busy")
                assert before is not None
                await asyncio.sleep(0.01)
                await router.lease_round()
                assert len(d.heartbeats) == 2 and d.forged == []
                after = router.table.handle_of("default", "busy")
                assert after is not None and after.expires_at > before.expires_at
                renewed = rec.of_type(SessionRenewed)
                assert len(renewed) == 2
                # "quiet" goes idle; "busy" has another turn: only busy is kept alive
                await asyncio.sleep(0.35)
                await post(url + "/v1/chat/completions", chat("busy", "a b c d e k"))
                await router.lease_round()
                assert len(d.heartbeats) == 3
                # decode refuses (the lease is gone there): the handle is dropped
                d.leases.clear()
                await router.lease_round()
                assert router.table.handle_of("default", "busy") is None
                assert [e.reason for e in rec.of_type(SessionDropped)][-1] == \
                    "renewal refused"  # type: ignore[attr-defined]
                _, text = await _metrics(url)
            assert 'kvplane_router_lease_heartbeats_total{outcome="renewed"} 3.0' in text
            assert 'kvplane_router_lease_heartbeats_total{outcome="refused"} 1.0' in text
            assert 'kvplane_router_sessions{state="idle"} 1.0' in text
        finally:
            await stop(p, d)

    run(go)


async def _metrics(url: str) -> tuple[int, str]:
    from test_router import get_text

    return await get_text(url + "/metrics")


def test_restart_rebuilds_the_table_from_a_real_sqlite_store(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'router.db'}"

    async def start_router(store: Any, p: Any, d: Any) -> tuple[Router, BatchingRecorder]:
        run_id, history = await asyncio.to_thread(resume_run, store, name="r1")
        recorder = BatchingRecorder(store, run_id, flush_interval=0.05)
        cfg = make_config([p], [d], mode="bidirectional")
        return Router(cfg, recorder=recorder, history=history), recorder

    async def go() -> None:
        p, d = await standins("prefill-0", "decode-0")
        store = open_store(db)
        try:
            router, recorder = await start_router(store, p, d)
            async with serving(router) as url:
                for conv in ("alpha", "beta"):
                    status, _, _ = await post(url + "/v1/chat/completions",
                                              chat(conv, "x y z w v u"),
                                              headers={"X-Tenant": "acme"})
                    assert status == 200
            await asyncio.to_thread(recorder.close)
            first_legs = {leg.kvplane["conversation"]: leg.request_id
                          for leg in p.completions_seen()}

            # a new router process: same store, same name -> same run, table rebuilt
            router2, recorder2 = await start_router(store, p, d)
            assert set(router2.table.handles) == {("acme", "alpha"), ("acme", "beta")}
            assert router2.rebuilt == 2
            async with serving(router2) as url:
                status, _, _ = await post(url + "/v1/chat/completions",
                                          chat("alpha", "x y z w v u t"),
                                          headers={"X-Tenant": "acme"})
                assert status == 200
            await asyncio.to_thread(recorder2.close)
            reuse = p.completions_seen()[-1].kvplane["reuse"]
            # the table survived; decode's full handle came from its side channel
            assert reuse is not None and reuse["xfer"] == first_legs["alpha"]
            assert verify_wire(KEY, reuse) == ("acme", "alpha")
            runs = store.runs("live")
            assert len(runs) == 1 and runs[0].scenario == "router:r1"
            events = list(store.events(runs[0].id))
            kinds = [type(e) for e in events]
            assert kinds.count(SessionStored) == 3 and kinds.count(SessionTaken) == 1
            assert replay(events).ok
        finally:
            store.close()
            await stop(p, d)

    run(go)


def test_the_router_never_waits_for_the_database(tmp_path: Path) -> None:
    """Recording is a queue append: a store whose every write takes a second slows no turn."""
    store = open_store(f"sqlite:///{tmp_path / 'slow.db'}")
    run_id = store.create_run("live", "router:slow")
    real_append = store.append_encoded

    def slow_append(*args: Any, **kw: Any) -> Any:
        time.sleep(1.0)
        return real_append(*args, **kw)

    store.append_encoded = slow_append  # type: ignore[method-assign]
    recorder = BatchingRecorder(store, run_id, batch_size=1, flush_interval=0.01)

    async def go() -> None:
        p, d = await standins("prefill-0", "decode-0")
        router = Router(make_config([p], [d], mode="bidirectional"), recorder=recorder)
        try:
            async with serving(router) as url:
                t = time.monotonic()
                for i in range(3):
                    status, _, _ = await post(url + "/v1/chat/completions",
                                              chat("c", f"a b c d {i}"))
                    assert status == 200
                assert time.monotonic() - t < 1.0  # 20+ events queued, none waited for
                assert recorder.pending > 0
                store.append_encoded = real_append  # type: ignore[method-assign]
        finally:
            await stop(p, d)

    try:
        run(go)
    finally:
        store.append_encoded = real_append  # type: ignore[method-assign]
        recorder.close()
        assert store.count(run_id) > 20
        store.close()
