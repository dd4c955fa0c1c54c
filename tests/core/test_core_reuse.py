"""Reuse decision and prefix identity: hashes, not conversation ids, decide what is reused."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplane.core.hashing import block_hashes, chain_ids, matching_prefix
from kvplane.core.reuse import RetainedHandle, decide_reuse

BS = 16


def toks(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 50000 for i in range(n)]


def handle_for(tokens: list[int], salt: str = "t1", expires_at: float = 100.0) -> RetainedHandle:
    return RetainedHandle("D", "L", len(tokens), BS, block_hashes(tokens, BS, salt), expires_at)


def decide(handle: RetainedHandle | None, prompt: list[int], *, salt: str = "t1",
           now: float = 0.0, local: int = 0, threshold: int = 64, read: float = 0.0,
           margin: float = 0.05):  # type: ignore[no-untyped-def]
    return decide_reuse(
        now=now, instance="P", request="r2", handle=handle,
        prompt_hashes=block_hashes(prompt, BS, salt), prompt_tokens=len(prompt),
        local_hit_tokens=local, threshold=threshold, estimated_read=read, margin=margin,
    )


# --- hashing ---------------------------------------------------------------------------------------


def test_only_full_blocks_are_hashed_and_hashes_chain() -> None:
    assert block_hashes(toks(15), BS) == ()
    assert len(block_hashes(toks(47), BS)) == 2
    a = toks(64)
    b = a[:16] + [a[16] + 1] + a[17:]  # one token edited in block 1
    ha, hb = block_hashes(a, BS), block_hashes(b, BS)
    assert ha[0] == hb[0] and ha[1] != hb[1]
    # the chain: a later block that is equal still differs because its prefix differs
    assert ha[2] != hb[2] and ha[3] != hb[3]
    assert matching_prefix(ha, hb) == 1
    with pytest.raises(ValueError):
        block_hashes(a, 0)


def test_salt_separates_tenants_and_chain_ids_chain() -> None:
    a = toks(32)
    assert matching_prefix(block_hashes(a, BS, "t1"), block_hashes(a, BS, "t2")) == 0
    assert chain_ids([1, 2, 3])[:2] == chain_ids([1, 2, 9])[:2]
    assert chain_ids([1, 2, 3])[2] != chain_ids([1, 2, 9])[2]
    assert chain_ids([1, 2]) != chain_ids([1, 2], salt="x")
    assert chain_ids([9, 2])[1] != chain_ids([1, 2])[1]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(a=st.lists(st.integers(0, 3), max_size=80), b=st.lists(st.integers(0, 3), max_size=80))
def test_shared_hashes_exactly_when_shared_blocks(a: list[int], b: list[int]) -> None:
    k = matching_prefix(block_hashes(a, 4), block_hashes(b, 4))
    full = min(len(a), len(b)) // 4
    same = 0
    while same < full and a[same * 4 : same * 4 + 4] == b[same * 4 : same * 4 + 4]:
        same += 1
    assert k == same


# --- decision ---------------------------------------------------------------------------------------


def test_same_history_grown_is_read() -> None:
    turn1 = toks(200)
    d = decide(handle_for(turn1), turn1 + toks(50, seed=9))
    assert d.outcome == "read"
    assert d.matched_tokens == 192  # 12 full blocks of the 200 retained tokens
    assert d.remote_tokens == 192 and d.threshold == 64 and d.lease == "L"


def test_edited_history_is_reused_only_up_to_the_edit() -> None:
    turn1 = toks(200)
    edited = list(turn1)
    edited[40] += 1  # block 2 changed
    d = decide(handle_for(turn1), edited + toks(50, seed=9))
    assert d.matched_tokens == 32
    assert d.outcome == "recompute"  # 32 < 64
    edited[0] += 1  # first block changed: nothing at all
    d = decide(handle_for(turn1), edited)
    assert d.outcome == "mismatch" and d.matched_tokens == 0


def test_other_conversation_is_never_reused() -> None:
    d = decide(handle_for(toks(200, seed=1)), toks(300, seed=2))
    assert d.outcome == "mismatch" and d.matched_tokens == 0 and d.remote_tokens == 0


def test_other_tenant_salt_is_never_reused() -> None:
    turn1 = toks(200)
    d = decide(handle_for(turn1, salt="tenant-a"), turn1 + toks(20), salt="tenant-b")
    assert d.outcome == "mismatch"


def test_threshold_boundary() -> None:
    turn1 = toks(64)
    d = decide(handle_for(turn1), turn1 + [1, 2, 3], threshold=64)
    assert d.outcome == "read" and d.remote_tokens == 64
    d = decide(handle_for(turn1), turn1 + [1, 2, 3], threshold=65)
    assert d.outcome == "recompute" and d.remote_tokens == 64
    d = decide(handle_for(turn1), turn1 + [1, 2, 3], threshold=0)
    assert d.outcome == "read"


def test_never_reuses_the_last_prompt_token() -> None:
    turn1 = toks(64)
    d = decide(handle_for(turn1), turn1, threshold=0)  # prompt is exactly the retained KV
    assert d.matched_tokens == 48  # 63 tokens allowed, rounded down to whole blocks


def test_local_hits_are_not_read_again() -> None:
    turn1 = toks(256)
    prompt = turn1 + toks(10)
    d = decide(handle_for(turn1), prompt, local=128)
    assert d.outcome == "read" and d.matched_tokens == 256 and d.remote_tokens == 128
    d = decide(handle_for(turn1), prompt, local=224)
    assert d.outcome == "recompute" and d.remote_tokens == 32
    d = decide(handle_for(turn1), prompt, local=400)
    assert d.outcome == "recompute" and d.remote_tokens == 0


def test_expired_or_about_to_expire_falls_back() -> None:
    turn1 = toks(200)
    prompt = turn1 + toks(20)
    d = decide(handle_for(turn1, expires_at=10.0), prompt, now=10.0)
    assert d.outcome == "expired" and d.matched_tokens == 192
    d = decide(handle_for(turn1, expires_at=10.0), prompt, now=9.0, read=0.95, margin=0.05)
    assert d.outcome == "refused"
    d = decide(handle_for(turn1, expires_at=10.0), prompt, now=9.0, read=0.9, margin=0.05)
    assert d.outcome == "read"


def test_miss_without_handle() -> None:
    d = decide(None, toks(100))
    assert d.outcome == "miss" and d.lease is None and d.matched_tokens == 0


def test_handle_shorter_than_its_hashes_is_capped_by_num_tokens() -> None:
    turn1 = toks(256)
    h = RetainedHandle("D", "L", 100, BS, block_hashes(turn1, BS, "t1"), 50.0)
    d = decide(h, turn1 + [1], threshold=0)
    assert d.matched_tokens == 96
