"""FP8 KV caches (`--kv-cache-dtype fp8`) through the connector, on vLLM's CPU build.

All three servers (prefill and decode with the connector, the plain reference) store KV in
FP8; the connector registers and moves those bytes like any others. Pull and push in all three
arrival orders must give the plain FP8 server's greedy tokens, and the run must replay clean.
The tests are the GPU live suite's own (tests/gpu/gpu_live.py).
"""

from __future__ import annotations

import kvplane_gpu_live as _suite

pytestmark = _suite.pytestmark
SERVER_ARGS = ["--kv-cache-dtype", "fp8"]

cluster = _suite.cluster
test_pull_matches_plain_server = _suite.test_pull_matches_plain_server
test_push_matches_plain_server = _suite.test_push_matches_plain_server
test_recorded_run_replays_without_violation = _suite.test_recorded_run_replays_without_violation


def test_the_servers_stored_kv_in_fp8(cluster) -> None:  # type: ignore[no-untyped-def]
    for s in (cluster.prefill, cluster.decode, cluster.plain):
        assert "kv_cache_dtype=fp8" in s.log_path.read_text(errors="replace"), s.name
