"""Real vLLM P/D through vLLM's own engine paths: chunked prefill, preemption, re-issue, and
prefix caching on one side only (issue 9, "never wrong tokens").

One cluster per prefix-caching layout, started once and shared by every test of the layout
(servers.pd_cluster, the module fixture is parametrized by the layout):

- `prefill-caches`: prefill with prefix caching on, decode with it off;
- `decode-caches`: prefill with it off, decode with it on.

On both, every server (the plain reference too) runs with `--max-num-batched-tokens 64`, so a
prompt of several hundred tokens is prefilled in chunks, and decode's KV cache is cut to
`DECODE_BLOCKS` blocks (`--num-gpu-blocks-override`), so that a few long requests at once make
vLLM preempt on decode and recompute the preempted ones. Every test compares the greedy tokens
of P/D with the plain server's, token for token, in pull, push and (where it applies)
bidirectional mode, then checks from the recorded events that the KV moved as it should: decode
loads a request's KV at most once (never again into the blocks of a preempted request's
re-schedule), loads only the tokens past a local prefix hit, and a retried exchange (same
transfer id, next attempt) moves its KV once.

Nothing asserts a duration; waits are for recorded state.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import kvplane_live_servers as _servers
import pytest

from kvplane.core import events as ev

Side, complete = _servers.Side, _servers.complete
only = _servers.only

pytestmark = [pytest.mark.live, pytest.mark.timeout(900)]

BLOCK = 32  # --block-size in servers.py
CHUNK = 64  # --max-num-batched-tokens: a prefill step computes at most this many tokens
DECODE_BLOCKS = 24  # decode's whole KV cache: 768 tokens
MAX_TOKENS = 16

SEED = {"pull": 0, "push": 1000, "bidirectional": 2000}  # no two tests share a prompt
CHUNKED = ("--max-num-batched-tokens", str(CHUNK))
LAYOUTS = {
    "prefill-caches": (Side(prefix_caching=True),
                       Side(prefix_caching=False,
                            args=("--num-gpu-blocks-override", str(DECODE_BLOCKS)))),
    "decode-caches": (Side(prefix_caching=False),
                      Side(prefix_caching=True,
                           args=("--num-gpu-blocks-override", str(DECODE_BLOCKS)))),
}


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def cluster(request: pytest.FixtureRequest) -> Iterator[Any]:
    prefill, decode = LAYOUTS[request.param]
    cfg = {"kv_recompute_threshold": 64, "decoder_kv_blocks_ttl": 15, "transfer_timeout": 20.0,
           "kv_lease_duration": 120.0, "push_hold_timeout": 120.0}  # until decode has room
    with _servers.pd_cluster(f"paths-{request.param}", cfg, prefill=prefill, decode=decode,
                             common=Side(args=CHUNKED)) as c:
        c.layout = request.param  # which side caches, for the tests' expectations
        yield c


@pytest.fixture(autouse=True)
def _both_stay_up(cluster: Any) -> Iterator[None]:
    yield
    for s in (cluster.prefill, cluster.decode):
        assert s.alive(), f"{s.name} died:\n{s.log_tail()}"


prompt = _servers.prompt



def exchange(cluster: Any, mode: str, p: list[int], max_tokens: int = MAX_TOKENS,
             **kw: Any) -> list[int]:
    """Decode's tokens for `p` through the P/D pair (the router's contract, servers.PdClient)."""
    if mode == "pull":
        _, d = cluster.client.pull(p, max_tokens, **kw)
    else:
        _, d = cluster.client.push(p, max_tokens, **kw)
    return list(d.token_ids)


def loads(cluster: Any, xfer: str, mode: str) -> list[Any]:
    """Decode's KV loads of one exchange: its READs (pull) or its registrations (push)."""
    kind = ev.TransferPlanned if mode == "pull" else ev.RegistrationSent
    return only(cluster.wait_for(xfer, ev.KVReceived, instance="decode"), kind,
                instance="decode")


def metric(server: Any, name: str, **labels: str) -> float:
    return float(server.metric(name, **labels))


# ---- the servers are what the tests say they are -------------------------------------------------


def test_servers_run_chunked_prefill_and_the_caching_layout(cluster: Any) -> None:
    want = {"prefill-caches": ("prefill", "decode"), "decode-caches": ("decode", "prefill")}
    on, off = (getattr(cluster, n) for n in want[cluster.layout])
    assert "--enable-prefix-caching" in on.command()
    assert "--no-enable-prefix-caching" in off.command()
    for s in (cluster.prefill, cluster.decode, cluster.single):
        log = s.log_path.read_text(errors="replace")
        assert f"Chunked prefill is enabled with max_num_batched_tokens={CHUNK}" in log, s.name
    assert f"num_gpu_blocks_override={DECODE_BLOCKS}" in \
        cluster.decode.log_path.read_text(errors="replace")


