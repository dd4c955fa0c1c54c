"""Real vLLM P/D under ordinary and hostile clients, with vLLM's defaults (issue 9).

One prefill and one decode server with KvplaneConnector, **prefix caching on** (vLLM's
default) on both, signed handles (`$KVPLANE_HANDLE_KEY`), a plain server with prefix caching
off as the reference, and the real `kvplane router` in front of the pair; started once for the
module (servers.pd_cluster). Every attack case of the issue is a test here, against the real
servers, through the router and straight to decode:

- n > 1, best_of, batch prompts, beam search, min_tokens, max_tokens <= 0 or too large,
  prompt_logprobs: served P/D-correct (token for token equal to the plain server) or refused
  with a 4xx before any engine works on them; both servers stay up;
- the same transfer id twice, n > 1 and batches straight to decode, a replayed handle, a forged
  handle naming other blocks, malformed kv_transfer_params: served (computed locally where the
  KV cannot be trusted) or refused with a 4xx, never a crash, never another request's KV;
- decode with a local prefix hit loads only the tokens past it (pull, push, bidirectional);
- decode refusing the leg gives prefill's hold back at once;
- an unreachable peer does not hold up another request's transfer;
- unknown connector settings stop the server at start-up, naming the known ones; kvplane's log
  lines appear in vLLM's log and the handle key never does.

After every test both servers must still be alive and healthy. Nothing asserts a duration.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import kvplane_live_servers as _servers
import pytest

from kvplane.core import events as ev

Cluster = _servers.PdCluster
MODEL = _servers.MODEL_NAME
only = _servers.only

pytestmark = [pytest.mark.live, pytest.mark.timeout(900)]

MAX_TOKENS = 12
BLOCK = 32
HANDLE_KEY = "hostile-handle-key-0123456789abcdef-do-not-log"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    cfg = {"kv_recompute_threshold": 64, "decoder_kv_blocks_ttl": 60, "transfer_timeout": 20.0}
    with _servers.pd_cluster("hostile", cfg, handle_key=HANDLE_KEY, prefix_caching=True) as c:
        yield c


@pytest.fixture(autouse=True)
def _both_stay_up(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "cluster" not in request.fixturenames:
        return
    cluster = request.getfixturevalue("cluster")
    for s in (cluster.prefill, cluster.decode):
        assert s.alive(), f"{s.name} died:\n{s.log_tail()}"
        assert s.healthy(), f"{s.name} is not healthy:\n{s.log_tail()}"


prompt = _servers.prompt


def post(url: str, body: dict[str, Any], path: str = "/v1/completions",
         headers: dict[str, str] | None = None) -> httpx.Response:
    full = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, **body}
    return httpx.post(url + path, json=full, headers=headers or {}, timeout=180)


def tokens(r: httpx.Response) -> list[list[int]]:
    assert r.status_code == 200, f"HTTP {r.status_code}: {r.text[:400]}"
    return [list(c.get("token_ids") or []) for c in r.json()["choices"]]


def reference(cluster: Any, p: list[int], **body: Any) -> list[int]:
    return tokens(post(cluster.single.url, {"prompt": p, **body}))[0]



def refused(r: httpx.Response, param: str | None = None) -> None:
    assert 400 <= r.status_code < 500, f"HTTP {r.status_code}: {r.text[:300]}"
    err = r.json().get("error", {})
    assert err.get("message"), r.text
    if param is not None:
        assert err.get("param") == param, r.text


def prefill_params(cluster: Any, p: list[int], xfer: str) -> dict[str, Any]:
    """Prefill's real answer for a pull: the signed handle decode may read."""
    kp = {"v": 1, "mode": "pull", "xfer": xfer}
    r = post(cluster.prefill.url, {"prompt": p, "max_tokens": 1,
                                   "kv_transfer_params": {"do_remote_decode": True,
                                                          "kvplane": kp}},
             headers={"X-Request-Id": xfer})
    params = r.json().get("kv_transfer_params")
    assert r.status_code == 200 and params and params["kvplane"]["pull"]["sig"], r.text
    return dict(params)


def prefill_tokens(cluster: Any) -> float:
    return float(cluster.prefill.metric("vllm:prompt_tokens_total"))


