"""The GPU live suite: KvplaneConnector in real vLLM on a GPU, KV moved GPU to GPU by NIXL.

Run it with `scripts/gpu_live.sh` (which installs vLLM, NIXL and kvplane on the GPU machine
first) or, where they are installed, `python -m pytest tests/gpu/gpu_live.py`. It is not part
of `make test` (its file name does not match `test_*.py`, so the CPU suite never collects it;
given by name, pytest runs it). It runs on the CPU build too (float32, slower), which is how it
is debugged without a GPU.

Three servers on one device: prefill and decode with the connector, and a plain server (no
connector) whose greedy output is the reference. What is checked, each against the plain
server token for token:
- pull; push in the three arrival orders; bidirectional (turn 2's prefill READs decode's
  retained KV); the `kvplane router` in pull, push and bidirectional mode;
- faults that must fall back to local compute with the right tokens: a pull whose source is
  unreachable, and a push decode leg whose prefill never comes (decode's wait times out). On
  vLLM 0.25.1 both are recomputed only because the connector names the failed blocks
  (`get_block_ids_with_load_errors`, see live/vllm_compat.py);
- the recorded run replays without violation.
Transfer times come from the recorded events (TransferPlanned to TransferCompleted on the
instance that moved the bytes). The results go to $KVPLANE_GPU_REPORT/gpu_live.json (default:
the log folder) for docs/measurements/.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

from kvplane.core import events as ev
from kvplane.core.replay import replay


def _servers_module() -> ModuleType:
    """tests/live/servers.py, once, under the name the live tests use (see servers.helper)."""
    full = "kvplane_live_servers"
    if full not in sys.modules:
        path = Path(__file__).resolve().parent.parent / "live" / "servers.py"
        spec = importlib.util.spec_from_file_location(full, path)
        assert spec is not None and spec.loader is not None
        sys.modules[full] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[full]


_servers = _servers_module()
VllmServer, PdClient, complete = _servers.VllmServer, _servers.PdClient, _servers.complete
free_port = _servers.free_port

pytestmark = [pytest.mark.live, pytest.mark.timeout(600)]

MAX_TOKENS = 16
WAIT = 6.0  # decode's push wait (kv_wait_timeout): the timed-out leg waits this long
BLOCK = 32  # --block-size in servers.py


def on_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@dataclass
class DeviceServer(VllmServer):  # type: ignore[misc]
    """servers.VllmServer with the flags of the device it runs on: on a GPU bfloat16 (FlashAttention
    3 on Hopper takes no float32) and 1 GiB of KV cache each, three servers on one GPU."""

    def command(self) -> list[str]:
        cmd = list(super().command())
        if on_gpu():
            i = cmd.index("--dtype")
            cmd[i + 1] = "bfloat16"
            # a fixed KV cache: three engines profiling one GPU at once count each other's
            # allocations as their own and find no memory left (seen on the H200)
            cmd += ["--gpu-memory-utilization", "0.2", "--kv-cache-memory-bytes", str(1 << 30)]
        return cmd


@dataclass
class Report:
    device: str
    vllm: str
    api: str
    checks: list[dict[str, Any]] = field(default_factory=list)

    def add(self, name: str, token_exact: bool, **extra: Any) -> None:
        self.checks.append({"check": name, "token_exact": token_exact, **extra})


@dataclass
class Cluster(_servers.PdCluster):  # type: ignore[misc]
    """servers.PdCluster (prefill, decode, the plain server, the router) with the report."""

    report: Report | None = None

    def reference(self, p: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
        return list(super().reference(p, max_tokens))


def only(evs: list[ev.Event], kind: type[ev.Event], **match: object) -> list[ev.Event]:
    return [e for e in evs if isinstance(e, kind)
            and all(getattr(e, k) == v for k, v in match.items())]


prompt = _servers.prompt


def transfer_times(evs: list[ev.Event]) -> dict[str, Any]:
    """Milliseconds from TransferPlanned to TransferCompleted on the instance that moved the
    bytes, per direction, with the bytes and descriptors planned."""
    planned = {(e.instance, e.request, e.attempt, e.direction): e
               for e in evs if isinstance(e, ev.TransferPlanned)}
    out: dict[str, list[dict[str, Any]]] = {}
    for e in evs:
        if not isinstance(e, ev.TransferCompleted):
            continue
        p = planned.get((e.instance, e.request, e.attempt, e.direction))
        if p is None:
            continue
        out.setdefault(e.direction, []).append({
            "request": e.request, "ms": round((e.at - p.at) * 1000, 3), "bytes": p.bytes,
            "descriptors": p.descriptors, "tokens": p.num_tokens, "by": e.instance})
    summary: dict[str, Any] = {}
    for direction, rows in out.items():
        ms = [r["ms"] for r in rows]
        summary[direction] = {"n": len(rows), "median_ms": round(statistics.median(ms), 3),
                              "min_ms": min(ms), "max_ms": max(ms), "transfers": rows}
    return summary


def _styles_in_log(server: VllmServer) -> str:
    """The result style the server's connector chose, from its log line (vllm_compat)."""
    import re

    found = re.findall(r"KvplaneConnector for vLLM \S+ \((\w+)\)",
                       server.log_path.read_text(errors="replace"))
    assert found, f"{server.name}'s log does not say which vLLM API the connector uses"
    return str(found[-1])