# ---- 1. preemption on decode ----------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_preempted_decode_recomputes_and_never_reloads(cluster: Any, mode: str) -> None:
    """Four requests of 200 prompt and 300 output tokens at once need 64 blocks on decode,
    which has 24 (any two running together need 32): vLLM preempts some of them while they
    decode, frees their blocks and later schedules them again from scratch. Each answer must
    still be the plain server's, and decode must have loaded each request's KV once (the
    re-schedule computes locally). In pull, the four prefill legs run first, so the four
    decode legs reach decode together. In push each request's decode leg waits for its own
    prefill, and on a loaded host the four can reach decode far enough apart to run one after
    another: a round that preempted nothing is checked all the same and then tried again with
    new prompts (three rounds at most; the test fails if none preempts)."""
    preempted = 0
    for round_ in range(3):
        preempted = _preemption_round(cluster, mode, round_)
        if preempted >= 1:
            break
    assert preempted >= 1, "decode never preempted in three rounds: the test proves nothing"


def _preemption_round(cluster: Any, mode: str, round_: int) -> float:
    """One round of four requests at once; checks tokens and loads, returns the preemptions."""
    out = 300
    prompts = [prompt(SEED[mode] + 100 + 10 * round_ + i, 200) for i in range(4)]
    want = [cluster.reference(p, out) for p in prompts]
    before = metric(cluster.decode, "vllm:num_preemptions_total")
    xfers = [f"preempt-{mode}-{i}-{uuid.uuid4().hex[:6]}" for i in range(4)]
    if mode == "pull":
        legs = [complete(cluster.prefill.url, p, 1, {"do_remote_decode": True, "kvplane": {
            "v": 1, "mode": "pull", "xfer": x}}, request_id=x).kv_transfer_params
            for p, x in zip(prompts, xfers)]

        def one(i: int) -> list[int]:
            return list(complete(cluster.decode.url, prompts[i], out, legs[i],
                                 request_id=xfers[i]).token_ids)
    else:
        def one(i: int) -> list[int]:
            return exchange(cluster, mode, prompts[i], out, xfer=xfers[i])
    with cf.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(one, range(4)))
    preempted = metric(cluster.decode, "vllm:num_preemptions_total") - before
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"round {round_}, request {i}: wrong tokens"
    for xfer in xfers:
        assert len(loads(cluster, xfer, mode)) == 1, f"{xfer}: KV loaded more than once"
        assert not only(cluster.of(xfer), ev.KVLoadFailed, instance="decode")
    return preempted


# ---- 2. chunked prefill --------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_long_prompt_in_chunks(cluster: Any, mode: str) -> None:
    """A 400-token prompt takes at least seven prefill steps on either side."""
    p = prompt(SEED[mode] + 1, 400)
    xfer = f"chunked-{mode}-{uuid.uuid4().hex[:6]}"
    assert exchange(cluster, mode, p, xfer=xfer) == cluster.reference(p, MAX_TOKENS)
    (load,) = loads(cluster, xfer, mode)
    got = only(cluster.of(xfer), ev.KVReceived, instance="decode")
    assert got and got[0].num_tokens == load.num_tokens
    assert load.num_tokens == len(p)  # a fresh prompt: no local hit on decode


def test_bidirectional_second_turn_in_chunks(cluster: Any) -> None:
    """Turn 2 (turn 1 + its 80-token answer + 150 new tokens) reads decode's retained KV past
    prefill's own local hit (where prefill caches, turn 1's first 4 blocks are in its cache),
    and computes the rest in chunks."""
    p1 = prompt(10, 150)
    _, d1 = cluster.client.pull(p1, 80, retain=True)
    assert d1.kv_transfer_params, "decode returned no retained-KV handle"
    handle = d1.kv_transfer_params["kvplane"]["retained"]
    p2 = p1 + list(d1.token_ids) + prompt(11, 150)
    xfer = f"turn2-{uuid.uuid4().hex[:6]}"
    assert exchange(cluster, "pull", p2, reuse=handle, xfer=xfer) == \
        cluster.reference(p2, MAX_TOKENS)
    evs = cluster.wait_for(xfer, ev.KVReceived, instance="decode")
    matched = (len(p1) + 80 - 1) // BLOCK * BLOCK  # the whole blocks decode retained: 224
    hit = len(p1) // BLOCK * BLOCK if cluster.layout == "prefill-caches" else 0
    decided = only(evs, ev.ReuseDecided, instance="prefill")
    assert len(decided) == 1 and decided[0].outcome == "read"
    assert (decided[0].local_hit_tokens, decided[0].remote_tokens) == (hit, matched - hit)
    read = only(evs, ev.TransferPlanned, instance="prefill", direction="D->P")
    assert len(read) == 1 and read[0].num_tokens == matched - hit
    started = only(evs, ev.PrefillStarted, instance="prefill")[0]
    assert started.cached_tokens == matched
    assert started.computed_tokens == len(p2) - matched > CHUNK


