"""The connector across vLLM releases, KV cache layouts and NIXL backends (no servers).

- Each supported release's connector contract (recorded from its source in tests/data/vllm_api,
  plus the installed one read from its own file): the compat module picks that release's way of
  reporting finished and failed loads, and every hook the facade implements exists in that
  release with the parameters vLLM passes.
- The facade built for each style has exactly that style's result hooks.
- Layer caches in every layout vLLM hands out (NHD, HND as a permuted view, MLA's one latent,
  FP8) become one region per layer, and real NIXL moves a block between two of them byte for
  byte; layouts the connector cannot address are refused with the reason.
- The NIXL backend is the one configured, or a clear error: never another one silently.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kvplane.live import vllm_compat
from kvplane.live.connector_worker import (
    Geometry,
    block_ids,
    byte_runs,
    cache_region,
    cache_regions,
)
from kvplane.live.transport import Status, Transport, TransportError, nixl_backend

DATA = Path(__file__).resolve().parent.parent / "data" / "vllm_api"
RECORDED = sorted(p.stem for p in DATA.glob("*.json"))


def _load(name: str) -> ModuleType:
    full = f"kvplane_live_{name}"
    if full not in sys.modules:
        spec = importlib.util.spec_from_file_location(full, Path(__file__).with_name(f"{name}.py"))
        assert spec is not None and spec.loader is not None
        sys.modules[full] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[full]


contract = _load("vllm_api").contract


def recorded(version: str) -> dict[str, Any]:
    return dict(json.loads((DATA / f"{version}.json").read_text()))


def installed() -> tuple[str, dict[str, Any]]:
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1 import base

    return str(vllm.__version__), contract(Path(base.__file__).read_text())


# ---- which style each release gets ---------------------------------------------------------------


def test_the_supported_releases_are_recorded() -> None:
    assert {"0.25.1", "0.32"} <= set(RECORDED)


@pytest.mark.parametrize("version", RECORDED)
def test_each_recorded_release_gets_its_own_result_hooks(version: str) -> None:
    c = recorded(version)
    api = vllm_compat.api_for(version, "KVConnectorTransferResults" in c["classes"])
    expected = "finished_and_load_errors" if version == "0.25.1" else "transfer_results"
    assert api.results == expected
    for hook in api.worker_result_hooks:
        assert hook in c["methods"], f"vLLM {version} has no {hook}"
    assert "get_required_kvcache_layout" in c["methods"]


def test_the_installed_release_is_detected_from_its_features() -> None:
    version, c = installed()
    api = vllm_compat.detect()
    assert api.version == version
    assert api.reports_failed_requests == ("KVConnectorTransferResults" in c["classes"])


def test_too_old_a_release_is_refused_by_name() -> None:
    with pytest.raises(RuntimeError, match="0.25.1 to 0.32.*0.24.0"):
        vllm_compat.api_for("0.24.0", False)
    assert vllm_compat.parse_version("0.25.1+cu130") == (0, 25, 1)
    assert vllm_compat.parse_version("0.32.0rc2.dev5") == (0, 32, 0)


def _facade(style: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The facade class as built for a style (on the installed vLLM)."""
    from kvplane.live import connector

    version = "0.32.0" if style == "transfer_results" else "0.25.1"
    monkeypatch.setattr(vllm_compat, "detect",
                        lambda: vllm_compat.api_for(version, style == "transfer_results"))
    monkeypatch.setattr(connector, "_BUILT", {})
    return connector._build()["KvplaneConnector"]


