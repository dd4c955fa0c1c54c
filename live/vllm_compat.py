"""What each supported vLLM release calls on a KV connector and what it expects back.

vLLM's connector API (`KVConnectorBase_V1`) moves between releases. Everything that differs is
decided here, once, when the connector class is built; the facade (`connector.py`) asks this
module and never tests versions itself.

Supported: vLLM 0.25.1 to 0.32 (tested: 0.25.1 CUDA on an H200, 0.32 CPU build in CI).

How the releases differ, as far as the connector is concerned:
- Finished transfers. 0.32 calls `get_transfer_results(finished_req_ids)` and takes a
  `KVConnectorTransferResults(finished_sending, finished_recving, failed_recving)`: a request
  whose load failed is named in `failed_recving` and vLLM recomputes its prompt. 0.25.1 has no
  such class: it calls `get_finished(finished_req_ids) -> (sending, recving)` and then
  `get_block_ids_with_load_errors() -> set[int]`, and recomputes a request only when one of its
  blocks is named there (its computed tokens are cut back to the first bad block). So on 0.25.1
  a failed load is reported as finished *and* its external blocks as load errors, in the same
  step; on 0.32 load errors stay empty (naming blocks there too would make vLLM handle the
  failure twice).
- KV cache layout. Both ask the connector class `get_required_kvcache_layout(vllm_config)`.
  0.25.1 understands "NHD"/"HND"; 0.32 has `KVCacheLayout` names and keeps "NHD"/"HND" as
  aliases (of LBNHC/LBHNC). We ask for "HND" (per layer: blocks outermost, then K/V, then
  heads), so that every layer is one region whose blocks are dense runs of bytes and a head's
  slice of a block is contiguous; MLA's one latent per layer has no heads to order (None).
- The constructor takes `kv_cache_config` in both; 0.25.1 may pass None on the worker side.

`detect()` inspects the installed vLLM (feature tests, not version strings, so a patch release
that keeps the API keeps working); `api_for(version, has_transfer_results)` is the same decision
from recorded facts, used by the tests that check each release's recorded signatures.

Test hook: KVPLANE_VLLM_RESULTS=finished_and_load_errors makes a newer vLLM get 0.25.1's
style (0.32 still calls `get_finished` through its default `get_transfer_results` and still
recomputes by block id for one KV cache group), so the CPU suite exercises the path 0.25.1
depends on, on the vLLM it has.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any, Literal

MIN_VERSION = (0, 25, 1)
MAX_TESTED = (0, 32)
SUPPORTED = "vLLM 0.25.1 to 0.32"

ResultsStyle = Literal["transfer_results", "finished_and_load_errors"]

# The layout we need: per layer, blocks outermost and dense, heads major within K and V.
REQUIRED_LAYOUT = "HND"

FORCE_ENV = "KVPLANE_VLLM_RESULTS"

_BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"


@dataclass(frozen=True, slots=True)
class VllmApi:
    """The parts of one vLLM release's connector contract the facade adapts to."""

    version: str
    results: ResultsStyle
    # the hooks vLLM calls on a worker to collect finished transfers, in call order
    worker_result_hooks: tuple[str, ...]

    @property
    def reports_failed_requests(self) -> bool:
        """vLLM takes failed loads by request id (0.32); else by block id (0.25.1)."""
        return self.results == "transfer_results"


def _api(version: str, results: ResultsStyle) -> VllmApi:
    hooks = (("get_transfer_results", "get_block_ids_with_load_errors")
             if results == "transfer_results"
             else ("get_finished", "get_block_ids_with_load_errors"))
    return VllmApi(version, results, hooks)


def parse_version(text: str) -> tuple[int, ...]:
    """"0.25.1+cu130" -> (0, 25, 1); "0.32.0rc2.dev5" -> (0, 32, 0)."""
    out = []
    for part in text.split("+", 1)[0].split("."):
        digits = ""
        for ch in part:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        out.append(int(digits))
        if len(digits) != len(part):
            break
    return tuple(out)


def check_version(version: str) -> None:
    """Refuse a release older than the oldest one whose contract this module knows."""
    v = parse_version(version)
    if v and v < MIN_VERSION:
        raise RuntimeError(f"KvplaneConnector supports {SUPPORTED}; this is vLLM {version}")


def api_for(version: str, has_transfer_results: bool) -> VllmApi:
    check_version(version)
    return _api(version, "transfer_results" if has_transfer_results
                else "finished_and_load_errors")


def detect() -> VllmApi:
    """The installed vLLM's contract (imports vLLM)."""
    import vllm

    base = importlib.import_module(_BASE)
    version = str(getattr(vllm, "__version__", "0"))
    forced = os.environ.get(FORCE_ENV, "").strip()
    if forced:
        if forced != "finished_and_load_errors":
            raise RuntimeError(f"{FORCE_ENV}={forced!r}: only finished_and_load_errors "
                               "(vLLM 0.25.1's style) can be forced")
        check_version(version)
        return _api(version, "finished_and_load_errors")
    return api_for(version, hasattr(base, "KVConnectorTransferResults"))


def transfer_results_class() -> Any:
    """vLLM's `KVConnectorTransferResults` (0.32 style only)."""
    return importlib.import_module(_BASE).KVConnectorTransferResults


def required_layout(vllm_config: Any) -> str | None:
    """The layout to ask vLLM for: "HND", or None for MLA (one latent per layer, no heads)."""
    model = getattr(vllm_config, "model_config", None)
    if model is not None and bool(getattr(model, "use_mla", False)):
        return None
    return REQUIRED_LAYOUT


def load_error_blocks(block_ids: list[int], local_tokens: int, external_tokens: int,
                      block_size: int) -> tuple[int, ...]:
    """The blocks an external load fills: after the locally cached prefix, enough blocks for
    `external_tokens`. These are what 0.25.1 must hear about when the load fails."""
    if external_tokens <= 0 or block_size <= 0:
        return ()
    first = local_tokens // block_size
    last = -(-(local_tokens + external_tokens) // block_size)
    return tuple(block_ids[first:last])