# ---- 3. re-issue -----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["pull", "push", "bidirectional"])
def test_same_prompt_twice_through_the_router(cluster: Any, mode: str) -> None:
    """A client sends the same request again: the caching side serves its prefix from its own
    cache (decode loads only the rest into new blocks), the answer is the same."""
    url = cluster.router.use(mode)
    p = prompt(SEED[mode] + 200, 150)
    want = cluster.reference(p, MAX_TOKENS)
    body: dict[str, Any] = {"model": _servers.MODEL_NAME, "prompt": p,
                            "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
                            "return_token_ids": True}
    if mode == "bidirectional":
        body["conversation_id"] = f"c-{uuid.uuid4().hex[:8]}"
    hits0 = metric(cluster.prefill, "vllm:prompt_tokens_by_source_total",
                   source="local_cache_hit")
    xfers = []
    for _ in range(2):
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=180)
        assert r.status_code == 200, r.text[:400]
        assert r.json()["choices"][0]["token_ids"] == want, f"{mode}: wrong tokens"
        xfers.append(r.headers["x-request-id"])
    kind = ev.RegistrationSent if mode == "push" else ev.TransferPlanned
    second = only(cluster.wait_for(xfers[1], ev.KVReceived, instance="decode"), kind,
                  instance="decode")
    hit = (len(p) - 1) // BLOCK * BLOCK  # vLLM's prefix cache: whole blocks, never the last token
    if cluster.layout == "decode-caches":
        assert second and second[0].num_tokens == len(p) - hit
    else:
        assert second and second[0].num_tokens == len(p)
        hits = metric(cluster.prefill, "vllm:prompt_tokens_by_source_total",
                      source="local_cache_hit") - hits0
        assert hits >= hit, "prefill did not serve the re-sent prompt from its cache"


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_retry_as_the_next_attempt(cluster: Any, mode: str) -> None:
    """The router's retry: the same transfer id again as attempt 1 (prefill's second leg finds
    the prompt in its cache where it caches). Each attempt moves its KV once and decodes the
    plain server's tokens."""
    p = prompt(SEED[mode] + 300, 130)
    want = cluster.reference(p, MAX_TOKENS)
    xfer = f"retry-{mode}-{uuid.uuid4().hex[:6]}"
    assert exchange(cluster, mode, p, xfer=xfer) == want
    assert exchange(cluster, mode, p, xfer=xfer, attempt=1) == want
    evs = cluster.wait_for(xfer, ev.KVReceived, instance="decode", attempt=1)
    received = only(evs, ev.KVReceived, instance="decode")
    assert sorted(e.attempt for e in received) == [0, 1]
    kind = ev.TransferPlanned if mode == "pull" else ev.RegistrationSent
    assert sorted(e.attempt for e in only(evs, kind, instance="decode")) == [0, 1]


def test_replayed_decode_leg_computes_locally(cluster: Any) -> None:
    """The same pull handle posted to decode again after its exchange ended: no second READ
    of blocks prefill has freed; the answer is computed and right."""
    p = prompt(400, 100)
    want = cluster.reference(p, MAX_TOKENS)
    xfer = f"replay-{uuid.uuid4().hex[:6]}"
    pre = complete(cluster.prefill.url, p, 1, {"do_remote_decode": True, "kvplane": {
        "v": 1, "mode": "pull", "xfer": xfer}}, request_id=xfer)
    params = pre.kv_transfer_params
    assert params
    assert complete(cluster.decode.url, p, MAX_TOKENS, dict(params)).token_ids == want
    cluster.wait_for(xfer, ev.BlocksFreed, instance="prefill")
    assert complete(cluster.decode.url, p, MAX_TOKENS, dict(params)).token_ids == want
    time.sleep(0.5)
    assert len(only(cluster.of(xfer), ev.TransferPlanned, instance="decode")) == 1
