"""vLLM 0.25.1's way of recomputing failed loads, exercised on the vLLM installed here.

0.25.1 has no `failed_recving`: it recomputes a failed load only when the connector names the
load's blocks in `get_block_ids_with_load_errors()`. The servers here are started with
KVPLANE_VLLM_RESULTS=finished_and_load_errors, so the connector reports the way it does on
0.25.1, and vLLM 0.32 (which still calls `get_finished` and still recomputes by block id) must
give the plain server's tokens after each fault: a pull from an unreachable source, and a push
decode leg whose prefill never comes. A healthy pull and the run's replay are checked too.

The tests are the GPU live suite's own (tests/gpu/gpu_live.py), on this machine's CPU build.
"""

from __future__ import annotations

import kvplane_gpu_live as _suite

pytestmark = _suite.pytestmark
SERVER_ENV = {"KVPLANE_VLLM_RESULTS": "finished_and_load_errors"}

cluster = _suite.cluster
test_pull_matches_plain_server = _suite.test_pull_matches_plain_server
test_unreachable_source_is_recomputed = _suite.test_unreachable_source_is_recomputed
test_push_whose_prefill_never_comes_is_recomputed = (
    _suite.test_push_whose_prefill_never_comes_is_recomputed)
test_recorded_run_replays_without_violation = _suite.test_recorded_run_replays_without_violation


def test_the_servers_reported_the_way_0_25_1_does(cluster) -> None:  # type: ignore[no-untyped-def]
    assert cluster.report.api == "finished_and_load_errors"
