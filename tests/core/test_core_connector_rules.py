"""The per-request rules of a connector and a router (kvplane.core.connector_rules,
router_rules, signing): the decisions the live connector and router take from the core."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvplane.core import connector_rules as rules
from kvplane.core import router_rules as rr
from kvplane.core import signing
from kvplane.core.errors import PeerError


def test_first_request_owns_an_exchange_and_replays_are_refused() -> None:
    c = rules.Claims(remember=2)
    assert c.claim(("decode", "x", 0), "r1")
    assert c.claim(("decode", "x", 0), "r1")  # asking again: still the owner
    assert not c.claim(("decode", "x", 0), "r2")  # n>1 sibling, batch entry or replay
    assert c.claim(("decode", "x", 1), "r2")  # a new attempt is a new exchange
    assert c.claim(("prefill", "x", 0), "r3")  # the other side of it
    assert c.owner(("decode", "x", 0)) is None  # forgotten beyond `remember`


@given(prompt=st.integers(1, 400), offered=st.integers(0, 400), hit_blocks=st.integers(0, 20),
       bs=st.sampled_from([1, 4, 16, 32]))
def test_decode_loads_only_past_its_local_hit(prompt: int, offered: int, hit_blocks: int,
                                              bs: int) -> None:
    hit = hit_blocks * bs
    w = rules.decode_load(prompt, offered, hit, bs)
    have = min(prompt, offered)
    if have <= hit:
        assert w is None
        return
    assert w is not None
    assert w.skip_blocks * bs == hit and w.num_tokens == have - hit
    blocks = list(range(100, 100 + -(-prompt // bs)))
    assert w.dst(blocks) == tuple(blocks[hit_blocks:])  # never a block of the hit


def test_a_hit_off_a_block_boundary_loads_nothing() -> None:
    assert rules.decode_load(100, 100, 33, 32) is None
    assert rules.decode_load(100, 100, 32, 32) == rules.LoadWindow(1, 68, 1)
    assert rules.decode_load(100, 100, 0, 32) == rules.LoadWindow(0, 100, 0)
    assert rules.decode_load(100, 40, 0, 32) == rules.LoadWindow(0, 40, 0)


def test_unequal_block_sizes_skip_the_same_tokens_on_both_sides() -> None:
    # decode (blocks of 64) hit 64 tokens: the source (blocks of 32) skips 2 blocks
    w = rules.decode_load(200, 200, 64, 64, src_block_size=32)
    assert w == rules.LoadWindow(1, 136, 2)
    assert w.src([10, 11, 12, 13]) == (12, 13) and w.dst([20, 21, 22]) == (21, 22)
    # a hit that ends inside a source block cannot be skipped there: load nothing
    assert rules.decode_load(200, 200, 32, 32, src_block_size=64) is None
    # decode's 4 blocks of 16 = 64 tokens = prefill's first block of 64
    assert rules.push_window(4, 100, 64, 16) == rules.LoadWindow(4, 36, 1)
    with pytest.raises(PeerError, match="does not end on a block of 64"):
        rules.push_window(2, 100, 64, 16)
    assert rules.push_window(4, 100, 32, 16) == rules.LoadWindow(4, 36, 2)
    with pytest.raises(PeerError, match="covers the whole prompt"):
        rules.push_window(4, 64, 32, 16)


def test_a_multi_stream_transfer_ends_once_with_every_stream() -> None:
    t = rules.StreamTally(frozenset({(0, 0), (1, 0)}))
    assert t.end((0, 0), True) is None
    assert t.end((0, 0), False, "late duplicate") is None  # a second end is ignored
    with pytest.raises(PeerError, match="not one of"):
        t.end((3, 0), True)
    assert t.end((1, 0), True) == (True, "")
    f = rules.StreamTally(frozenset({(0, 0), (0, 1)}))
    assert f.end((0, 1), False, "timed out") is None  # waits for the other stream
    assert f.end((0, 0), True) == (False, "rank 0->1: timed out")
    one = rules.StreamTally(frozenset({(0, 0)}))
    assert one.end((0, 0), False, "refused") == (False, "refused")


def test_reuse_split_retain_ttl_deadlines_attempts() -> None:
    assert rules.reuse_split([5, 6, 7, 8], 33, 32) == ((5, 6), (7, 8))
    assert rules.reuse_split([5, 6], 0, 32) == ((), (5, 6))
    assert rules.retain_decision(None, True, True) and not rules.retain_decision(None, False, True)
    assert not rules.retain_decision(True, True, False)
    assert rules.retain_decision(True, False, True) and not rules.retain_decision(False, True, True)
    assert rules.retain_ttl(480, None) == 480
    assert rules.retain_ttl(480, 1e9) == 480  # a request may only shorten it
    assert rules.retain_ttl(480, -5) == 0.001
    assert rules.read_deadline(10, 20, 25, margin=1) == 24
    assert rules.read_deadline(10, 20, None) == 30
    assert rules.next_attempt(3) == 4


def test_reuse_salt_separates_models_adapters_salts_and_images() -> None:
    base = rules.reuse_salt("s", model="m")
    assert rules.reuse_salt("", ) == ""
    others = [rules.reuse_salt("s", model="m2"), rules.reuse_salt("s", model="m", lora="a"),
              rules.reuse_salt("s", model="m", cache_salt="tenant-1"),
              rules.reuse_salt("s", model="m", mm_hashes=["img1"]),
              rules.reuse_salt("t", model="m")]
    assert len({base, *others}) == 6
    assert rules.reuse_salt("s", model="m", cache_salt="c") == \
        rules.reuse_salt("s", model="m", cache_salt="c")


def test_signed_handles_refuse_forgery_other_transfers_and_expiry() -> None:
    key = b"k" * 32
    h = signing.sign(key, {"xfer": "x1", "blocks": [1, 2], "expires_at": 100.0})
    signing.verify(key, h)
    signing.check_bound(h, xfer="x1", now=99.0)
    for bad in ({**h, "blocks": [7, 8]}, {k: v for k, v in h.items() if k != "sig"}, "x"):
        with pytest.raises(signing.SignatureError):
            signing.verify(key, bad)
    with pytest.raises(signing.SignatureError):
        signing.verify(b"other-key-000000", h)
    with pytest.raises(signing.SignatureError, match="expired"):
        signing.check_bound(h, xfer="x1", now=100.0)
    with pytest.raises(signing.SignatureError, match="belongs to transfer"):
        signing.check_bound(h, xfer="x2", now=1.0)


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [[1, 2], [3]]}, "prompt"),
    ({"prompt": "a", "n": 0}, "n"),
    ({"prompt": "a", "n": 2, "temperature": 0}, "n"),
    ({"prompt": "a", "best_of": 2}, "best_of"),
    ({"prompt": "a", "use_beam_search": True}, "use_beam_search"),
    ({"prompt": "a", "prompt_logprobs": 1}, "prompt_logprobs"),
    ({"prompt": "a", "echo": True, "logprobs": 1}, "echo"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "max_tokens": -3}, "max_tokens"),
    ({"prompt": "a", "max_tokens": 10_000}, "max_tokens"),
    ({"prompt": "a", "max_tokens": True}, "max_tokens"),
    ({"prompt": "a", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ({"prompt": "a", "min_tokens": -1}, "min_tokens"),
])
def test_router_refuses_what_pd_cannot_serve(body: dict[str, object], param: str) -> None:
    problem = rr.check_request(body, chat=False, max_model_len=512)
    assert problem is not None and problem.param == param and problem.message


@pytest.mark.parametrize("body", [
    {"prompt": "a"}, {"prompt": [1, 2, 3], "n": 3, "temperature": 0.8},
    {"prompt": ["one"]}, {"prompt": "a", "max_tokens": 512, "min_tokens": 512},
    {"prompt": "a", "best_of": 1}, {"prompt": "a", "logprobs": 2},
])
def test_router_serves_the_rest(body: dict[str, object]) -> None:
    assert rr.check_request(body, chat=False, max_model_len=512) is None


def test_chat_max_completion_tokens_checked() -> None:
    bad = rr.check_request({"messages": [], "max_completion_tokens": 0}, chat=True)
    assert bad is not None and bad.param == "max_completion_tokens"


def test_prefill_leg_is_one_token_without_output_shaping_fields() -> None:
    body = {"prompt": "a", "max_tokens": 50, "min_tokens": 10, "n": 3, "best_of": 1,
            "logprobs": 2, "stream": True, "stream_options": {"include_usage": True},
            "temperature": 0.7, "seed": 3}
    out = rr.prefill_fields(body, chat=False)
    assert out == {"prompt": "a", "max_tokens": 1, "n": 1, "stream": False,
                   "temperature": 0.7, "seed": 3}
    assert body["min_tokens"] == 10  # the client's body is untouched
    chat = rr.prefill_fields({"messages": [], "max_completion_tokens": 9}, chat=True)
    assert chat["max_completion_tokens"] == 1 and chat["max_tokens"] == 1


def test_retry_and_put_back() -> None:
    assert rr.retry_prefill_without_reuse(True, "status", 500)
    assert not rr.retry_prefill_without_reuse(True, "status", 400)
    assert not rr.retry_prefill_without_reuse(False, "status", 503)
    assert not rr.retry_prefill_without_reuse(True, "timeout", 0)
    assert rr.put_back(stored_new=False, taken_expires_at=10, now=5, table_has_newer=False)
    assert not rr.put_back(stored_new=True, taken_expires_at=10, now=5, table_has_newer=False)
    assert not rr.put_back(stored_new=False, taken_expires_at=10, now=10, table_has_newer=False)
    assert not rr.put_back(stored_new=False, taken_expires_at=10, now=5, table_has_newer=True)


@given(hit_blocks=st.integers(0, 6), remote=st.integers(0, 200), bs=st.sampled_from([4, 16]))
def test_a_reuse_read_lands_past_the_local_hit_at_the_same_positions(hit_blocks: int,
                                                                     remote: int,
                                                                     bs: int) -> None:
    retained = list(range(500, 520))
    blocks = list(range(10, 30))
    src, dst = rules.reuse_read(retained, blocks, hit_blocks * bs, remote, bs)
    n = min(-(-remote // bs), len(blocks) - hit_blocks)
    assert dst == tuple(blocks[hit_blocks:hit_blocks + n])  # never a block of the hit
    assert src == tuple(retained[hit_blocks:hit_blocks + len(dst)])  # same positions


def test_the_router_asks_to_retain_only_for_a_conversation_in_bidirectional_mode() -> None:
    assert rr.asks_retain("bidirectional", True)
    assert not rr.asks_retain("bidirectional", False)
    assert not rr.asks_retain("pull", True) and not rr.asks_retain("push", True)


@pytest.mark.parametrize(("stored", "current", "expires", "want"), [
    (True, "new", 50.0, "release"),  # a newer turn's KV replaced it
    (True, "old", 50.0, "keep"),  # the table still names it
    (False, None, 50.0, "put_back"),  # nothing newer, still alive
    (False, None, 5.0, "drop"),  # expired: let it go
    (False, "other", 50.0, "drop"),  # another turn stored a newer one meanwhile
])
def test_what_the_router_does_with_a_taken_handle_when_the_turn_ends(
        stored: bool, current: str | None, expires: float, want: str) -> None:
    assert rr.after_turn(stored_new=stored, taken_lease="old", current_lease=current,
                         taken_expires_at=expires, now=10.0) == want


def test_a_registration_for_another_producer_tp_is_refused() -> None:
    assert rules.registration_mismatch(2, 2) is None
    assert "expects a prefill of TP 1, this one has TP 2" in (rules.registration_mismatch(1, 2)
                                                                or "")