def _device_name() -> str:
    if not on_gpu():
        return "cpu"
    import torch

    return str(torch.cuda.get_device_name(0))


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """The servers; a module that borrows these tests may set SERVER_ENV (extra environment
    for the servers with the connector) and SERVER_ARGS (extra vLLM arguments for all three)."""
    _servers.require_vllm()
    import vllm

    cfg = {"kv_wait_timeout": WAIT, "transfer_timeout": 10.0, "kv_recompute_threshold": 64,
           "decoder_kv_blocks_ttl": 120, "write_margin": 1.0}
    extra = tuple(getattr(request.module, "SERVER_ENV", {}).items())
    args = tuple(getattr(request.module, "SERVER_ARGS", ()))
    with_connector = _servers.Side(env=extra)
    started = time.monotonic()
    base = _servers.pd_cluster(
        "gpu", cfg, prefill=with_connector, decode=with_connector,
        common=_servers.Side(args=args, env=(("VLLM_USE_FLASHINFER_SAMPLER", "0"),)),
        server=DeviceServer, timeout=480)
    print(f"\nthree servers healthy after {time.monotonic() - started:.0f} s")
    c = Cluster(**vars(base))
    try:
        styles = {s.name: _styles_in_log(s) for s in (c.prefill, c.decode)}
        assert len(set(styles.values())) == 1, \
            f"the servers report different API styles: {styles}"
        c.report = report = Report(_device_name(), str(vllm.__version__), styles["decode"])
        yield c
    finally:
        _servers.stop_cluster(c)
    try:
        times = transfer_times(c.events(settle=0.5))
    except Exception as exc:  # noqa: BLE001 - the report must still be written
        times = {"error": repr(exc)}
    out = Path(os.environ.get("KVPLANE_GPU_REPORT", str(c.logs)))
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_live.json").write_text(json.dumps(
        {"device": report.device, "vllm": report.vllm, "vllm_api": report.api,
         "checks": report.checks, "transfer_times": times}, indent=1))
    print(f"report written to {out / 'gpu_live.json'}")


# ---- transfers that work ----------------------------------------------------------------------


def test_pull_matches_plain_server(cluster: Cluster) -> None:
    for seed in (1, 2, 3):
        p = prompt(seed)
        xfer = f"pull-{seed}-{uuid.uuid4().hex[:6]}"
        _, d = cluster.client.pull(p, MAX_TOKENS, xfer=xfer)
        exact = d.token_ids == cluster.reference(p)
        cluster.report.add("pull", exact, xfer=xfer)
        assert exact
        evs = cluster.wait_for(xfer, ev.KVReceived, instance="decode")
        assert only(evs, ev.KVReceived, instance="decode"), f"decode never got the KV: {evs}"
        assert only(evs, ev.TransferCompleted, instance="decode", direction="P->D")


@pytest.mark.parametrize("order", ["together", "registration_first", "prefill_first"])
def test_push_matches_plain_server(cluster: Cluster, order: str) -> None:
    p = prompt(10 + len(order))
    xfer = f"push-{order}-{uuid.uuid4().hex[:6]}"
    _, d = cluster.client.push(p, MAX_TOKENS, xfer=xfer, order=order)
    exact = d.token_ids == cluster.reference(p)
    cluster.report.add(f"push {order}", exact, xfer=xfer)
    assert exact
    evs = cluster.wait_for(xfer, ev.KVReceived, instance="decode")
    assert only(evs, ev.KVReceived, instance="decode"), f"decode never got the KV: {evs}"
    assert only(evs, ev.TransferCompleted, instance="prefill", direction="P->D")


