"""MLA (multi-head latent attention) live: a tiny DeepSeek-V2-style model on vLLM's CPU build.

vLLM caches one latent per token and layer for MLA (kv_lora_rank + rope = 576 values, the same
on every TP rank), block size 16 (the CPU MLA kernel's only one), and asks no KV cache layout
of the connector (there are no heads to order). The connector registers each layer's latent
cache as one region (one "head" of 16 tokens inside a block, one plane) and moves it like any
other cache. Checked: decode received the KV (KVReceived, no KVLoadFailed) and the transfer
moved the latent's bytes (TransferPlanned's bytes = tokens x layers x 576 x 4, no K/V pair).

On vLLM's CPU build the greedy tokens after a loaded latent differed from a plain CPU server's
(seen 2026-12-01: first token 824 vs 853) although the bytes moved were the latent's, and vLLM
itself turns prefix caching off for its CPU MLA backend (it cannot attend over context it did
not compute). So on CPU MLA the connector takes no KV: decode computes, records why, and is
token-exact. The same model and transfer are token-exact on the H200 (FLASH_ATTN_MLA;
docs/measurements/gpu-live-h200/run2-tp-blocks-mla/).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import kvplane_live_servers
import pytest

from kvplane.core import events as ev

_servers = kvplane_live_servers
VllmServer, PdClient = _servers.VllmServer, _servers.PdClient
complete, start_all, stop_all = _servers.complete, _servers.start_all, _servers.stop_all
tiny_mla_model_dir = _servers.helper("tiny_mla_model").tiny_mla_model_dir

MAX_TOKENS = 12
LATENT = 512 + 64
MLA_ARGS = ["--block-size", "16"]


@dataclass
class Cluster:
    prefill: VllmServer
    decode: VllmServer
    plain: VllmServer
    db: Path
    run: str

    def of(self, xfer: str, kind: type[ev.Event], timeout: float = 20.0) -> list[ev.Event]:
        return _servers.wait_events(lambda: _servers.recorded(self.db, self.run, xfer), kind,
                                    timeout)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    _servers.require_vllm()
    model = tiny_mla_model_dir()
    logs = _servers.log_dir("mla")
    db = logs / "events.db"
    run = f"mla-{uuid.uuid4().hex[:8]}"
    cfg = {"kvplane_db": str(db), "kvplane_run": run, "kv_lease_duration": 180.0,
           "push_hold_timeout": 180.0, "kv_wait_timeout": 180.0, "transfer_timeout": 150.0}
    prefill = VllmServer("prefill", model, logs, connector=dict(cfg), extra_args=MLA_ARGS)
    decode = VllmServer("decode", model, logs, connector=dict(cfg), extra_args=MLA_ARGS)
    plain = VllmServer("plain", model, logs, extra_args=MLA_ARGS)
    start_all([prefill, decode, plain])
    print(f"\nvLLM logs and events in {logs}")
    try:
        yield Cluster(prefill, decode, plain, db, run)
    finally:
        stop_all([prefill, decode, plain])




prompt = _servers.prompt


def test_the_instances_cache_one_latent_per_layer(cluster: Cluster) -> None:
    for s in (cluster.prefill, cluster.decode):
        log = s.log_path.read_text(errors="replace")
        assert "CPU_MLA" in log or "MLA" in log
        assert f"inside a block: 1 heads x 16 tokens, planes [[0, 1, 0, {LATENT * 4}]]" in log, \
            s.name


@pytest.mark.live
@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_cpu_mla_decode_computes_its_prompt_and_matches_the_plain_server(cluster: Cluster,
                                                                        mode: str) -> None:
    """On vLLM's CPU MLA backend a loaded latent gave other tokens than a plain server, so the
    connector never loads there: decode computes the prompt, records why, and its tokens are
    the plain server's. (The same model moves its latent token-exact on the H200.)"""
    client = PdClient(cluster.prefill, cluster.decode)
    for seed in (1, 2):
        p = prompt(seed + 10 * len(mode), 100)
        xfer = f"mla-{mode}-{seed}-{uuid.uuid4().hex[:6]}"
        if mode == "pull":
            _, d = client.pull(p, MAX_TOKENS, xfer=xfer)
        else:
            _, d = client.push(p, MAX_TOKENS, xfer=xfer)
        ref = complete(cluster.plain.url, p, MAX_TOKENS).token_ids
        assert d.token_ids == ref
        evs = cluster.of(xfer, ev.KVLoadFailed)
        fell_back = [e for e in evs if isinstance(e, ev.KVLoadFailed) and e.instance == "decode"]
        assert fell_back and "CPU MLA" in fell_back[0].reason, evs
        assert not [e for e in evs if isinstance(e, ev.KVReceived) and e.instance == "decode"]
