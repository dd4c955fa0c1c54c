"""A model with a sliding-window layer and a full-attention layer (two KV cache groups).

vLLM's hybrid KV cache manager would give this model two KV cache groups; KvplaneConnector does
not declare hybrid support, so vLLM turns the hybrid manager off for the connector's instances
and keeps one group (each layer still attends within its window). The plain reference server
runs without a connector, with the hybrid manager and its two groups. Checked: the connector's
instances were given one group (vLLM says so in their logs), and pull and push give the plain
server's greedy tokens on prompts longer than the window. A configuration that still has several
groups is refused by name (unit test below, vLLM-free).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import kvplane_live_servers as _servers
import kvplane_live_tiny_model as tiny_model
import pytest

from kvplane.core import events as ev
from kvplane.live.connector import layout_from_vllm

PdClient, complete = _servers.PdClient, _servers.complete
tiny_swa_model_dir, WINDOW = tiny_model.tiny_swa_model_dir, tiny_model.WINDOW

MAX_TOKENS = 16


def test_several_kv_cache_groups_are_refused_by_name() -> None:
    class Spec:
        block_size, head_size = 32, 32

    class SlidingWindowSpec(Spec):
        pass

    class FullAttentionSpec(Spec):
        pass

    @dataclass
    class Group:
        kv_cache_spec: Any
        layer_names: list[str]

    @dataclass
    class KVCacheConfig:
        kv_cache_groups: list[Group]

    cfg = KVCacheConfig([Group(SlidingWindowSpec(), ["l0"]), Group(FullAttentionSpec(), ["l1"])])
    with pytest.raises(NotImplementedError,
                       match="2 .*SlidingWindowSpec, FullAttentionSpec.*disable-hybrid"):
        layout_from_vllm(object(), cfg)


Cluster = _servers.PdCluster


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with _servers.pd_cluster("swa", {}, model=tiny_swa_model_dir()) as c:
        yield c



def prompt(seed: int) -> list[int]:
    return _servers.prompt(seed, 4 * WINDOW)


@pytest.mark.live
@pytest.mark.timeout(900)
def test_vllm_gives_the_connector_one_group(cluster: Cluster) -> None:
    import re

    groups = re.compile(r"kv cache group sizes \(([^)]*)\)")
    for s in (cluster.prefill, cluster.decode):
        log = s.log_path.read_text(errors="replace")
        assert "Turning off hybrid kv cache manager" in log
        assert not groups.search(log), f"{s.name} has several KV cache groups"
    plain = cluster.plain.log_path.read_text(errors="replace")
    assert "Turning off hybrid kv cache manager" not in plain
    found = groups.search(plain)
    assert found and len(found.group(1).split(",")) == 2, \
        "the plain server should run this model with two KV cache groups"


@pytest.mark.live
@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_prompts_longer_than_the_window_match_the_plain_server(cluster: Cluster,
                                                               mode: str) -> None:
    client = PdClient(cluster.prefill, cluster.decode)
    for seed in (1, 2):
        p = prompt(seed + len(mode))
        xfer = f"swa-{mode}-{seed}-{uuid.uuid4().hex[:6]}"
        if mode == "pull":
            _, d = client.pull(p, MAX_TOKENS, xfer=xfer)
        else:
            _, d = client.push(p, MAX_TOKENS, xfer=xfer)
        assert d.token_ids == complete(cluster.plain.url, p, MAX_TOKENS).token_ids
        evs = cluster.wait_for(xfer, ev.KVReceived)
        got = [e for e in evs if isinstance(e, ev.KVReceived) and e.instance == "decode"]
        assert got and got[0].num_tokens >= len(p) - 1, f"decode got no KV: {evs}"