@pytest.mark.parametrize("style", ["transfer_results", "finished_and_load_errors"])
def test_the_facade_has_its_styles_hooks_only(style: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    own = set(vars(_facade(style, monkeypatch)))
    if style == "transfer_results":
        assert "get_transfer_results" in own and "get_finished" not in own
        assert "get_block_ids_with_load_errors" not in own  # 0.32: failures by request id
    else:
        assert {"get_finished", "get_block_ids_with_load_errors"} <= own
        assert "get_transfer_results" not in own


@pytest.mark.parametrize("version", RECORDED)
def test_every_hook_the_facade_implements_binds_in_each_release(
        version: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import inspect

    c = recorded(version)
    style = vllm_compat.api_for(version, "KVConnectorTransferResults" in c["classes"]).results
    cls = _facade(style, monkeypatch)
    checked = 0
    for name, fn in vars(cls).items():
        fn = getattr(fn, "__func__", fn)
        if not callable(fn) or name not in c["methods"]:
            continue
        ours = [p for p in inspect.signature(fn).parameters if p not in ("cls", "kwargs")]
        theirs = [p for p in c["methods"][name] if p not in ("cls", "kwargs")]
        assert ours == theirs, f"{name}: vLLM {version} passes {theirs}, the facade takes {ours}"
        checked += 1
    assert checked >= 20, f"only {checked} hooks compared: is the recorded contract empty?"


def test_load_error_blocks_are_the_blocks_the_load_fills() -> None:
    blocks = [7, 8, 9, 10, 11]
    assert vllm_compat.load_error_blocks(blocks, 0, 70, 32) == (7, 8, 9)
    assert vllm_compat.load_error_blocks(blocks, 64, 40, 32) == (9, 10)  # after a local hit
    assert vllm_compat.load_error_blocks(blocks, 0, 0, 32) == ()


def test_mla_asks_for_no_layout_and_attention_for_hnd() -> None:
    class Model:
        use_mla = True

    class Config:
        model_config = Model()

    assert vllm_compat.required_layout(Config()) is None
    Model.use_mla = False
    assert vllm_compat.required_layout(Config()) == "HND"


# ---- layer caches as regions -------------------------------------------------------------------


def _fa_hnd(num_blocks: int, block: int, heads: int, dim: int, dtype: Any) -> Any:
    """How vLLM 0.25.1 hands FlashAttention's cache in the HND layout: logical shape
    (blocks, 2, block, heads, dim), memory (blocks, 2, heads, block, dim)."""
    import torch

    raw = torch.zeros(num_blocks, 2, heads, block, dim, dtype=dtype)
    return raw.permute(0, 1, 3, 2, 4)


def test_hnd_views_fp8_and_mla_caches_become_one_region_per_layer() -> None:
    import torch

    hnd = _fa_hnd(6, 16, 2, 8, torch.bfloat16)
    assert not hnd.is_contiguous()
    r = cache_region("layers.0.attn", hnd)
    assert (r.num_blocks, r.block_bytes, r.block_stride) == (6, 2 * 16 * 2 * 8 * 2, 1024)
    assert r.flat.is_contiguous() and r.flat.data_ptr() == hnd.data_ptr()
    assert r.nbytes == hnd.numel() * hnd.element_size()
    fp8 = torch.zeros(6, 2, 16, 2, 8, dtype=torch.float8_e4m3fn)
    assert cache_region("fp8", fp8).block_bytes == 2 * 16 * 2 * 8
    mla = torch.zeros(6, 16, 576, dtype=torch.bfloat16)  # one latent per token
    m = cache_region("mla", mla)
    assert (m.num_blocks, m.block_bytes) == (6, 16 * 576 * 2)


def test_layouts_without_dense_blocks_are_refused_with_the_reason() -> None:
    import torch

    kv_outer = torch.zeros(2, 6, 16, 2, 8).permute(1, 0, 2, 3, 4)  # K and V apart per block
    with pytest.raises(ValueError, match="not block-major"):
        cache_region("layers.0.attn", kv_outer)
    a, b = torch.zeros(6, 2, 16, 2, 8), torch.zeros(6, 2, 16, 4, 8)
    with pytest.raises(ValueError, match="several KV cache groups"):
        cache_regions({"layers.0.attn": a, "layers.1.attn": b})
    with pytest.raises(ValueError, match="split in 2 tensors"):
        cache_regions({"layers.0.attn": (a, a)})


def test_real_nixl_moves_hnd_blocks_byte_for_byte() -> None:
    """Two transports in one process (UCX over host memory): block 3 of two layers of an HND
    cache READ into block 1 of another's, checked through the logical views."""
    import torch

    src = {f"layers.{i}.attn": _fa_hnd(6, 16, 2, 8, torch.float32) for i in range(2)}
    dst = {f"layers.{i}.attn": _fa_hnd(6, 16, 2, 8, torch.float32) for i in range(2)}
    for i, t in enumerate(src.values()):
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(i)))
    regions = {}
    transports = {}
    for side, caches in (("src", src), ("dst", dst)):
        rs = cache_regions(caches)
        tr = Transport(f"compat-{side}-{time.time_ns() % 10**9}", granule=rs[0].block_bytes)
        for r in rs:
            tr.register(r.flat)
        regions[side], transports[side] = rs, tr
    try:
        geo = {s: Geometry(tuple(r.nbytes for r in rs), rs[0].block_stride,
                           rs[0].block_bytes, rs[0].num_blocks) for s, rs in regions.items()}
        peer = transports["dst"].add_peer(transports["src"].local_info())
        transports["src"].add_peer(transports["dst"].local_info())
        runs = byte_runs([(3, 1, 1)], geo["dst"], geo["src"], local_is_src=False)
        t = transports["dst"].post(peer, "READ", runs)
        deadline = time.monotonic() + 30
        while transports["dst"].poll(t) is Status.PENDING and time.monotonic() < deadline:
            transports["src"].progress()
        assert t.result is not None and t.result.ok, t.result
        for name in src:
            assert torch.equal(dst[name][1], src[name][3])
            assert not dst[name][0].any() and not dst[name][2].any()
        # the connector's own path: block ids, planned at block level
        ours, theirs = block_ids([(4, 2, 1)], geo["dst"], geo["src"], local_is_src=False)
        t = transports["dst"].post_blocks(peer, "READ", geo["dst"].layout(), ours,
                                          geo["src"].layout(), theirs)
        deadline = time.monotonic() + 30
        while transports["dst"].poll(t) is Status.PENDING and time.monotonic() < deadline:
            transports["src"].progress()
        assert t.result is not None and t.result.ok, t.result
        for name in src:
            assert torch.equal(dst[name][2], src[name][4])
            assert not dst[name][0].any() and not dst[name][3].any()
    finally:
        for tr in transports.values():
            tr.close()