# ---- 0. configuration (before the cluster) -----------------------------------------------------


def test_unknown_connector_key_stops_the_server() -> None:
    """Runs first, alone (before the cluster starts): a fourth vLLM beside the cluster is more
    memory than a small shared machine has."""
    _servers.require_vllm()
    s = _servers.VllmServer("misconfigured", _servers._tiny_model().tiny_model_dir(),
                            _servers.log_dir("hostile-config"),
                            connector={"mode": "push", "bidirectional": True})
    s.start()
    try:
        deadline = time.monotonic() + 300
        while s.alive() and time.monotonic() < deadline:
            time.sleep(1)
        assert not s.alive(), "a server with unknown connector keys came up"
        text = s.log_path.read_text(errors="replace")
        assert "unknown key(s) 'bidirectional', 'mode'" in text
        assert "known keys:" in text and "bidirectional_kv_xfer" in text
    finally:
        s.stop()


# ---- 1. through the router ---------------------------------------------------------------------


def test_n2_through_the_router(cluster: Any) -> None:
    """Seeded sampling makes n = 2 comparable: both samples equal the plain server's."""
    url = cluster.router.use("pull")
    p = prompt(1, 70)
    body = {"prompt": p, "n": 2, "temperature": 0.8, "seed": 7}
    want = tokens(post(cluster.single.url, body))
    assert len(want) == 2 and want[0] != want[1]
    assert tokens(post(url, body)) == want
    refused(post(url, {"prompt": p, "n": 2, "temperature": 0.0}), "n")  # vLLM's own rule


@pytest.mark.parametrize(("body", "param"), [
    ({"best_of": 2}, "best_of"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"max_tokens": 100_000}, "max_tokens"),
    ({"max_tokens": 4, "min_tokens": 9}, "min_tokens"),
])
def test_router_refuses_before_any_prefill(cluster: Any, body: dict[str, Any],
                                           param: str) -> None:
    url = cluster.router.use("pull")
    before = prefill_tokens(cluster)
    refused(post(url, {"prompt": prompt(2, 40), **body}), param)
    assert prefill_tokens(cluster) == before  # prefill never saw it


def test_batch_prompts_through_the_router_are_refused(cluster: Any) -> None:
    url = cluster.router.use("pull")
    before = prefill_tokens(cluster)
    refused(post(url, {"prompt": [prompt(3, 40), prompt(4, 40)]}), "prompt")
    refused(post(url, {"prompt": ["one text", "another"]}), "prompt")
    assert prefill_tokens(cluster) == before


def test_min_tokens_through_the_router(cluster: Any) -> None:
    url = cluster.router.use("pull")
    p = prompt(5, 50)
    body = {"max_tokens": MAX_TOKENS, "min_tokens": 6, "ignore_eos": False}
    assert tokens(post(url, {"prompt": p, **body}))[0] == reference(cluster, p, **body)


def test_decode_refusal_gives_prefill_hold_back(cluster: Any) -> None:
    """`logprobs: 100` is past vLLM's `max_logprobs` (20): the one-token prefill leg (which
    drops logprobs) is served, decode answers 400, and the router gives prefill's hold back at
    once (not after the hold's 30 s lease)."""
    url = cluster.router.use("pull")
    r = post(url, {"prompt": prompt(6, 100), "logprobs": 100})
    refused(r)
    xfer = r.headers.get("x-request-id", "")
    assert xfer.startswith("kvp-")
    evs = cluster.wait_for(xfer, ev.LeaseReleased, timeout=20)
    released = only(evs, ev.LeaseReleased, instance="prefill")
    assert released and released[0].reason == "decode refused the leg", evs


# ---- 2. straight to decode -----------------------------------------------------------------------


def test_same_xfer_twice_straight_to_decode(cluster: Any) -> None:
    p = prompt(10, 80)
    xfer = f"dup-{uuid.uuid4().hex[:8]}"
    params = prefill_params(cluster, p, xfer)
    want = reference(cluster, p)
    with cf.ThreadPoolExecutor(2) as pool:
        rs = list(pool.map(lambda _: post(cluster.decode.url,
                                          {"prompt": p, "kv_transfer_params": params}),
                           range(2)))
    assert [tokens(r)[0] for r in rs] == [want, want]
    again = post(cluster.decode.url, {"prompt": p, "kv_transfer_params": params})  # replay
    assert tokens(again)[0] == want
    evs = cluster.of(xfer)
    assert len(only(evs, ev.TransferPlanned, instance="decode")) == 1  # one READ, ever