def test_bidirectional_second_turn_reads_decode_kv(cluster: Cluster) -> None:
    p1 = prompt(30, 120)
    _, d1 = cluster.client.pull(p1, MAX_TOKENS, retain=True)
    assert d1.kv_transfer_params, "decode returned no retained-KV handle"
    handle = d1.kv_transfer_params["kvplane"]["retained"]
    p2 = p1 + d1.token_ids + prompt(31, 40)
    xfer = f"turn2-{uuid.uuid4().hex[:6]}"
    _, d2 = cluster.client.pull(p2, MAX_TOKENS, reuse=handle, xfer=xfer)
    exact = d2.token_ids == cluster.reference(p2)
    evs = cluster.wait_for(xfer, ev.TransferCompleted, instance="prefill", direction="D->P")
    decided = only(evs, ev.ReuseDecided, instance="prefill")
    cluster.report.add("bidirectional turn 2", exact, xfer=xfer,
                       reuse=decided[0].outcome if decided else None,
                       reused_tokens=decided[0].remote_tokens if decided else 0)
    assert exact
    assert decided and decided[0].outcome == "read"
    assert decided[0].remote_tokens == (len(p1) + MAX_TOKENS - 1) // BLOCK * BLOCK
    assert only(evs, ev.TransferCompleted, instance="prefill", direction="D->P")


# ---- the router ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["pull", "push", "bidirectional"])
def test_router_matches_plain_server(cluster: Cluster, mode: str) -> None:
    url = cluster.router.use(mode)
    try:
        p = prompt(40 + len(mode))
        body = {"model": _servers.MODEL_NAME, "prompt": p, "max_tokens": MAX_TOKENS,
                "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text[:500]
        got = list(r.json()["choices"][0].get("token_ids") or [])
        exact = got == cluster.reference(p)
        xfer = r.headers.get("x-request-id", "")
        cluster.report.add(f"router {mode}", exact, xfer=xfer)
        assert exact
        evs = cluster.wait_for(xfer, ev.KVReceived, instance="decode")
        assert only(evs, ev.KVReceived, instance="decode"), \
            f"the router's request moved no KV: {evs}"
    finally:
        cluster.router.stop()


# ---- faults: the prompt is computed where it is needed, with the right tokens ---------------


def test_unreachable_source_is_recomputed(cluster: Cluster) -> None:
    p = prompt(50)
    ref = cluster.reference(p)
    xfer = f"ghost-pull-{uuid.uuid4().hex[:6]}"
    pre = complete(cluster.prefill.url, p, 1, {"do_remote_decode": True, "kvplane": {
        "v": 1, "mode": "pull", "xfer": xfer}})
    params = copy.deepcopy(pre.kv_transfer_params)
    assert params is not None
    params["kvplane"]["pull"]["source"]["port"] = free_port()  # nothing listens there
    d = complete(cluster.decode.url, p, MAX_TOKENS, params)
    exact = d.token_ids == ref
    evs = cluster.wait_for(xfer, ev.KVLoadFailed, instance="decode")
    failed = only(evs, ev.KVLoadFailed, instance="decode")
    cluster.report.add("fault: pull from an unreachable source", exact, xfer=xfer,
                       recorded=failed[0].reason if failed else None)
    assert exact, "decode's tokens differ after a failed load: blocks decoded unfilled?"
    assert failed and only(evs, ev.TransferFailed, instance="decode", direction="P->D")


def test_push_whose_prefill_never_comes_is_recomputed(cluster: Cluster) -> None:
    p = prompt(60)
    ref = cluster.reference(p)
    xfer = f"orphan-push-{uuid.uuid4().hex[:6]}"
    started = time.monotonic()
    d = complete(cluster.decode.url, p, MAX_TOKENS, {"do_remote_prefill": True, "kvplane": {
        "v": 1, "mode": "push", "xfer": xfer, "source": cluster.client.prefill_source()}})
    waited = time.monotonic() - started
    exact = d.token_ids == ref
    evs = cluster.wait_for(xfer, ev.KVLoadFailed, instance="decode")
    failed = only(evs, ev.KVLoadFailed, instance="decode")
    cluster.report.add("fault: push decode leg, prefill never comes", exact, xfer=xfer,
                       recorded=failed[0].reason if failed else None,
                       answered_after_s=round(waited, 2))
    assert exact, "decode's tokens differ after its wait timed out"
    assert failed, f"decode's time-out was not recorded: {evs}"
    assert waited >= WAIT * 0.9, f"decode answered after {waited:.1f} s, before its wait ended"


def test_recorded_run_replays_without_violation(cluster: Cluster) -> None:
    report = replay(cluster.events(settle=1.0))
    cluster.report.add("replay", report.ok, violations=[str(v) for v in report.violations[:5]])
    assert report.ok, "\n".join(map(str, report.violations[:20]))