def test_block_ids_cover_the_same_bytes_as_byte_runs() -> None:
    from kvplane.live.staging import block_runs_array

    g = Geometry((3 * 4096 * 10,) * 2, 3 * 4096, 2 * 4096, 10)  # strided: a gap per block
    orders = [(3, 1, 2), (7, 5, 1), (0, 9, 1)]
    ours, theirs = block_ids(orders, g, g, local_is_src=True)
    assert ours.tolist() == [3, 4, 7, 0] and theirs.tolist() == [1, 2, 5, 9]
    planned = block_runs_array(g.layout(), ours, g.layout(), theirs)
    assert sorted(map(tuple, planned.tolist())) == sorted(byte_runs(orders, g, g, True))
    back, there = block_ids(orders, g, g, local_is_src=False)
    assert back.tolist() == [1, 2, 5, 9] and there.tolist() == [3, 4, 7, 0]
    with pytest.raises(ValueError, match="past the cache"):
        block_ids([(9, 0, 2)], g, g, local_is_src=True)
    other = Geometry((3 * 4096 * 10,), 3 * 4096, 2 * 4096, 10)
    with pytest.raises(ValueError, match="layer count"):
        block_ids(orders, g, other, local_is_src=True)


# ---- the NIXL backend ----------------------------------------------------------------------------


def test_backend_names_are_checked_and_never_swapped() -> None:
    assert nixl_backend("ucx") == "UCX"
    assert nixl_backend(["LIBFABRIC"]) == "LIBFABRIC"
    with pytest.raises(TransportError, match="choose one of UCX, LIBFABRIC"):
        nixl_backend("GDS")
    with pytest.raises(TransportError, match="exactly one"):
        nixl_backend(["UCX", "LIBFABRIC"])


def test_a_backend_that_cannot_be_made_is_a_clear_error() -> None:
    """LIBFABRIC here: the plugin needs libfabric and the CUDA driver, neither on this machine
    (with them, scripts/gpu_live.sh tries it on the GPU machine)."""
    try:
        t = Transport(f"compat-lf-{time.time_ns() % 10**9}", backend="LIBFABRIC")
    except TransportError as exc:
        assert "LIBFABRIC" in str(exc) and "libfabric" in str(exc)
    else:  # a machine where it loads: then it is what we got, not UCX
        assert t.backend == "LIBFABRIC"
        t.close()
