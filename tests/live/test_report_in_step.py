"""A finished load reaches vLLM in the step output the scheduler learns of it in.

The scheduler half without vLLM (the stand-ins of test_connector_unit): a load the core decided
finished well is taken for the step output (`take_loaded`) and then never repeated through the
workers (vLLM asserts on a load reported twice); a failed load stays on the workers' path. And
the feature test that decides whether the facade may do it (`loads_reported_in_output`) reads
the order of the two steps in a scheduler's `_update_from_kv_xfer_finished`.
"""

from __future__ import annotations

from typing import Any

import kvplane_live_servers

from kvplane.core import events as ev
from kvplane.live.connector import loads_reported_in_output
from kvplane.live.connector_wire import Fact

unit = kvplane_live_servers.helper("test_connector_unit")


def _pull_until_read(pair: Any, xfer: str) -> tuple[Any, Any]:
    """A pull whose READ has just ended on decode (the fact applied, no step since)."""
    prompt = unit.PROMPT
    _, (_, params) = unit.run_prefill(pair, xfer, prompt, [1, 2, 3, 4, 5])
    D = pair.halves["D"]
    rd = unit.request(f"{xfer}-d", params, prompt)
    D.on_new_request(rd)
    n, load = D.get_num_new_matched_tokens(rd, 0)
    assert load
    D.update_state_after_alloc(rd, [7, 8, 9, 10, 11], n)
    meta = D.build_connector_meta()
    (order,) = meta.orders
    return rd, order


def test_a_finished_load_is_taken_once_and_not_repeated_by_the_workers() -> None:
    pair = unit.Pair()
    pair.half("P")
    D = pair.half("D")
    rd, order = _pull_until_read(pair, "x1")
    assert D.take_loaded() == set()  # nothing decided yet
    D.on_fact(Fact("read_done", order.xfer, order.attempt, pair.clock(), purpose=order.purpose,
                   nbytes=1, rank=order.rank, peer_rank=order.peer_rank))
    assert pair.of(ev.KVReceived, instance="D")
    assert D.take_loaded() == {rd.request_id}
    assert D.take_loaded() == set()
    meta = D.build_connector_meta()
    assert rd.request_id not in meta.finished_recving | meta.failed_recving


def test_a_failed_load_stays_on_the_workers_path() -> None:
    pair = unit.Pair()
    pair.half("P")
    D = pair.half("D")
    rd, order = _pull_until_read(pair, "x2")
    D.on_fact(Fact("read_done", order.xfer, order.attempt, pair.clock(), ok=False,
                   reason="peer gone", purpose=order.purpose, rank=order.rank,
                   peer_rank=order.peer_rank))
    assert D.take_loaded() == set()
    meta = D.build_connector_meta()
    assert rd.request_id in meta.finished_recving and rd.request_id in meta.failed_recving


def test_loads_handed_back_go_to_the_workers() -> None:
    pair = unit.Pair()
    pair.half("P")
    D = pair.half("D")
    rd, order = _pull_until_read(pair, "x3")
    D.on_fact(Fact("read_done", order.xfer, order.attempt, pair.clock(), purpose=order.purpose,
                   nbytes=1, rank=order.rank, peer_rank=order.peer_rank))
    D.put_back_loaded(D.take_loaded())
    assert rd.request_id in D.build_connector_meta().finished_recving


class _HookFirst:  # vLLM 0.25.1 and 0.32: the connector sees the output, then vLLM reads it
    def _update_from_kv_xfer_finished(self, out: Any) -> None:
        """The workers' finished_recving ..."""
        self.connector.update_connector_output(out)  # type: ignore[attr-defined]
        for req_id in out.finished_recving or ():
            print(req_id)


class _ReadFirst:  # a release that read finished loads before calling the connector
    def _update_from_kv_xfer_finished(self, out: Any) -> None:
        for req_id in out.finished_recving or ():
            print(req_id)
        self.connector.update_connector_output(out)  # type: ignore[attr-defined]


class _NoSuchStep:
    pass


def test_the_feature_test_reads_the_order_of_vllms_steps() -> None:
    assert loads_reported_in_output(_HookFirst) is True
    assert loads_reported_in_output(_ReadFirst) is False
    assert loads_reported_in_output(_NoSuchStep) is False


def test_the_installed_vllm_reads_the_output_after_the_connector() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    assert loads_reported_in_output(Scheduler) is True
