"""End to end: clients -> `kvplane router` -> real vLLM prefill and decode with KvplaneConnector.

One prefill and one decode server (CPU build, KvplaneConnector, real NIXL over UCX) and one
plain server as the reference are started once for the module; the real router runs in front of
prefill and decode as a subprocess (`kvplane router ...`, the installed command), recording
into the same SQLite store and run as the connectors. The connector advertises both wire modes
(`settings.modes` pull/push), so one server pair serves every router mode: the router is
restarted when a test needs another mode (about two seconds), never the servers.

What is checked, through the router's OpenAI API only:
- for pull, push and bidirectional: /v1/completions and /v1/chat/completions, streamed and not,
  give the plain server's greedy output token for token, and decode really took the prompt's
  KV from prefill (its `external_kv_transfer` prompt tokens grow by exactly the prompts);
- bidirectional: a later turn of a conversation (same `conversation_id`) reads decode's
  retained KV (the router's reuse counters, prefill's `ReuseDecided` "read" and its
  `external_kv_transfer` tokens) and still matches the plain server on the whole prompt; an
  edited history is not reused; a chat conversation reuses too;
- the router SIGKILLed mid-conversation and started again on the same store serves the next turn
  with reuse (its conversation table is rebuilt from the recorded `Session*` events, decode's
  full handle is asked of decode's side channel);
- everything recorded (router and both connectors, merged by time) replays through
  kvplane.core.replay with no violation.

Handles are signed: the router and both connectors share one HMAC key. Nothing asserts a
duration; time-outs are generous (2 shared cores). Never skipped: without vLLM or NIXL the
module fails and says how to install them.
"""

from __future__ import annotations

import json
import random
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import kvplane_live_servers as _servers
import kvplane_live_tiny_model as tiny_model
import pytest

from kvplane.core import events as ev
from kvplane.core.replay import replay

VllmServer = _servers.VllmServer
start_all, stop_all, free_port = _servers.start_all, _servers.stop_all, _servers.free_port
only, settled = _servers.only, _servers.settled
MODEL = _servers.MODEL_NAME
tiny_model_dir = tiny_model.tiny_model_dir

pytestmark = [pytest.mark.live, pytest.mark.timeout(900)]

MAX_TOKENS = 24
THRESHOLD = 64
BLOCK = 32  # --block-size in servers.py
HANDLE_KEY = "e2e-router-handle-key-0123456789abcdef"


# ---- the router, as a process -------------------------------------------------------------------


RouterProcess = _servers.RouterProcess


# ---- the cluster --------------------------------------------------------------------------------


Cluster = _servers.PdCluster


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    cfg = {"kv_recompute_threshold": THRESHOLD, "decoder_kv_blocks_ttl": 120,
           "lease_renewable": True, "lease_extension": 200}
    with _servers.pd_cluster("e2e", cfg, handle_key=HANDLE_KEY) as c:
        yield c


# ---- requests -----------------------------------------------------------------------------------


prompt = _servers.prompt


def chat_text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    vocab = ["def", "return", "self", "value", "import", "class", "None", "for", "in", "if",
             "else", "while", "lambda", "yield", "data", "index", "key", "error", "list", "x"]
    return " ".join(rng.choice(vocab) for _ in range(words))


@dataclass
class Answer:
    token_ids: list[int]
    text: str
    xfer: str  # the router's X-Request-Id: the transfer id every instance recorded under
    prompt_tokens: int | None