def test_n2_and_batch_straight_to_decode(cluster: Any) -> None:
    p = prompt(11, 90)
    want = reference(cluster, p)
    xfer = f"n2-{uuid.uuid4().hex[:8]}"
    body = {"prompt": p, "n": 2, "temperature": 0.8, "seed": 3}
    r = post(cluster.decode.url, {**body,
                                  "kv_transfer_params": prefill_params(cluster, p, xfer)})
    assert tokens(r) == tokens(post(cluster.single.url, body))
    xfer = f"batch-{uuid.uuid4().hex[:8]}"
    r = post(cluster.decode.url, {"prompt": [p, p],
                                  "kv_transfer_params": prefill_params(cluster, p, xfer)})
    assert tokens(r) == [want, want]
    assert len(only(cluster.of(xfer), ev.TransferPlanned, instance="decode")) <= 1


def test_beam_search_and_best_of_straight_to_decode(cluster: Any) -> None:
    p = prompt(12, 60)
    xfer = f"beam-{uuid.uuid4().hex[:8]}"
    params = prefill_params(cluster, p, xfer)
    for extra in ({"use_beam_search": True, "n": 2}, {"best_of": 2, "n": 1}):
        r = post(cluster.decode.url, {"prompt": p, "kv_transfer_params": params, **extra})
        assert r.status_code == 200 or 400 <= r.status_code < 500, r.text[:300]


def test_forged_handle_reads_no_other_blocks(cluster: Any) -> None:
    victim = prompt(13, 96)
    p = prompt(14, 96)
    xfer = f"forge-{uuid.uuid4().hex[:8]}"
    params = prefill_params(cluster, p, xfer)
    # the attacker names blocks another request used (blocks of the same size, just shifted)
    prefill_params(cluster, victim, f"victim-{uuid.uuid4().hex[:8]}")
    forged = json.loads(json.dumps(params))
    forged["kvplane"]["pull"]["blocks"] = [b + 1 for b in forged["kvplane"]["pull"]["blocks"]]
    assert tokens(post(cluster.decode.url, {"prompt": p, "kv_transfer_params": forged}))[0] \
        == reference(cluster, p)
    evs = cluster.wait_for(xfer, ev.KVLoadFailed)
    assert not only(evs, ev.TransferPlanned, instance="decode")
    assert any("pull handle refused" in e.reason for e in only(evs, ev.KVLoadFailed))


@pytest.mark.parametrize("params", [
    {"kvplane": "not an object"},
    {"do_remote_prefill": True, "kvplane": {"v": 1}},
    {"do_remote_prefill": True, "kvplane": {"v": 1, "pull": {"blocks": "all of them"}}},
    {"do_remote_prefill": True, "kvplane": {"v": 1, "mode": "push", "xfer": "x",
                                            "source": {"instance": "p", "host": "127.0.0.1",
                                                       "port": "nope"}}},
    {"do_remote_prefill": True, "kvplane": {"v": 99, "xfer": "x"}},
    {"do_remote_decode": True, "kvplane": {"v": 1, "reuse": {"lease": 5}}},
    {"do_remote_prefill": True, "kvplane": {"v": 1, "retain": True, "retain_ttl": "soon",
                                            "source": {"instance": "p", "host": "h",
                                                       "port": 1}}},
])
def test_malformed_params_straight_to_vllm(cluster: Any, params: dict[str, Any]) -> None:
    p = prompt(15, 40)
    want = reference(cluster, p)
    for server in (cluster.decode, cluster.prefill):
        r = post(server.url, {"prompt": p, "kv_transfer_params": params})
        if r.status_code == 200:
            assert tokens(r)[0] == want
        else:
            refused(r)
    for bad in ("a string", 5, [1, 2]):
        r = post(cluster.decode.url, {"prompt": p, "kv_transfer_params": bad})
        assert r.status_code == 200 or 400 <= r.status_code < 500, r.text[:300]


