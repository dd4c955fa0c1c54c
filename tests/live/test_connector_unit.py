"""The connector's scheduler half without vLLM: fake requests in, core decisions out.

A prefill half and a decode half are driven the way vLLM's scheduler drives them (new request,
match, allocate, finish, one metadata per step), and a stand-in for the two workers carries out
their orders instantly (a READ completes, a WRITE delivers its notification, a notification
arrives). Each flow ends with the events of both instances replayed through kvplane.core.replay.
Fast (no servers, no NIXL transfer): the live suite checks the same flows against real vLLM.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from kvplane.core import events as ev
from kvplane.core.hashing import block_hashes
from kvplane.core.plan import KVLayout
from kvplane.core.replay import replay
from kvplane.live.connector_config import ConnectorConfig
from kvplane.live.connector_scheduler import SchedulerHalf
from kvplane.live.connector_wire import (
    Fact,
    KvplaneMeta,
    Leg,
    PeerError,
    decode_notif,
    layout_to_dict,
    parse_leg,
)
from kvplane.live.recording import SafeRecorder
from kvplane.store import ListRecorder

LAYOUT = KVLayout(block_size=4, tp=1, num_layers=2, num_kv_heads=2, head_bytes=128)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Pair:
    clock: Clock = field(default_factory=Clock)
    log: ListRecorder = field(default_factory=ListRecorder)
    halves: dict[str, SchedulerHalf] = field(default_factory=dict)

    def half(self, name: str, key: bytes = b"", layout: KVLayout = LAYOUT,
             **cfg: Any) -> SchedulerHalf:
        c = ConnectorConfig.from_extra({"instance": name, "side_channel_port": 1,
                                        "kv_recompute_threshold": 8, **cfg})
        h = SchedulerHalf(c, layout, f"engine-{name}", SafeRecorder(self.log, name),
                          clock=self.clock, serve=False, handle_key=key)
        self.halves[name] = h
        return h

    def step(self, name: str) -> KvplaneMeta:
        """One engine step of `name`: its metadata, with the orders carried out at once."""
        h = self.halves[name]
        meta = h.build_connector_meta()
        for o in meta.orders:
            peer = self.halves[o.peer.instance]
            if o.kind == "read":
                h.on_fact(Fact("read_done", o.xfer, o.attempt, self.clock(), purpose=o.purpose,
                               nbytes=1, rank=o.rank, peer_rank=o.peer_rank))
            elif o.kind == "write":
                h.on_fact(Fact("write_done", o.xfer, o.attempt, self.clock(), purpose=o.purpose,
                               rank=o.rank, peer_rank=o.peer_rank))
            if o.notify:
                parsed = decode_notif(o.notify)
                assert parsed is not None
                kind, body = parsed
                peer.on_fact(Fact("notif", o.xfer, o.attempt, self.clock(), notif=kind,
                                  body=body))
        return meta

    def replay_ok(self) -> None:
        report = replay(sorted(self.log.events, key=lambda e: e.at), final=True)
        assert report.ok, "\n".join(map(str, report.violations))

    def of(self, kind: type[ev.Event], **match: Any) -> list[ev.Event]:
        return [e for e in self.log.events if isinstance(e, kind)
                and all(getattr(e, k) == v for k, v in match.items())]


def request(rid: str, params: dict[str, Any] | None, prompt: list[int],
            max_tokens: int = 4) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=rid, kv_transfer_params=params, num_prompt_tokens=len(prompt),
        prompt_token_ids=list(prompt), num_computed_tokens=0, all_token_ids=list(prompt),
        status=SimpleNamespace(name="RUNNING"), num_preemptions=0,
        sampling_params=SimpleNamespace(max_tokens=max_tokens))


def finish(req: SimpleNamespace, computed: int, outputs: list[int] = (),  # type: ignore[assignment]
           status: str = "FINISHED_LENGTH_CAPPED") -> None:
    req.num_computed_tokens = computed
    req.all_token_ids = list(req.prompt_token_ids) + list(outputs)
    req.status = SimpleNamespace(name=status)


PROMPT = list(range(100, 118))  # 18 tokens: 5 blocks of 4


def prefill_leg(xfer: str, mode: str = "pull", reuse: dict[str, Any] | None = None
                ) -> dict[str, Any]:
    kp: dict[str, Any] = {"v": 1, "mode": mode, "xfer": xfer}
    if reuse is not None:
        kp["reuse"] = reuse
    return {"do_remote_decode": True, "kvplane": kp}


def push_decode_leg(xfer: str, retain: bool = False,
                    source_layout: KVLayout | None = None) -> dict[str, Any]:
    extra = {"layout": layout_to_dict(source_layout)} if source_layout else {}
    return {"do_remote_prefill": True, "kvplane": {
        "v": 1, "mode": "push", "xfer": xfer, "retain": retain,
        "source": {"instance": "P", "host": "127.0.0.1", "port": 1, **extra}}}


def run_prefill(pair: Pair, xfer: str, prompt: list[int], blocks: list[int], mode: str = "pull",
                reuse: dict[str, Any] | None = None) -> tuple[SimpleNamespace, Any]:
    P = pair.halves["P"]
    rp = request(f"{xfer}-p", prefill_leg(xfer, mode, reuse), prompt, 1)
    P.on_new_request(rp)
    n, load = P.get_num_new_matched_tokens(rp, 0)
    P.update_state_after_alloc(rp, blocks, n)
    if load:
        pair.step("P")  # the D->P read runs
        pair.step("P")  # vLLM hears it finished
    finish(rp, len(prompt))
    return rp, P.request_finished(rp, blocks)


def run_pull(pair: Pair, xfer: str, prompt: list[int], p_blocks: list[int],
             d_blocks: list[int], outputs: list[int], retain: bool = False,
             reuse: dict[str, Any] | None = None) -> tuple[Any, Any]:
    D = pair.halves["D"]
    rp, (delay, params) = run_prefill(pair, xfer, prompt, p_blocks, reuse=reuse)
    assert delay is True and params["do_remote_prefill"] is True
    params["kvplane"]["retain"] = retain
    rd = request(f"{xfer}-d", params, prompt)
    D.on_new_request(rd)
    n, load = D.get_num_new_matched_tokens(rd, 0)
    assert (n, load) == (len(prompt), True)
    assert D.get_num_new_matched_tokens(rd, 0) == (n, load)  # side-effect free
    D.update_state_after_alloc(rd, d_blocks, n)
    meta = pair.step("D")
    assert [o.kind for o in meta.orders] == ["read"]
    assert rd.request_id in pair.step("D").finished_recving
    assert rp.request_id in pair.step("P").finished_sending
    finish(rd, len(prompt) + len(outputs) - 1, outputs)
    return rd, D.request_finished(rd, d_blocks)


def test_pull_holds_reads_and_frees() -> None:
    pair = Pair()
    pair.half("P")
    pair.half("D")
    _, (delay, params) = run_pull(pair, "x1", PROMPT, [1, 2, 3, 4, 5], [7, 8, 9, 10, 11],
                                   [1, 2, 3])
    assert (delay, params) == (False, None)
    assert pair.of(ev.LeaseReleased, instance="P")[0].reason == "read by decode"
    assert pair.of(ev.KVReceived, instance="D")[0].num_tokens == len(PROMPT)
    pair.replay_ok()


@pytest.mark.parametrize("order", ["registration_first", "prefill_first"])
def test_push_matches_in_either_order(order: str) -> None:
    pair = Pair()
    pair.half("P")
    D = pair.half("D")
    rd = request("x2-d", push_decode_leg("x2"), PROMPT)

    def decode_registers() -> None:
        D.on_new_request(rd)
        n, _ = D.get_num_new_matched_tokens(rd, 0)
        D.update_state_after_alloc(rd, [7, 8, 9, 10, 11], n)
        meta = pair.step("D")
        assert [o.kind for o in meta.orders] == ["notify"]  # the registration, nothing more

    if order == "registration_first":
        decode_registers()
        rp, (delay, _) = run_prefill(pair, "x2", PROMPT, [1, 2, 3, 4, 5], mode="push")
    else:
        rp, (delay, _) = run_prefill(pair, "x2", PROMPT, [1, 2, 3, 4, 5], mode="push")
        decode_registers()
    assert delay is True
    assert pair.of(ev.RendezvousMatched)[0].order == order
    meta = pair.step("P")  # the WRITE; its notification reaches decode
    assert [o.kind for o in meta.orders] == ["write"]
    assert rp.request_id in pair.step("P").finished_sending
    assert rd.request_id in pair.step("D").finished_recving
    finish(rd, len(PROMPT) + 2, [1, 2, 3])
    assert D.request_finished(rd, [7, 8, 9, 10, 11]) == (False, None)
    pair.replay_ok()


def test_push_wait_times_out_and_decode_computes() -> None:
    pair = Pair()
    D = pair.half("D", kv_wait_timeout=5)
    pair.half("P")
    rd = request("x3-d", push_decode_leg("x3"), PROMPT)
    D.on_new_request(rd)
    n, _ = D.get_num_new_matched_tokens(rd, 0)
    D.update_state_after_alloc(rd, [7, 8, 9, 10, 11], n)
    pair.halves["D"].build_connector_meta()  # the registration is lost on the way
    pair.clock.now += 6
    meta = D.build_connector_meta()  # tick: the wait ended
    meta = D.build_connector_meta() if not meta.failed_recving else meta
    assert rd.request_id in meta.failed_recving and rd.request_id in meta.finished_recving
    assert pair.of(ev.KVLoadFailed, instance="D")
    # vLLM frees the blocks and computes the prompt itself, in new blocks
    assert D.get_num_new_matched_tokens(rd, 0) == (0, False)
    D.update_state_after_alloc(rd, [7, 8, 9, 10, 11], 0)
    finish(rd, len(PROMPT) + 2, [1, 2, 3])
    assert D.request_finished(rd, [7, 8, 9, 10, 11]) == (False, None)
    pair.replay_ok()


def test_registration_for_an_ended_request_tells_decode() -> None:
    pair = Pair()
    P = pair.half("P", push_hold_timeout=2)
    D = pair.half("D")
    rp, _ = run_prefill(pair, "x4", PROMPT, [1, 2, 3, 4, 5], mode="push")
    pair.clock.now += 3
    meta = P.build_connector_meta()  # hold time-out: prefill frees
    assert rp.request_id in meta.finished_sending
    rd = request("x4-d", push_decode_leg("x4"), PROMPT)
    D.on_new_request(rd)
    n, _ = D.get_num_new_matched_tokens(rd, 0)
    D.update_state_after_alloc(rd, [7, 8, 9, 10, 11], n)
    pair.step("D")
    assert pair.of(ev.RegistrationDropped, instance="P")
    pair.step("P")  # the FAIL notification reaches decode
    meta = D.build_connector_meta()
    assert rd.request_id in meta.failed_recving
    D.update_state_after_alloc(rd, [7, 8, 9, 10, 11], 0)
    finish(rd, len(PROMPT) + 2, [1, 2, 3])
    D.request_finished(rd, [7, 8, 9, 10, 11])
    pair.replay_ok()


def retained_turn(pair: Pair, xfer: str, outputs: list[int]) -> dict[str, Any]:
    _, (delay, params) = run_pull(pair, xfer, PROMPT, [1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12],
                                  outputs, retain=True)
    assert delay is True
    handle = params["kvplane"]["retained"]
    tokens = PROMPT + outputs
    assert handle["block_hashes"] == list(block_hashes(tokens[:len(PROMPT) + len(outputs) - 1],
                                                       4))
    return handle


def test_second_turn_reads_retained_kv() -> None:
    pair = Pair()
    pair.half("P")
    pair.half("D")
    out1 = [5, 6, 7, 8, 9, 10]
    handle = retained_turn(pair, "t1", out1)
    prompt2 = PROMPT + out1 + [40, 41, 42, 43, 44, 45, 46, 47, 48]
    run_pull(pair, "t2", prompt2, list(range(20, 29)), list(range(30, 40)), [1, 2],
             reuse=handle)
    decided = pair.of(ev.ReuseDecided)[0]
    assert decided.outcome == "read" and decided.remote_tokens == 20  # 23 retained: 5 blocks
    assert pair.of(ev.TransferPlanned, direction="D->P")[0].num_tokens == 20
    assert pair.of(ev.PrefillStarted, request="t2")[0].computed_tokens == len(prompt2) - 20
    pair.replay_ok()


def test_edited_or_expired_handles_are_not_read() -> None:
    pair = Pair()
    pair.half("P")
    pair.half("D", decoder_kv_blocks_ttl=10)
    out1 = [5, 6, 7, 8, 9, 10]
    handle = retained_turn(pair, "t1", out1)
    edited = [1] + PROMPT[1:] + out1 + [40, 41, 42]
    run_pull(pair, "t2", edited, list(range(20, 27)), list(range(30, 37)), [1], reuse=handle)
    pair.clock.now += 11
    pair.halves["D"].build_connector_meta()  # the retained lease expires
    assert pair.of(ev.LeaseExpired, instance="D")
    run_pull(pair, "t3", PROMPT + out1 + [40], list(range(40, 47)), list(range(50, 57)), [1],
             reuse=handle)
    assert [e.outcome for e in pair.of(ev.ReuseDecided)] == ["mismatch", "expired"]
    assert not pair.of(ev.TransferPlanned, direction="D->P")
    pair.replay_ok()


def test_router_renews_and_releases_a_retained_lease() -> None:
    pair = Pair()
    pair.half("P")
    D = pair.half("D", lease_renewable=True, lease_extension=100, decoder_kv_blocks_ttl=10)
    handle = retained_turn(pair, "t1", [5, 6, 7, 8])
    replies: list[bytes | None] = []

    def ask(key: str) -> None:  # what the side channel's thread does with a router request
        t = threading.Thread(target=lambda: replies.append(D._control_request(key)))
        t.start()
        t.join()

    pair.clock.now += 5
    ask("renew/" + json.dumps(handle))
    assert json.loads(replies[-1] or b"{}")["expires_at"] == pair.clock.now + 100
    assert json.loads(D.side_channel.get("retained/t1") or b"{}")["expires_at"] == \
        pair.clock.now + 100
    ask("release/" + json.dumps(handle))
    assert pair.of(ev.LeaseReleased, instance="D")
    assert D.side_channel.get("retained/t1") is None
    assert "t1-d" in D.build_connector_meta().finished_sending
    ask("renew/" + json.dumps(handle))
    assert replies[-1] is None  # refused: the lease is gone
    pair.replay_ok()


def test_bad_params_are_refused_not_raised() -> None:
    with pytest.raises(PeerError):
        parse_leg({"do_remote_prefill": True, "kvplane": {"mode": "pull"}}, "r")
    assert parse_leg({"do_remote_decode": True}, "r") is None
    plain = {"kvplane": {"role": "decode", "mode": "push", "xfer": "x", "retain": True}}
    leg = parse_leg(plain, "r")
    assert isinstance(leg, Leg) and leg.source is None  # decode computes, may retain
    pair = Pair()
    P = pair.half("P")
    D = pair.half("D")
    rd = request("plain", plain, PROMPT)
    D.on_new_request(rd)
    assert D.get_num_new_matched_tokens(rd, 0) == (0, False)
    D.update_state_after_alloc(rd, [1, 2, 3, 4, 5], 0)
    finish(rd, len(PROMPT) + 1, [7, 8])
    delay, params = D.request_finished(rd, [1, 2, 3, 4, 5])
    assert delay and params["kvplane"]["retained"]["num_tokens"] == len(PROMPT) + 1
    rp = request("bad", {"do_remote_decode": True, "kvplane": {"v": 99}}, PROMPT)
    assert P.get_num_new_matched_tokens(rp, 0) == (0, False)


# ---- hostile and ordinary clients (issue 9) ----------------------------------------------------


def test_second_request_with_the_same_xfer_computes_locally() -> None:
    """n > 1 (vLLM copies one kv_transfer_params into each sample), a batch, a replay."""
    pair = Pair()
    pair.half("P")
    D = pair.half("D")
    rd, _ = run_pull(pair, "dup", PROMPT, [1, 2, 3, 4, 5], [7, 8, 9, 10, 11], [1, 2])
    params = rd.kv_transfer_params
    for rid in ("1_dup-d", "dup-replayed"):
        twin = request(rid, params, PROMPT)
        D.on_new_request(twin)
        assert D.get_num_new_matched_tokens(twin, 0) == (0, False)
        D.update_state_after_alloc(twin, [20, 21, 22, 23, 24], 0)
        finish(twin, len(PROMPT) + 1, [3, 4])
        assert D.request_finished(twin, [20, 21, 22, 23, 24]) == (False, None)
    assert len(pair.of(ev.TransferPlanned, instance="D")) == 1
    refusals = [e for e in pair.of(ev.KVLoadFailed, instance="D") if "already belongs" in e.reason]
    assert len(refusals) == 2
    pair.replay_ok()


def test_duplicate_prefill_legs_hold_once() -> None:
    pair = Pair()
    P = pair.half("P")
    _, (delay, params) = run_prefill(pair, "pdup", PROMPT, [1, 2, 3, 4, 5])
    assert delay and params
    twin = request("1_pdup-p", prefill_leg("pdup"), PROMPT, 1)
    P.on_new_request(twin)
    assert P.get_num_new_matched_tokens(twin, 0) == (0, False)
    P.update_state_after_alloc(twin, [9, 10, 11, 12, 13], 0)
    finish(twin, len(PROMPT))
    assert P.request_finished(twin, [9, 10, 11, 12, 13]) == (False, None)
    assert len(pair.of(ev.LeaseGranted, instance="P")) == 1


def read_runs(meta: KvplaneMeta) -> list[tuple[int, int, int]]:
    """The orders' token-slot runs as (src block, dst block, blocks)."""
    bs = LAYOUT.block_size
    return [(s // bs, d // bs, -(-n // bs)) for o in meta.orders for s, d, n in o.runs]


def test_decode_with_a_local_prefix_hit_loads_only_the_rest() -> None:
    pair = Pair()
    pair.half("P")
    D = pair.half("D")
    _, (_, params) = run_prefill(pair, "hit", PROMPT, [1, 2, 3, 4, 5])
    rd = request("hit-d", params, PROMPT)
    D.on_new_request(rd)
    assert D.get_num_new_matched_tokens(rd, 8) == (len(PROMPT) - 8, True)  # 2 blocks local
    D.update_state_after_alloc(rd, [40, 41, 7, 8, 9], len(PROMPT) - 8)
    meta = D.build_connector_meta()
    # prefill's blocks 3, 4, 5 into decode's new blocks 7, 8, 9: never into 40, 41
    assert read_runs(meta) == [(3, 7, 3)]
    planned = pair.of(ev.TransferPlanned, instance="D")[0]
    assert planned.dst_blocks == (7, 8, 9) and planned.num_tokens == len(PROMPT) - 8
    assert D.get_num_new_matched_tokens(rd, 3) == (0, False)  # tried once; also unaligned


def test_push_with_a_decode_prefix_hit_writes_only_new_blocks() -> None:
    pair = Pair()
    P = pair.half("P")
    D = pair.half("D")
    rd = request("phit-d", push_decode_leg("phit"), PROMPT)
    D.on_new_request(rd)
    n, _ = D.get_num_new_matched_tokens(rd, 4)
    assert n == len(PROMPT) - 4
    D.update_state_after_alloc(rd, [40, 7, 8, 9, 10], n)
    meta = pair.step("D")
    reg = decode_notif(meta.orders[0].notify)
    assert reg is not None and reg[1]["blocks"] == [40, 7, 8, 9, 10] and reg[1]["skip"] == 1
    run_prefill(pair, "phit", PROMPT, [1, 2, 3, 4, 5], mode="push")
    meta = P.build_connector_meta()
    assert [o.kind for o in meta.orders] == ["write"]
    assert read_runs(meta) == [(2, 7, 4)]  # never block 40
    del P


def test_unaligned_local_hit_computes_locally() -> None:
    pair = Pair()
    pair.half("P")
    D = pair.half("D")
    _, (_, params) = run_prefill(pair, "odd", PROMPT, [1, 2, 3, 4, 5])
    rd = request("odd-d", params, PROMPT)
    D.on_new_request(rd)
    assert D.get_num_new_matched_tokens(rd, 6) == (0, False)


def test_forged_or_replayed_pull_handles_are_not_read() -> None:
    key = b"unit-test-key-0123456789abcdef"
    pair = Pair()
    pair.half("P", key=key)
    D = pair.half("D", key=key)
    _, (_, params) = run_prefill(pair, "sig", PROMPT, [1, 2, 3, 4, 5])
    assert isinstance(params["kvplane"]["pull"]["sig"], str)
    forged = json.loads(json.dumps(params))
    forged["kvplane"]["pull"]["blocks"] = [60, 61, 62, 63, 64]  # another tenant's blocks
    unsigned = json.loads(json.dumps(params))
    del unsigned["kvplane"]["pull"]["sig"]
    for i, bad in enumerate((forged, unsigned)):
        rd = request(f"bad-{i}", bad, PROMPT)
        D.on_new_request(rd)
        assert D.get_num_new_matched_tokens(rd, 0) == (0, False)
    pair.clock.now += 31  # past the hold: a stolen handle is refused as expired too
    late = request("late", json.loads(json.dumps(params)), PROMPT)
    D.on_new_request(late)
    assert D.get_num_new_matched_tokens(late, 0) == (0, False)
    assert not pair.of(ev.TransferPlanned, instance="D")
    reasons = [e.reason for e in pair.of(ev.KVLoadFailed, instance="D")]
    assert len(reasons) == 3 and "forged or altered" in reasons[0]
    assert "no signature" in reasons[1] and "expired" in reasons[2]


def test_a_core_refusal_inside_a_hook_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvplane.core.errors import ProtocolError

    pair = Pair()
    pair.half("P")
    D = pair.half("D")
    _, (_, params) = run_prefill(pair, "boom", PROMPT, [1, 2, 3, 4, 5])

    def refuse(cmd: Any, now: float) -> list[ev.Event]:
        raise ProtocolError("decode", "absent", type(cmd).__name__, "any message at all")

    monkeypatch.setattr(D.decode, "handle", refuse)
    rd = request("boom-d", params, PROMPT)
    D.on_new_request(rd)
    n, load = D.get_num_new_matched_tokens(rd, 0)
    assert load
    D.update_state_after_alloc(rd, [7, 8, 9, 10, 11], n)  # no exception escapes
    meta = D.build_connector_meta()
    assert rd.request_id in meta.failed_recving and rd.request_id in meta.finished_recving
    assert any("refused ExpectKV" in e.reason for e in pair.of(ev.KVLoadFailed, instance="D"))


def test_wall_answers_when_a_hook_raises() -> None:
    pair = Pair()
    P = pair.half("P")
    rp = request("w-p", prefill_leg("w"), PROMPT, 1)
    P.on_new_request(rp)
    P.hook_failed("get_num_new_matched_tokens", RuntimeError("x"), rp)
    assert "w-p" not in P.reqs  # goes on as a plain request
    P.alloc_failed(rp, 8)  # vLLM waits for a load we never ordered: reported failed
    meta = P.build_connector_meta()
    assert "w-p" in meta.failed_recving and "w-p" in meta.finished_recving
    assert P.finish_failed(rp) == (False, None)
    assert pair.of(ev.KVLoadFailed, request="w")


def test_router_gives_back_a_hold_decode_refused() -> None:
    key = b"unit-test-key-0123456789abcdef"
    pair = Pair()
    P = pair.half("P", key=key)
    rp, (_, params) = run_prefill(pair, "un", PROMPT, [1, 2, 3, 4, 5])
    pull = params["kvplane"]["pull"]
    assert P._control_request("unhold/" + json.dumps({**pull, "blocks": [9]})) is None
    reply = P._control_request("unhold/" + json.dumps(pull))
    assert json.loads(reply or b"{}")["released"] is True
    assert rp.request_id in P.build_connector_meta().finished_sending
    pair.replay_ok()


def test_config_refuses_unknown_keys_and_a_key_in_the_config(tmp_path: Any,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    from kvplane.live.connector_config import load_handle_key

    with pytest.raises(ValueError, match=r"unknown key\(s\) 'bidirectional', 'mode'.*known "
                                         r"keys: .*bidirectional_kv_xfer"):
        ConnectorConfig.from_extra({"mode": "push", "bidirectional": True})
    with pytest.raises(ValueError, match="KVPLANE_HANDLE_KEY"):
        ConnectorConfig.from_extra({"handle_key": "secret"})
    monkeypatch.delenv("KVPLANE_HANDLE_KEY", raising=False)
    f = tmp_path / "key"
    f.write_text("from-a-file\n")
    cfg = ConnectorConfig.from_extra({"handle_key_file": str(f)})
    assert load_handle_key(cfg) == b"from-a-file"
    monkeypatch.setenv("KVPLANE_HANDLE_KEY", "from-env")
    assert load_handle_key(cfg) == b"from-env"
    assert "from-env" not in repr(cfg) and "from-a-file" not in repr(cfg)
    assert ConnectorConfig.from_extra({"backends": ["UCX"]}).backends == ("UCX",)


def test_config_warns_when_a_pull_pin_would_outlive_the_lease(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="kvplane.live.connector_config"):
        ConnectorConfig.from_extra({"kv_lease_duration": 10.0, "transfer_timeout": 20.0})
    assert any("refuses every pull READ" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="kvplane.live.connector_config"):
        ConnectorConfig.from_extra({})  # the defaults: 20 s below 30 s
    assert not caplog.records


def test_a_read_pins_the_lease_it_reads_under() -> None:
    key = b"unit-test-key-0123456789abcdef"
    pair = Pair()
    P = pair.half("P", key=key)
    rp, (_, params) = run_prefill(pair, "pin", PROMPT, [1, 2, 3, 4, 5])
    pull = params["kvplane"]["pull"]
    body = {"kind": "pull", "handle": pull, "reader": "D/pin#0", "duration": 5.0}
    assert P._control_request("pin/" + json.dumps({**body, "handle": {**pull, "lease": "x"}})) \
        is None  # altered: refused
    assert json.loads(P._control_request("pin/" + json.dumps(body)) or b"{}")["pin"] is True
    from kvplane.core.signing import sign

    P.on_fact(Fact("notif", "pin", 0, pair.clock(), notif="READ",  # decode's READ is done
                   body=sign(key, {"xfer": "pin", "attempt": 0, "kind": "READ"})))
    assert rp.request_id not in P.build_connector_meta().finished_sending  # still pinned
    assert P._control_request("unpin/" + json.dumps(body)) is not None
    assert rp.request_id in P.build_connector_meta().finished_sending
    late = {**body, "reader": "D/other#0"}
    assert P._control_request("pin/" + json.dumps(late)) is None  # the lease is gone
    assert pair.of(ev.LeasePinned, instance="P") and pair.of(ev.LeaseUnpinned, instance="P")
    pair.replay_ok()


def test_notifications_are_signed_and_forged_ones_dropped() -> None:
    key = b"unit-test-key-0123456789abcdef"
    pair = Pair()
    pair.half("P", key=key)
    D = pair.half("D", key=key)
    rd = request("nf-d", push_decode_leg("nf"), PROMPT)
    D.on_new_request(rd)
    n, _ = D.get_num_new_matched_tokens(rd, 0)
    D.update_state_after_alloc(rd, [7, 8, 9, 10, 11], n)
    meta = D.build_connector_meta()
    reg = decode_notif(meta.orders[0].notify)
    assert reg is not None and isinstance(reg[1]["sig"], str)
    # someone inside the network claims prefill has written decode's blocks
    for body in ({"xfer": "nf", "attempt": 0, "src_rank": 0, "dst_rank": 0},
                 {"xfer": "nf", "attempt": 0, "src_rank": 0, "dst_rank": 0, "sig": "00"}):
        D.on_fact(Fact("notif", "nf", 0, pair.clock(), notif="DONE", body=body))
    assert not pair.of(ev.KVReceived, instance="D")
    assert len([e for e in pair.of(ev.KVLoadFailed) if "DONE notification refused" in e.reason]) \
        == 2
    # the real exchange still completes
    pair.halves["P"].on_fact(Fact("notif", "nf", 0, pair.clock(), notif="REG", body=reg[1]))
    run_prefill(pair, "nf", PROMPT, [1, 2, 3, 4, 5], mode="push")
    pair.step("P")
    assert rd.request_id in pair.step("D").finished_recving
    assert pair.of(ev.KVReceived, instance="D")


# ---- one rule book: the simulator decides through the same core functions ------------------------


def _sim_chat_run() -> list[ev.Event]:
    """A small bidirectional chat scenario through the simulator (kvplane.sim)."""
    from kvplane.sim.config import scenario_from_data
    from kvplane.sim.runner import simulate

    sc = scenario_from_data({
        "name": "rules", "seed": 3, "requests": 12, "warmup_requests": 0,
        "profiles": {"model": "qwen3-32b", "hardware": "p5en-h200-tp8"},
        "connector": {"mode": "pull", "bidirectional": True,
                      "prefix_caching": {"prefill": False, "decode": False}},
        "workload": {"kind": "multi_turn", "conversation_rate": 0.5,
                     "turns": {"mean": 3, "dist": "fixed"},
                     "first_prompt": {"mean": 1024, "dist": "fixed"},
                     "user_tokens": {"mean": 128, "dist": "fixed"},
                     "output_len": {"mean": 32, "dist": "fixed"}, "think_time_s": 1.0},
    }, file="<test>")
    log: list[ev.Event] = []
    _sim, summary = simulate(sc.points()[0], log.append)
    assert summary["finished"] == summary["submitted"]
    return log


def test_sim_and_live_retain_for_the_ttl_the_core_rule_gives(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Change `connector_rules.retain_ttl` and both the live connector's retained lease and
    the simulator's change with it: neither makes the decision itself."""
    from kvplane.core import connector_rules

    def retained_ttls() -> tuple[set[float], set[float]]:
        pair = Pair()
        pair.half("P")
        pair.half("D", decoder_kv_blocks_ttl=300)
        retained_turn(pair, "t1", [5, 6, 7, 8, 9, 10])
        live = {round(e.expires_at - e.at, 6) for e in pair.of(ev.LeaseGranted, instance="D",
                                                                purpose="retained")}
        sim = {round(e.expires_at - e.at, 6) for e in _sim_chat_run()
               if isinstance(e, ev.LeaseGranted) and e.purpose == "retained"}
        assert live and sim
        return live, sim

    live, sim = retained_ttls()
    assert live == {300.0} and len(sim) == 1 and 7.0 not in sim  # each instance's own TTL
    monkeypatch.setattr(connector_rules, "retain_ttl", lambda default, requested, floor=0: 7.0)
    assert retained_ttls() == ({7.0}, {7.0})


def test_sim_and_live_take_load_and_turn_decisions_from_the_core(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The load window, the reuse read's blocks and the router's end-of-turn rule are called
    by both drivers (spied on), and a changed end-of-turn rule changes what the simulator's
    router does."""
    from kvplane.core import connector_rules, router_rules

    calls: dict[str, list[str]] = {}

    def spy(module: Any, name: str, who: list[str]) -> None:
        real = getattr(module, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls.setdefault(name, []).append(who[0])
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    who = ["live"]
    for name in ("decode_load", "reuse_read", "retain_decision"):
        spy(connector_rules, name, who)
    spy(router_rules, "after_turn", who)
    pair = Pair()
    pair.half("P")
    pair.half("D")
    handle = retained_turn(pair, "t1", [5, 6, 7, 8, 9, 10])
    run_pull(pair, "t2", PROMPT + [5, 6, 7, 8, 9, 10, 40, 41, 42, 43, 44, 45, 46, 47, 48],
             list(range(20, 29)), list(range(30, 40)), [1, 2], reuse=handle)
    who[0] = "sim"
    log = _sim_chat_run()
    for name in ("decode_load", "reuse_read", "retain_decision"):
        assert {"live", "sim"} <= set(calls[name]), f"{name}: {set(calls[name])}"
    assert "sim" in calls["after_turn"]  # the live router's use: tests/live/test_router*.py
    superseded = [e for e in log if isinstance(e, ev.LeaseReleased) and e.reason == "superseded"]
    assert superseded  # each later turn's new KV replaced the one it read
    monkeypatch.setattr(router_rules, "after_turn", lambda **_: "drop")
    log = _sim_chat_run()
    assert not [e for e in log if isinstance(e, ev.LeaseReleased) and e.reason == "superseded"]
    assert [e for e in log if isinstance(e, ev.LeaseExpired)]  # left to run out instead


def test_preempted_decode_with_a_prefix_hit_recomputes_into_its_own_blocks() -> None:
    """vLLM preempts a decode request that loaded its KV past a local hit, frees its blocks and
    schedules it again from scratch, with a new local hit. The re-schedule loads nothing (the
    one transfer was done), and the blocks of its new hit (shared with other requests) are
    never counted as its own."""
    pair = Pair()
    pair.half("P")
    D = pair.half("D")
    _, (_, params) = run_prefill(pair, "pre", PROMPT, [1, 2, 3, 4, 5])
    rd = request("pre-d", params, PROMPT)
    D.on_new_request(rd)
    assert D.get_num_new_matched_tokens(rd, 8) == (len(PROMPT) - 8, True)
    D.update_state_after_alloc(rd, [40, 41, 7, 8, 9], len(PROMPT) - 8)
    pair.step("D")
    assert rd.request_id in pair.step("D").finished_recving
    rd.num_preemptions, rd.num_computed_tokens = 1, 0  # vLLM preempted it
    assert D.get_num_new_matched_tokens(rd, 8) == (0, False)  # no second load
    D.update_state_after_alloc(rd, [50, 51, 60, 61, 62, 63], 0)
    again = [e for e in pair.of(ev.BlocksReserved, instance="D") if e.attempt == 1]
    assert again and all(not {50, 51} & set(e.blocks) for e in again)
    assert len(pair.of(ev.TransferPlanned, instance="D")) == 1
    finish(rd, len(PROMPT) + 3, [1, 2, 3, 4])
    assert D.request_finished(rd, [50, 51, 60, 61, 62, 63]) == (False, None)
    pair.replay_ok()


def test_prefill_with_a_local_hit_reads_only_the_rest_of_the_retained_kv() -> None:
    """Prefix caching on prefill: its own cache has the first 2 blocks of turn 2, decode's
    retained KV has 5; prefill reads blocks 3 to 5 (12 tokens) into its blocks after the hit,
    from the retained blocks at the same positions, and computes the rest. Asked again with
    another hit, it decides again."""
    pair = Pair()
    P = pair.half("P")
    pair.half("D")
    out1 = [5, 6, 7, 8, 9, 10]
    handle = retained_turn(pair, "t1", out1)
    prompt2 = PROMPT + out1 + [40, 41, 42, 43, 44, 45, 46, 47, 48]
    rp = request("t2-p", prefill_leg("t2", reuse=handle), prompt2, 1)
    P.on_new_request(rp)
    assert P.get_num_new_matched_tokens(rp, 0) == (20, True)  # no hit: 5 blocks
    assert P.get_num_new_matched_tokens(rp, 8) == (12, True)  # 2 blocks of its own
    blocks = list(range(20, 27))
    P.update_state_after_alloc(rp, blocks, 12)
    pair.step("P")
    read = pair.of(ev.TransferPlanned, direction="D->P")
    assert len(read) == 1 and read[0].num_tokens == 12
    assert read[0].dst_blocks == (22, 23, 24)  # never 20, 21 (its own hit)
    assert read[0].src_blocks == tuple(handle["blocks"][2:5])
    started = pair.of(ev.PrefillStarted, request="t2")[0]
    assert (started.cached_tokens, started.computed_tokens) == (20, len(prompt2) - 20)


def test_sim_and_live_number_a_recompute_by_the_core_rule(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`connector_rules.next_attempt` numbers the local compute after a preemption (live) and
    after a failed load (live and simulator): change it, and both number it so."""
    from kvplane.core import connector_rules
    from kvplane.sim.config import scenario_from_data
    from kvplane.sim.runner import simulate

    monkeypatch.setattr(connector_rules, "next_attempt", lambda attempt: attempt + 7)
    pair = Pair()
    pair.half("P")
    D = pair.half("D")
    _, (_, params) = run_prefill(pair, "n7", PROMPT, [1, 2, 3, 4, 5])
    rd = request("n7-d", params, PROMPT)
    D.on_new_request(rd)
    D.update_state_after_alloc(rd, [7, 8, 9, 10, 11], D.get_num_new_matched_tokens(rd, 0)[0])
    pair.step("D")
    pair.step("D")
    rd.num_preemptions, rd.num_computed_tokens = 1, 0
    D.get_num_new_matched_tokens(rd, 0)
    D.update_state_after_alloc(rd, [20, 21, 22, 23, 24], 0)
    assert {e.attempt for e in pair.of(ev.BlocksReserved, instance="D")} == {0, 7}

    sc = scenario_from_data({
        "name": "n7", "seed": 1, "requests": 6, "warmup_requests": 0,
        "profiles": {"model": "qwen3-32b", "hardware": "p5en-h200-tp8"},
        "connector": {"mode": "pull", "pull_hold_lease_s": 0.001},
        "workload": {"kind": "poisson", "qps": 2, "input_len": {"mean": 512, "dist": "fixed"},
                     "output_len": {"mean": 16, "dist": "fixed"}}}, file="<test>")
    log: list[ev.Event] = []
    simulate(sc.points()[0], log.append)
    failed = [e for e in log if isinstance(e, ev.KVLoadFailed)]
    assert failed
    assert {e.attempt for e in log if isinstance(e, ev.BlocksReserved)
            and e.instance.startswith("decode")} == {0, 7}


# ---- tensor parallelism and unequal block sizes: one order per rank stream -------------------


def test_pull_from_a_tp2_prefill_reads_per_stream_and_releases_once() -> None:
    pair = Pair()
    pair.half("P", layout=dataclasses.replace(LAYOUT, tp=2))
    D = pair.half("D", layout=dataclasses.replace(LAYOUT, block_size=8))
    _, (_, params) = run_prefill(pair, "tp", PROMPT, [1, 2, 3, 4, 5])
    rd = request("tp-d", params, PROMPT)
    D.on_new_request(rd)
    n, _ = D.get_num_new_matched_tokens(rd, 0)
    D.update_state_after_alloc(rd, [7, 8, 9], n)
    meta = D.build_connector_meta()
    reads = [o for o in meta.orders if o.kind == "read"]
    # decode's one rank reads head 0 from prefill rank 0 and head 1 from rank 1, token runs
    # across blocks of 4 (prefill) and 8 (decode); no "read" notice rides on either READ
    assert sorted((o.rank, o.peer_rank, o.heads) for o in reads) == [
        (0, 0, (0, 0, 1)), (0, 1, (0, 1, 1))]
    assert all(not o.notify for o in reads)
    assert reads[0].runs == ((4, 56, 16), (20, 72, 2)) or reads[0].runs[0][2] > 0
    first, second = reads
    D.on_fact(Fact("read_done", "tp", 0, pair.clock(), purpose="pull", rank=0,
                   peer_rank=first.peer_rank))
    assert not pair.of(ev.KVReceived, instance="D")  # one stream is not the transfer
    D.on_fact(Fact("read_done", "tp", 0, pair.clock(), purpose="pull", rank=0,
                   peer_rank=second.peer_rank))
    assert len(pair.of(ev.KVReceived, instance="D")) == 1
    notices = [o for o in D.build_connector_meta().orders if o.kind == "notify"]
    assert [o.purpose for o in notices] == ["read"] and notices[0].peer.instance == "P"
    parsed = decode_notif(notices[0].notify)
    assert parsed is not None and parsed[0] == "READ"
    pair.halves["P"].on_fact(Fact("notif", "tp", 0, pair.clock(), notif="READ", body=parsed[1]))
    assert pair.of(ev.LeaseReleased, instance="P")


def test_a_failed_stream_fails_the_pull_only_when_every_stream_ended() -> None:
    pair = Pair()
    pair.half("P", layout=dataclasses.replace(LAYOUT, tp=2))
    D = pair.half("D")
    _, (_, params) = run_prefill(pair, "tpf", PROMPT, [1, 2, 3, 4, 5])
    rd = request("tpf-d", params, PROMPT)
    D.on_new_request(rd)
    n, _ = D.get_num_new_matched_tokens(rd, 0)
    D.update_state_after_alloc(rd, [7, 8, 9, 10, 11], n)
    reads = [o for o in D.build_connector_meta().orders if o.kind == "read"]
    assert len(reads) == 2
    D.on_fact(Fact("read_done", "tpf", 0, pair.clock(), ok=False, reason="peer gone",
                   purpose="pull", peer_rank=reads[0].peer_rank))
    assert not pair.of(ev.KVLoadFailed, instance="D")  # the other READ still writes
    D.on_fact(Fact("read_done", "tpf", 0, pair.clock(), purpose="pull",
                   peer_rank=reads[1].peer_rank))
    failed = pair.of(ev.KVLoadFailed, instance="D")
    assert len(failed) == 1 and "peer gone" in failed[0].reason
    meta = D.build_connector_meta()
    assert rd.request_id in meta.failed_recving
    assert not [o for o in meta.orders if o.kind == "notify"]  # no "read" after a failure


def test_push_from_a_tp2_prefill_writes_per_rank_into_larger_blocks() -> None:
    pair = Pair()
    P = pair.half("P", layout=dataclasses.replace(LAYOUT, tp=2))
    D = pair.half("D", layout=dataclasses.replace(LAYOUT, block_size=8))
    rd = request("tpp-d", push_decode_leg("tpp", source_layout=P.layout), PROMPT)
    D.on_new_request(rd)
    n, _ = D.get_num_new_matched_tokens(rd, 0)
    D.update_state_after_alloc(rd, [7, 8, 9], n)
    pair.step("D")  # the registration reaches prefill
    rp, (delay, _) = run_prefill(pair, "tpp", PROMPT, [1, 2, 3, 4, 5], mode="push")
    assert delay is True
    meta = pair.step("P")  # two WRITEs, one per prefill rank, each with its DONE
    writes = [o for o in meta.orders if o.kind == "write"]
    assert sorted((o.rank, o.peer_rank, o.heads) for o in writes) == [
        (0, 0, (0, 0, 1)), (1, 0, (0, 1, 1))]
    assert all(o.runs == writes[0].runs for o in writes)
    assert sum(r[2] for r in writes[0].runs) == len(PROMPT)  # every token once
    assert len(pair.of(ev.TransferCompleted, instance="P")) == 1
    assert len(pair.of(ev.KVReceived, instance="D")) == 1  # after both DONEs
    assert rp.request_id in pair.step("P").finished_sending
    assert rd.request_id in pair.step("D").finished_recving
    finish(rd, len(PROMPT) + 2, [1, 2, 3])
    assert D.request_finished(rd, [7, 8, 9]) == (False, None)
    pair.replay_ok()


def test_a_push_leg_without_prefills_layout_is_refused_by_a_prefill_of_other_tp() -> None:
    """Decode counts one DONE per stream of the layout it assumes (its own): a TP 2 prefill
    would finish that count before all its ranks' WRITEs landed, so it refuses to WRITE."""
    pair = Pair()
    pair.half("P", layout=dataclasses.replace(LAYOUT, tp=2))
    D = pair.half("D")
    rd = request("tpn-d", push_decode_leg("tpn"), PROMPT)
    D.on_new_request(rd)
    n, _ = D.get_num_new_matched_tokens(rd, 0)
    D.update_state_after_alloc(rd, [7, 8, 9, 10, 11], n)
    pair.step("D")  # the registration reaches prefill, which answers FAIL at once
    run_prefill(pair, "tpn", PROMPT, [1, 2, 3, 4, 5], mode="push")
    assert not [o for o in pair.step("P").orders if o.kind == "write"]
    failed = pair.of(ev.KVLoadFailed, instance="D")
    assert failed and "expects a prefill of TP 1, this one has TP 2" in failed[0].reason
    assert rd.request_id in pair.step("D").failed_recving


def test_transfer_stats_count_fallbacks_through_vllms_stats_objects() -> None:
    """A transfer that went by another method than the estimate chose reaches vLLM's metrics
    as `kvplane_fallbacks` (the Prometheus counter vllm:kvplane_transfer_fallbacks)."""
    from kvplane.live.connector import KvplaneStats
    from kvplane.live.connector_worker import Stats

    a = Stats(bytes=[100], descriptors=[2], seconds=[0.01], ops=["write"], fallbacks=1)
    b = Stats(bytes=[50, 70], descriptors=[1, 1], seconds=[0.01, 0.02], ops=["read", "read"],
              failed=1)
    total = KvplaneStats(data=a.to_dict()).aggregate(KvplaneStats(data=b.to_dict()))
    reduced = total.reduce()
    assert reduced["kvplane_transfers"] == 3 and reduced["kvplane_bytes"] == 220
    assert reduced["kvplane_failed"] == 1 and reduced["kvplane_fallbacks"] == 1
    assert KvplaneStats(data={}).reduce()["kvplane_fallbacks"] == 0  # a fresh interval