def ask(url: str, *, chat: bool, stream: bool, payload: dict[str, Any],
        conversation: str | None = None, max_tokens: int = MAX_TOKENS) -> Answer:
    """One greedy request; the output's token ids (vLLM's `return_token_ids`) and text."""
    body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0.0,
                            "ignore_eos": True, "return_token_ids": True, "stream": stream,
                            **payload}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if conversation is not None:
        body["conversation_id"] = conversation
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if not stream:
        r = httpx.post(url + path, json=body, timeout=120)
        assert r.status_code == 200, f"{url}{path}: HTTP {r.status_code}: {r.text[:500]}"
        data = r.json()
        routed = r.headers.get("x-request-id", "").startswith("kvp-")
        # the router drops the field; a plain vLLM server answers it as null
        assert not routed or "kv_transfer_params" not in data, "the router leaked the params"
        choice = data["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
        return Answer(list(choice.get("token_ids") or []), text or "",
                      r.headers.get("x-request-id", ""), data["usage"]["prompt_tokens"])
    ids: list[int] = []
    text, usage, done = "", None, False
    with httpx.stream("POST", url + path, json=body, timeout=120) as r:
        assert r.status_code == 200, f"{url}{path}: HTTP {r.status_code}: {r.read()[:500]!r}"
        xfer = r.headers.get("x-request-id", "")
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            data_s = line[5:].strip()
            if data_s == "[DONE]":
                done = True
                continue
            obj = json.loads(data_s)
            assert not xfer.startswith("kvp-") or "kv_transfer_params" not in obj, \
                "the router leaked kv_transfer_params"
            assert "error" not in obj, f"error event in the stream: {obj}"
            usage = obj.get("usage") or usage
            for c in obj.get("choices") or []:
                ids += c.get("token_ids") or []
                if chat:
                    text += (c.get("delta") or {}).get("content") or ""
                else:
                    text += c.get("text") or ""
    assert done, "the stream ended without [DONE]"
    return Answer(ids, text, xfer, usage["prompt_tokens"] if usage else None)



def ext_tokens(server: VllmServer, source: str = "external_kv_transfer") -> float:
    return server.metric("vllm:prompt_tokens_by_source_total", source=source)


def same_as_plain(c: Cluster, got: Answer, *, chat: bool, payload: dict[str, Any],
                  max_tokens: int = MAX_TOKENS) -> Answer:
    ref = ask(c.single.url, chat=chat, stream=False, payload=payload, max_tokens=max_tokens)
    assert len(ref.token_ids) == max_tokens
    assert got.token_ids == ref.token_ids, (
        f"{got.xfer}: output through the router differs from the plain server's\n"
        f"  router: {got.token_ids}\n  plain:  {ref.token_ids}")
    assert got.text == ref.text
    return ref


# ---- 1. every mode, every endpoint: the plain server's output, KV moved P->D --------------------


KINDS = [(False, False), (False, True), (True, False), (True, True)]  # (chat, stream)


@pytest.mark.parametrize("mode", ["pull", "push", "bidirectional"])
def test_router_output_equals_plain_server(cluster: Cluster, mode: str) -> None:
    url = cluster.router.use(mode)
    ext0 = ext_tokens(cluster.decode)
    ok0 = sum(cluster.router.metric("kvplane_router_requests_total", endpoint=e, mode=mode,
                                    status="200") for e in ("completions", "chat"))
    prompts, xfers, outputs = 0, [], []
    for i, (chat, stream) in enumerate(KINDS):
        seed = 1000 * (1 + ["pull", "push", "bidirectional"].index(mode)) + i
        payload: dict[str, Any] = (
            {"messages": [{"role": "system", "content": "be brief"},
                          {"role": "user", "content": chat_text(seed, 60)}]}
            if chat else {"prompt": prompt(seed, 60 + 40 * i)})
        got = ask(url, chat=chat, stream=stream, payload=payload)
        assert got.xfer.startswith("kvp-"), "the router's answer has no X-Request-Id"
        ref = same_as_plain(cluster, got, chat=chat, payload=payload)
        assert got.prompt_tokens in (None, ref.prompt_tokens)
        assert ref.prompt_tokens is not None
        prompts += ref.prompt_tokens
        xfers.append((got.xfer, ref.prompt_tokens))
        outputs.append(tuple(ref.token_ids))
    assert len(set(outputs)) == len(outputs), "the model ignores its prompt: the test is blind"

    # decode took every prompt token from prefill (no silent recompute behind equal outputs)
    settled(lambda: ext_tokens(cluster.decode) - ext0, prompts,
            f"{mode}: decode's external_kv_transfer prompt tokens")
    wire = "push" if mode == "push" else "pull"
    for xfer, n in xfers:
        evs = cluster.wait_for(xfer, ev.KVReceived, instance="decode")
        routed = only(evs, ev.RequestRouted, instance="router")
        assert len(routed) == 1 and routed[0].mode == wire
        assert routed[0].bidirectional == (mode == "bidirectional")
        assert only(evs, ev.KVReceived, instance="decode")[0].num_tokens == n
        # who planned the P->D transfer says which mode really ran: decode READs (pull),
        # prefill WRITEs (push)
        mover = "prefill" if mode == "push" else "decode"
        assert only(evs, ev.TransferPlanned, instance=mover, direction="P->D"), xfer
        if mode == "push":
            assert only(evs, ev.RendezvousMatched, instance="prefill")
            assert not only(evs, ev.MetadataRelayed)
        else:
            assert only(evs, ev.MetadataRelayed, instance="router")
        assert only(evs, ev.FirstTokenEmitted, instance="router")
        finished = only(evs, ev.RequestFinished, instance="router")
        assert finished and finished[0].ok and finished[0].output_tokens == MAX_TOKENS
    ok = sum(cluster.router.metric("kvplane_router_requests_total", endpoint=e, mode=mode,
                                   status="200") for e in ("completions", "chat"))
    assert ok - ok0 == len(KINDS)
    assert cluster.router.metric("kvplane_router_transfers_total", mode=mode,
                                 direction="P->D") >= len(KINDS)


# ---- 2. bidirectional: later turns read decode's KV ---------------------------------------------


def _reuse_of(c: Cluster, xfer: str) -> list[ev.Event]:
    """A reusing turn's events, once decode got its prompt KV (the turn is complete)."""
    evs = c.wait_for(xfer, ev.KVReceived, instance="decode")
    assert only(evs, ev.SessionTaken, instance="router"), f"{xfer}: the router took no handle"
    return evs


def test_next_turn_reads_decodes_kv_and_matches_plain_server(cluster: Cluster) -> None:
    url = cluster.router.use("bidirectional")
    conv = f"conv-{uuid.uuid4().hex[:8]}"
    hits0 = cluster.router.metric("kvplane_router_reuse_hits_total")
    ext0 = ext_tokens(cluster.prefill)
    local0 = ext_tokens(cluster.prefill, "local_compute")

    # turn 1 streamed: the router gets decode's handle from decode's side channel
    p1 = prompt(1, 120)
    a1 = ask(url, chat=False, stream=True, payload={"prompt": p1}, conversation=conv)
    same_as_plain(cluster, a1, chat=False, payload={"prompt": p1})
    evs1 = cluster.wait_for(a1.xfer, ev.SessionStored, instance="router")
    stored = only(evs1, ev.SessionStored, instance="router")
    assert len(stored) == 1 and stored[0].conversation == conv
    assert only(evs1, ev.SessionMissed, instance="router")

    # turns 2 and 3: the whole history plus a new message; prefill reads what decode retained
    history, total_read = p1 + a1.token_ids, 0
    for turn, stream in ((2, False), (3, True)):
        p = history + prompt(10 + turn, 40)
        local_before = ext_tokens(cluster.prefill, "local_compute")
        a = ask(url, chat=False, stream=stream, payload={"prompt": p}, conversation=conv)
        same_as_plain(cluster, a, chat=False, payload={"prompt": p})
        reusable = (len(history) - 1) // BLOCK * BLOCK  # decode keeps all but the last token
        evs = _reuse_of(cluster, a.xfer)
        decided = only(evs, ev.ReuseDecided, instance="prefill")
        assert len(decided) == 1 and decided[0].outcome == "read", decided
        assert decided[0].remote_tokens == reusable
        read = only(evs, ev.TransferPlanned, instance="prefill", direction="D->P")
        assert len(read) == 1 and read[0].src == "decode" and read[0].num_tokens == reusable
        assert only(evs, ev.TransferCompleted, instance="prefill", direction="D->P")
        assert only(evs, ev.PrefillStarted, instance="prefill")[0].computed_tokens == \
            len(p) - reusable
        settled(lambda b=local_before: ext_tokens(cluster.prefill, "local_compute") - b,
                len(p) - reusable,
                f"turn {turn}: prefill's local_compute tokens")
        total_read += reusable
        history = p + a.token_ids
    settled(lambda: ext_tokens(cluster.prefill) - ext0, total_read,
            "prefill's external_kv_transfer tokens")
    assert ext_tokens(cluster.prefill, "local_compute") - local0 < len(history)
    assert cluster.router.metric("kvplane_router_reuse_hits_total") - hits0 == 2
    assert cluster.router.metric("kvplane_router_transfers_total", mode="bidirectional",
                                 direction="D->P") >= 2


def test_chat_conversation_reuses_decodes_kv(cluster: Cluster) -> None:
    url = cluster.router.use("bidirectional")
    conv = f"chat-{uuid.uuid4().hex[:8]}"
    m1 = [{"role": "user", "content": chat_text(7, 120)}]
    a1 = ask(url, chat=True, stream=False, payload={"messages": m1}, conversation=conv)
    same_as_plain(cluster, a1, chat=True, payload={"messages": m1})
    assert a1.prompt_tokens is not None and a1.prompt_tokens >= 2 * THRESHOLD
    cluster.wait_for(a1.xfer, ev.SessionStored, instance="router")
    m2 = m1 + [{"role": "assistant", "content": a1.text},
               {"role": "user", "content": chat_text(8, 30)}]
    a2 = ask(url, chat=True, stream=True, payload={"messages": m2}, conversation=conv)
    same_as_plain(cluster, a2, chat=True, payload={"messages": m2})
    decided = only(_reuse_of(cluster, a2.xfer), ev.ReuseDecided, instance="prefill")
    # the template renders turn 1's prompt as a prefix of turn 2's: at least its whole blocks
    # match (the answer re-tokenized from text may not)
    assert len(decided) == 1 and decided[0].outcome == "read", decided
    assert decided[0].remote_tokens >= a1.prompt_tokens // BLOCK * BLOCK


def test_edited_history_is_not_reused(cluster: Cluster) -> None:
    url = cluster.router.use("bidirectional")
    conv = f"edit-{uuid.uuid4().hex[:8]}"
    p1 = prompt(300, 120)
    a1 = ask(url, chat=False, stream=False, payload={"prompt": p1}, conversation=conv)
    cluster.wait_for(a1.xfer, ev.SessionStored, instance="router")
    edited = list(p1)
    edited[5] = (edited[5] + 1) % 1000 or 11  # an early edit: no block of the history matches
    p2 = edited + a1.token_ids + prompt(301, 40)
    ext0 = ext_tokens(cluster.prefill)
    a2 = ask(url, chat=False, stream=False, payload={"prompt": p2}, conversation=conv)
    same_as_plain(cluster, a2, chat=False, payload={"prompt": p2})
    evs = _reuse_of(cluster, a2.xfer)  # the router did hand the handle over...
    decided = only(evs, ev.ReuseDecided, instance="prefill")
    assert len(decided) == 1 and decided[0].outcome == "mismatch", decided  # ...prefill refused
    assert not only(evs, ev.TransferPlanned, direction="D->P")
    assert only(evs, ev.PrefillStarted, instance="prefill")[0].computed_tokens == len(p2)
    time.sleep(1.0)  # let a wrong increment show up, if there were one
    assert ext_tokens(cluster.prefill) == ext0


def test_router_restart_mid_conversation_keeps_reuse(cluster: Cluster) -> None:
    url = cluster.router.use("bidirectional")
    conv = f"restart-{uuid.uuid4().hex[:8]}"
    p1 = prompt(400, 150)
    a1 = ask(url, chat=False, stream=False, payload={"prompt": p1}, conversation=conv)
    same_as_plain(cluster, a1, chat=False, payload={"prompt": p1})
    # the router's recorder writes every 0.5 s: a crash before that would lose the turn
    assert only(cluster.wait_for(a1.xfer, ev.SessionStored, instance="router"),
                ev.SessionStored, conversation=conv)

    cluster.router.stop(signal.SIGKILL)  # a crash: no clean shutdown, nothing flushed
    cluster.router.start("bidirectional")
    assert cluster.router.health()["sessions"] >= 1
    assert "conversation(s) rebuilt" in cluster.router.log_tail()
    assert cluster.router.metric("kvplane_router_reuse_hits_total") == 0  # a new process

    p2 = p1 + a1.token_ids + prompt(401, 40)
    a2 = ask(url, chat=False, stream=True, payload={"prompt": p2}, conversation=conv)
    same_as_plain(cluster, a2, chat=False, payload={"prompt": p2})
    decided = only(_reuse_of(cluster, a2.xfer), ev.ReuseDecided, instance="prefill")
    assert len(decided) == 1 and decided[0].outcome == "read", decided
    assert decided[0].remote_tokens == (len(p1) + MAX_TOKENS - 1) // BLOCK * BLOCK
    assert cluster.router.metric("kvplane_router_reuse_hits_total") == 1


# ---- 3. the record --------------------------------------------------------------------------------


def test_recorded_run_replays_without_violation(cluster: Cluster) -> None:
    cluster.router.stop()  # a clean stop: the router's recorder flushes
    time.sleep(2)  # let the connectors' last transfers end and their recorders write
    evs = cluster.events()
    assert {"prefill", "decode", "router"} <= {e.instance for e in evs}
    kinds = {type(e).__name__ for e in evs}
    for needed in ("RequestArrived", "RequestRouted", "MetadataRelayed", "FirstTokenEmitted",
                   "RequestFinished", "SessionStored", "SessionTaken", "SessionMissed",
                   "RendezvousMatched", "TransferPlanned", "TransferCompleted", "KVReceived",
                   "LeaseGranted", "LeaseReleased", "LeaseRenewed", "ReuseDecided",
                   "BlocksReserved", "BlocksFreed"):
        assert needed in kinds, f"no {needed} recorded"
    report = replay(evs, final=True)
    assert report.ok, "\n".join(map(str, report.violations[:20]))
    # the router's view and the connectors' agree on which requests went through both
    routed = {e.request for e in evs if isinstance(e, ev.RequestRouted)}
    received = {e.request for e in evs if isinstance(e, ev.KVReceived)}
    assert routed and routed <= received