# ---- 3. prefix caching on: decode loads only past its local hit -------------------------------------


@pytest.mark.parametrize("mode", ["pull", "push", "bidirectional"])
def test_prefix_hit_loads_only_the_rest(cluster: Any, mode: str) -> None:
    url = cluster.router.use(mode)
    seed = {"pull": 20, "push": 30, "bidirectional": 40}[mode]
    shared = prompt(seed, 3 * BLOCK)  # 96 tokens: three whole blocks
    first, second = shared + prompt(seed + 1, 30), shared + prompt(seed + 2, 41)
    conv = f"c-{uuid.uuid4().hex[:8]}" if mode == "bidirectional" else None
    for p in (first, second):
        body: dict[str, Any] = {"prompt": p}
        if conv:
            body["conversation_id"] = conv
        r = post(url, body)
        assert tokens(r)[0] == reference(cluster, p), f"{mode}: wrong tokens"
    xfer = r.headers["x-request-id"]
    kind = ev.RegistrationSent if mode == "push" else ev.TransferPlanned
    evs = cluster.wait_for(xfer, kind)
    moved = only(evs, kind, instance="decode")
    assert moved, evs
    # decode had the shared blocks already: it asked for the rest only, into new blocks
    assert moved[0].num_tokens == len(second) - len(shared)


# ---- 4. peers ------------------------------------------------------------------------------------


class Hole:
    """A side channel that accepts connections and then drips its answer, one byte every two
    seconds, so a handshake with it hangs until its order's deadline (never a socket time-out
    on a quiet line)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.stop = threading.Event()
        self.conns: list[socket.socket] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
                conn.sendall(b"\x00\x00\x10\x00")  # a 4 KiB answer is coming...
                self.conns.append(conn)
            except OSError:
                pass
            for c in list(self.conns):
                try:
                    c.send(b"\x01")
                except OSError:
                    self.conns.remove(c)
            self.stop.wait(2.0)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        for c in self.conns:
            c.close()
        self.sock.close()


def test_unreachable_peer_does_not_hold_up_others(cluster: Any) -> None:
    """A push leg naming a side channel that never finishes its answer: its handshake waits
    off the transfer thread until the registration's deadline, while a pull of another request
    completes; the stuck one then computes its prompt."""
    hole = Hole()
    try:
        p_bad, p_good = prompt(50, 64), prompt(51, 64)
        bad = f"hole-{uuid.uuid4().hex[:8]}"
        params = {"do_remote_prefill": True, "kvplane": {
            "v": 1, "mode": "push", "xfer": bad,
            "source": {"instance": "nowhere", "host": "127.0.0.1", "port": hole.port}}}
        with cf.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(post, cluster.decode.url, {"prompt": p_bad,
                                                         "kv_transfer_params": params})
            cluster.wait_for(bad, ev.RegistrationSent)
            good = f"good-{uuid.uuid4().hex[:8]}"
            r = post(cluster.decode.url, {"prompt": p_good, "kv_transfer_params":
                                          prefill_params(cluster, p_good, good)})
            assert tokens(r)[0] == reference(cluster, p_good)
            got = only(cluster.wait_for(good, ev.KVReceived), ev.KVReceived, instance="decode")
            stuck = only(cluster.of(bad), ev.KVLoadFailed, instance="decode")
            assert got and not stuck  # the good READ did not wait for the stuck handshake
            assert tokens(fut.result())[0] == reference(cluster, p_bad)
        lost = only(cluster.wait_for(bad, ev.KVLoadFailed), ev.KVLoadFailed, instance="decode")
        assert lost and got[0].at < lost[0].at
    finally:
        hole.close()


# ---- 5. configuration and logs -----------------------------------------------------------------------


def test_kvplane_logs_in_vllm_log_and_no_key(cluster: Any) -> None:
    for s in (cluster.prefill, cluster.decode):
        text = s.log_path.read_text(errors="replace")
        assert f"kvplane {s.name}: side channel on" in text  # an INFO line of ours
        assert HANDLE_KEY not in text
