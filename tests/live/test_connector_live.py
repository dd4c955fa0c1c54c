"""KvplaneConnector inside real vLLM servers (CPU build) moving KV through real NIXL (UCX).

One prefill and one decode server with the connector, and one plain server as the reference,
started once for the module (about two minutes on 2 cores). Every test checks the same thing
first: greedy output through P/D equals the plain server's output token for token. Then it
checks, from the recorded events and from vLLM's own /metrics, that the KV really moved the way
the mode says (a READ by decode, a WRITE by prefill, a D->P READ for reuse) and that prefill
computed only what it had to. The last test replays everything both instances recorded through
kvplane.core.replay and expects no violation.

Time-outs are generous and nothing asserts a duration: on 2 shared cores timings say nothing.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator

import kvplane_live_servers as _servers
import kvplane_live_tiny_model as tiny_model
import pytest

from kvplane.core import events as ev
from kvplane.core.replay import replay
from kvplane.live.sidechannel import SideChannelError, fetch

PdClient, VllmServer = _servers.PdClient, _servers.VllmServer
complete, start_all, stop_all = _servers.complete, _servers.start_all, _servers.stop_all
only, settled = _servers.only, _servers.settled
tiny_model_dir = tiny_model.tiny_model_dir

pytestmark = [pytest.mark.live, pytest.mark.timeout(900)]

MAX_TOKENS = 24
THRESHOLD = 64
BLOCK = 32  # --block-size in servers.py


Cluster = _servers.PdCluster


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    cfg = {"kv_recompute_threshold": THRESHOLD, "decoder_kv_blocks_ttl": 120,
           "lease_renewable": True, "lease_extension": 200}
    with _servers.pd_cluster("live", cfg) as c:
        yield c


prompt = _servers.prompt



def moved_bytes(num_tokens: int) -> int:
    """Bytes a transfer of `num_tokens` moves: whole blocks, 2 layers, 2 KV heads, K and V of
    head_dim 32 in float32."""
    blocks = -(-num_tokens // BLOCK)
    return blocks * BLOCK * 2 * 2 * 2 * 32 * 4


# ---- 1. pull --------------------------------------------------------------------------------


def test_pull_matches_single_server(cluster: Cluster) -> None:
    d_bytes0 = cluster.decode.metric("vllm:kvplane_bytes_transferred_total")
    d_ext0 = cluster.decode.metric("vllm:prompt_tokens_by_source_total",
                                   source="external_kv_transfer")
    outputs, xfers, lengths = [], [], [50, 100, 200]
    for i, n in enumerate(lengths):
        p = prompt(i, n)
        ref = complete(cluster.single.url, p, MAX_TOKENS)
        pre, dec = cluster.client.pull(p, MAX_TOKENS)
        assert len(pre.token_ids) == 1
        assert dec.token_ids == ref.token_ids, f"prompt {i}: P/D output differs from single"
        outputs.append(tuple(ref.token_ids))
        xfers.append(pre.kv_transfer_params["kvplane"]["xfer"])  # type: ignore[index]
    assert len(set(outputs)) == len(outputs), "the model ignores its prompt: the test is blind"

    for xfer, n in zip(xfers, lengths):
        evs = cluster.wait_for(xfer, ev.BlocksFreed, instance="prefill")
        assert only(evs, ev.LeaseGranted, instance="prefill", purpose="pull_hold")
        planned = only(evs, ev.TransferPlanned, instance="decode", direction="P->D")
        assert len(planned) == 1 and planned[0].num_tokens == n
        assert only(evs, ev.TransferCompleted, instance="decode", direction="P->D")
        assert only(evs, ev.KVReceived, instance="decode")[0].num_tokens == n
        assert only(evs, ev.LeaseReleased, instance="prefill")[0].reason == "read by decode"
        assert only(evs, ev.BlocksFreed, instance="prefill")

    # vLLM's own metrics agree with our events: decode took every prompt token from the
    # connector, and the bytes its READs moved are the prompts' blocks.
    settled(lambda: cluster.decode.metric("vllm:prompt_tokens_by_source_total",
                                                 source="external_kv_transfer") - d_ext0,
                   sum(lengths))
    settled(lambda: cluster.decode.metric("vllm:kvplane_bytes_transferred_total")
                   - d_bytes0, sum(moved_bytes(n) for n in lengths))


# ---- 2. push --------------------------------------------------------------------------------


@pytest.mark.parametrize("order", ["registration_first", "prefill_first", "together"])
def test_push_matches_single_server(cluster: Cluster, order: str) -> None:
    p = prompt(10 + len(order), 120)
    ref = complete(cluster.single.url, p, MAX_TOKENS)
    p_bytes0 = cluster.prefill.metric("vllm:kvplane_bytes_transferred_total")
    xfer = f"push-{order}-{uuid.uuid4().hex[:6]}"
    _, dec = cluster.client.push(p, MAX_TOKENS, order=order, xfer=xfer)
    assert dec.token_ids == ref.token_ids
    evs = cluster.wait_for(xfer, ev.BlocksFreed, instance="prefill")
    assert only(evs, ev.RegistrationSent, instance="decode")
    assert only(evs, ev.RegistrationArrived, instance="prefill")
    matched = only(evs, ev.RendezvousMatched, instance="prefill")
    assert len(matched) == 1
    if order != "together":
        assert matched[0].order == order
    assert only(evs, ev.TransferPlanned, instance="prefill", direction="P->D")
    assert only(evs, ev.TransferCompleted, instance="prefill", direction="P->D")
    assert only(evs, ev.NotificationReceived, instance="decode", duplicate=False)
    assert only(evs, ev.KVReceived, instance="decode")[0].num_tokens == len(p)
    assert only(evs, ev.BlocksFreed, instance="prefill")[0].reason == "KV sent"
    # decode never planned a transfer itself: its loop only sent the registration
    assert not only(evs, ev.TransferPlanned, instance="decode")
    settled(lambda: cluster.prefill.metric("vllm:kvplane_bytes_transferred_total")
                   - p_bytes0, moved_bytes(len(p)))


# ---- 3. bidirectional reuse -------------------------------------------------------------------


def _turn1(cluster: Cluster, seed: int, mode: str, ttl: float | None = None
           ) -> tuple[list[int], list[int], dict[str, object]]:
    p1 = prompt(seed, 120)
    if mode == "pull":
        _, d1 = cluster.client.pull(p1, MAX_TOKENS, retain=True, retain_ttl=ttl)
    else:
        _, d1 = cluster.client.push(p1, MAX_TOKENS, retain=True, retain_ttl=ttl)
    assert d1.kv_transfer_params, "decode returned no retained-KV handle"
    handle = d1.kv_transfer_params["kvplane"]["retained"]
    assert handle["num_tokens"] == len(p1) + MAX_TOKENS - 1
    return p1, d1.token_ids, handle


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_second_turn_reads_decode_kv(cluster: Cluster, mode: str) -> None:
    p1, out1, handle = _turn1(cluster, 100 + len(mode), mode)
    p2 = p1 + out1 + prompt(200 + len(mode), 40)
    ref = complete(cluster.single.url, p2, MAX_TOKENS)
    ext0 = cluster.prefill.metric("vllm:prompt_tokens_by_source_total",
                                  source="external_kv_transfer")
    local0 = cluster.prefill.metric("vllm:prompt_tokens_by_source_total",
                                    source="local_compute")
    xfer = f"turn2-{mode}-{uuid.uuid4().hex[:6]}"
    if mode == "pull":
        _, d2 = cluster.client.pull(p2, MAX_TOKENS, reuse=handle, xfer=xfer)
    else:
        _, d2 = cluster.client.push(p2, MAX_TOKENS, reuse=handle, xfer=xfer)
    assert d2.token_ids == ref.token_ids
    reusable = (len(p1) + MAX_TOKENS - 1) // BLOCK * BLOCK  # full blocks decode retained
    evs = cluster.wait_for(xfer, ev.TransferCompleted, instance="prefill", direction="D->P")
    decided = only(evs, ev.ReuseDecided, instance="prefill")
    assert len(decided) == 1 and decided[0].outcome == "read"
    assert decided[0].remote_tokens == reusable
    read = only(evs, ev.TransferPlanned, instance="prefill", direction="D->P")
    assert len(read) == 1 and read[0].src == "decode" and read[0].num_tokens == reusable
    assert only(evs, ev.TransferCompleted, instance="prefill", direction="D->P")
    started = only(evs, ev.PrefillStarted, instance="prefill")[0]
    assert started.computed_tokens == len(p2) - reusable  # only the suffix
    assert started.cached_tokens == reusable
    settled(lambda: cluster.prefill.metric("vllm:prompt_tokens_by_source_total",
                                                  source="external_kv_transfer") - ext0,
                   reusable)
    settled(lambda: cluster.prefill.metric("vllm:prompt_tokens_by_source_total",
                                                  source="local_compute") - local0,
                   len(p2) - reusable)


def test_edited_history_is_not_reused(cluster: Cluster) -> None:
    p1, out1, handle = _turn1(cluster, 300, "pull")
    edited = list(p1)
    edited[5] = (edited[5] + 1) % 1000 or 11  # an early edit: no block matches any more
    p2 = edited + out1 + prompt(301, 40)
    ref = complete(cluster.single.url, p2, MAX_TOKENS)
    xfer = f"edited-{uuid.uuid4().hex[:6]}"
    _, d2 = cluster.client.pull(p2, MAX_TOKENS, reuse=handle, xfer=xfer)
    assert d2.token_ids == ref.token_ids
    evs = cluster.wait_for(xfer, ev.KVReceived, instance="decode")
    decided = only(evs, ev.ReuseDecided, instance="prefill")
    assert len(decided) == 1 and decided[0].outcome == "mismatch"
    assert not only(evs, ev.TransferPlanned, direction="D->P")
    assert only(evs, ev.PrefillStarted, instance="prefill")[0].computed_tokens == len(p2)


def test_expired_lease_falls_back(cluster: Cluster) -> None:
    p1, out1, handle = _turn1(cluster, 400, "push", ttl=2.0)
    lease = handle["lease"]
    deadline = time.monotonic() + 20
    while not any(isinstance(e, ev.LeaseExpired) and e.lease == lease
                  for e in cluster.events(settle=0.2)):
        assert time.monotonic() < deadline, "decode never expired its retained lease"
        time.sleep(0.5)
    p2 = p1 + out1 + prompt(401, 40)
    ref = complete(cluster.single.url, p2, MAX_TOKENS)
    xfer = f"expired-{uuid.uuid4().hex[:6]}"
    _, d2 = cluster.client.push(p2, MAX_TOKENS, reuse=handle, xfer=xfer)
    assert d2.token_ids == ref.token_ids
    evs = cluster.wait_for(xfer, ev.KVReceived, instance="decode")
    decided = only(evs, ev.ReuseDecided, instance="prefill")
    assert len(decided) == 1 and decided[0].outcome == "expired"
    assert not only(evs, ev.TransferPlanned, direction="D->P")


def test_side_channel_serves_identity_and_lease_control(cluster: Cluster) -> None:
    """What the router uses: identity, a retained handle by transfer id, renew, release."""
    host, port = "127.0.0.1", cluster.decode.side_port
    ident = json.loads(fetch(host, port, "identity"))
    assert ident["endpoint"]["instance"] == "decode"
    assert ident["layout"]["block_size"] == BLOCK and ident["settings"]["lease_renewable"]
    _, _, handle = _turn1(cluster, 500, "pull")
    xfer, lease = handle["xfer"], handle["lease"]
    assert json.loads(fetch(host, port, f"retained/{xfer}")) == handle
    renewed = json.loads(fetch(host, port, "renew/" + json.dumps(handle)))
    assert renewed["expires_at"] > handle["expires_at"]
    assert json.loads(fetch(host, port, f"retained/{xfer}"))["expires_at"] == \
        renewed["expires_at"]
    fetch(host, port, "release/" + json.dumps(handle))
    evs = cluster.wait_for(xfer, ev.LeaseReleased, instance="decode")
    assert only(evs, ev.LeaseRenewed, lease=lease)
    assert only(evs, ev.LeaseReleased, lease=lease)[0].reason == "released by the router"
    assert only(evs, ev.BlocksFreed, instance="decode")
    with pytest.raises(SideChannelError):
        fetch(host, port, f"retained/{xfer}")
    with pytest.raises(SideChannelError):  # renewing a released lease is refused
        fetch(host, port, "renew/" + json.dumps(handle))


# ---- 4. the record ----------------------------------------------------------------------------


def test_recorded_run_replays_without_violation(cluster: Cluster) -> None:
    time.sleep(2)  # let the last transfers end and the recorders write
    evs = cluster.events()
    instances = {e.instance for e in evs}
    assert {"prefill", "decode"} <= instances
    kinds = {type(e).__name__ for e in evs}
    for needed in ("BlocksReserved", "BlocksFreed", "TransferPlanned", "TransferCompleted",
                   "RegistrationSent", "RegistrationArrived", "RendezvousMatched",
                   "LeaseGranted", "LeaseReleased", "LeaseExpired", "LeaseRenewed",
                   "ReuseDecided",
                   "KVReceived", "NotificationReceived"):
        assert needed in kinds, f"no {needed} recorded"
    report = replay(evs, final=True)
    assert report.ok, "\n".join(map(str, report.violations[:20]))
