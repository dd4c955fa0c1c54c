"""GPU live suite, the variants: unequal block sizes and MLA, on one GPU.

Run by `scripts/gpu_live.sh` after (or instead of) tests/gpu/gpu_live.py; like that file it is
not collected by `make test` and also runs on the CPU build. Two clusters, one after the
other, each of three servers on the one device (prefill and decode with the connector, a plain
server for the greedy reference):
- `blocks`: the tiny Llama with prefill's blocks of 16 tokens and decode's of 32 (the plain
  server 32): pull and push token-exact, the transfer planned across the two block sizes;
- `mla`: the tiny DeepSeek-V2-style model of tests/live/tiny_mla_model.py (MLA: one latent of
  512 + 64 per token and layer), pull and push token-exact, the bytes planned those of the
  latent alone.
Results go to $KVPLANE_GPU_REPORT/gpu_variants.json with transfer times from the events.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kvplane.core import events as ev
from kvplane.store import open_store


def _load(name: str, folder: str) -> ModuleType:
    full = f"kvplane_{folder}_{name}"
    if full not in sys.modules:
        path = Path(__file__).resolve().parent.parent / folder / f"{name}.py"
        spec = importlib.util.spec_from_file_location(full, path)
        assert spec is not None and spec.loader is not None
        sys.modules[full] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[full]


_live = _load("gpu_live", "gpu")
_servers = _live._servers
DeviceServer, PdClient, complete = _live.DeviceServer, _servers.PdClient, _servers.complete
start_all, stop_all = _servers.start_all, _servers.stop_all
prompt, only, transfer_times = _live.prompt, _live.only, _live.transfer_times

pytestmark = [pytest.mark.live, pytest.mark.timeout(900)]

MAX_TOKENS = 16
LATENT = 512 + 64
RESULTS: dict[str, Any] = {"device": _live._device_name(), "checks": [], "transfer_times": {}}


@dataclass
class Cluster:
    name: str
    prefill: Any
    decode: Any
    plain: Any
    db: Path
    run: str

    def events(self) -> list[ev.Event]:
        with open_store(str(self.db)) as store:
            return sorted(store.events(self.run), key=lambda e: e.at)

    def wait_for(self, xfer: str, kind: type[ev.Event], timeout: float = 30.0,
                 **match: object) -> list[ev.Event]:
        deadline = time.monotonic() + timeout
        while True:
            evs = [e for e in self.events() if e.request == xfer]
            if only(evs, kind, **match) or time.monotonic() > deadline:
                return evs
            time.sleep(0.3)


VARIANTS = {
    # name: (model maker, prefill args, decode args, plain args)
    "blocks": ("tiny_model", ["--block-size", "16"], ["--block-size", "32"], []),
    "mla": ("tiny_mla_model", ["--block-size", "64"], ["--block-size", "64"],
            ["--block-size", "64"]),
}


def _model(maker: str) -> Path:
    mod = _load(maker, "live")
    fn = getattr(mod, "tiny_model_dir", None) or mod.tiny_mla_model_dir
    return Path(fn())


@pytest.fixture(scope="module", params=list(VARIANTS))
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    _servers.require_vllm()
    name = request.param
    maker, p_args, d_args, plain_args = VARIANTS[name]
    if name == "mla" and not _live.on_gpu():
        p_args = d_args = plain_args = ["--block-size", "16"]  # the CPU MLA kernel's only one
    model = _model(maker)
    logs = _servers.log_dir(f"gpu-{name}")
    db = logs / "events.db"
    run = f"gpu-{name}-{uuid.uuid4().hex[:8]}"
    cfg = {"kvplane_db": str(db), "kvplane_run": run, "kv_wait_timeout": 30.0,
           "transfer_timeout": 20.0}
    env = {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
    prefill = DeviceServer("prefill", model, logs, connector=dict(cfg), env=dict(env),
                           extra_args=list(p_args))
    decode = DeviceServer("decode", model, logs, connector=dict(cfg), env=dict(env),
                          extra_args=list(d_args))
    plain = DeviceServer("plain", model, logs, env=dict(env), extra_args=list(plain_args))
    started = time.monotonic()
    try:
        start_all([prefill, decode, plain], timeout=480)
    except Exception as exc:
        RESULTS["checks"].append({"variant": name, "check": "start", "error": str(exc)[-3000:]})
        _write()
        stop_all([prefill, decode, plain])
        raise
    print(f"\n{name}: three servers healthy after {time.monotonic() - started:.0f} s; {logs}")
    c = Cluster(name, prefill, decode, plain, db, run)
    try:
        yield c
    finally:
        stop_all([prefill, decode, plain])
        try:
            RESULTS["transfer_times"][name] = transfer_times(c.events())
        except Exception as exc:  # noqa: BLE001 - the report must still be written
            RESULTS["transfer_times"][name] = {"error": repr(exc)}
        _write()


def _write() -> None:
    env = os.environ.get("KVPLANE_GPU_REPORT")
    out = Path(env) if env else _servers.log_dir("gpu-variants")
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_variants.json").write_text(json.dumps(RESULTS, indent=1))


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_variant_matches_plain_server(cluster: Cluster, mode: str) -> None:
    client = PdClient(cluster.prefill, cluster.decode)
    for seed in (1, 2):
        p = prompt(100 * seed + len(mode), 150)
        xfer = f"{cluster.name}-{mode}-{seed}-{uuid.uuid4().hex[:6]}"
        if mode == "pull":
            _, d = client.pull(p, MAX_TOKENS, xfer=xfer)
        else:
            _, d = client.push(p, MAX_TOKENS, xfer=xfer)
        ref = complete(cluster.plain.url, p, MAX_TOKENS).token_ids
        exact = d.token_ids == ref
        evs = cluster.wait_for(xfer, ev.KVReceived, instance="decode")
        planned = only(evs, ev.TransferPlanned)
        failed = only(evs, ev.KVLoadFailed)
        RESULTS["checks"].append({
            "variant": cluster.name, "check": mode, "xfer": xfer, "token_exact": exact,
            "kv_received": bool(only(evs, ev.KVReceived, instance="decode")),
            "planned_bytes": planned[0].bytes if planned else None,
            "descriptors": planned[0].descriptors if planned else None,
            "load_failed": failed[0].reason if failed else None})
        _write()
        assert exact, xfer
        assert only(evs, ev.KVReceived, instance="decode"), f"decode never got the KV: {evs}"
        assert not failed, failed
        if cluster.name == "mla":
            # two layers, one latent per token, no K/V pair (bf16 on GPU, float32 on CPU)
            elt = 2 if _live.on_gpu() else 4
            assert planned[0].bytes == planned[0].num_tokens * 2 * LATENT * elt, planned
