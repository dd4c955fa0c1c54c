"""Sample events for the store's tests: one or more instances of every type in EVENT_TYPES,
built from the dataclass annotations (so a new event type is covered without editing tests),
plus Hypothesis strategies over the same annotations."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, Union

from hypothesis import strategies as st

from kvplane.core.events import EVENT_TYPES, DecodeBlocksReserved, Event, KVReceived

FIELDS_COMMON = ("at", "instance", "request")


def in_threads(target: Callable[..., Any], args: Sequence[Any]) -> list[Any]:
    """`target(arg)` for each of `args`, each in a thread of its own, all at once: their
    results in the order of `args` (an exception in any of them is raised here)."""
    with ThreadPoolExecutor(len(args)) as pool:
        futures = [pool.submit(target, a) for a in args]
        return [f.result() for f in futures]


def sample_value(hint: Any, name: str, i: int) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return args[i % len(args)]
    if origin in (Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        if type(None) in args and i % 3 == 2:
            return None
        return sample_value(options[i % len(options)], name, i)
    if origin is tuple:
        return tuple(sample_value(args[0], f"{name}{k}", i + k) for k in range(i % 4 + 2))
    if hint is int:
        return 3 + 7 * i + len(name)
    if hint is float:
        return 0.1 * (i + 1) + 1 / 3 + len(name)  # not exactly representable: tests exactness
    if hint is bool:
        return i % 2 == 0
    if hint is str:
        return f"{name}-{i}-ü\t\"'\\"  # quotes, a tab, a backslash and non-ASCII
    raise TypeError(f"no sample for {hint!r}")


def sample_event(cls: type[Event], i: int = 0) -> Event:
    hints = typing.get_type_hints(cls)
    values = {f.name: sample_value(hints[f.name], f.name, i) for f in dataclasses.fields(cls)}
    values["at"] = 12.5 + i / 7
    values["instance"] = f"instance-{i % 3}"
    values["request"] = None if i % 4 == 3 else f"req-{i % 5}"
    return cls(**values)


def every_type_samples(per_type: int = 3) -> list[Event]:
    return [sample_event(cls, i) for cls in EVENT_TYPES.values() for i in range(per_type)]


def schema3_samples(per_type: int = 3) -> list[Event]:
    """`every_type_samples` as a kvplane of event schema 3 made them (what the stores in
    tests/data were written with): less `DecodeBlocksReserved`, `KVReceived` without the
    notifications folded in (schema 4 added both)."""
    out: list[Event] = []
    for e in every_type_samples(per_type):
        if isinstance(e, DecodeBlocksReserved):
            continue
        if isinstance(e, KVReceived):
            e = dataclasses.replace(e, src_ranks=(), dst_ranks=())
        out.append(e)
    return out


# --- Hypothesis ---

_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
                max_size=12)  # fmt: skip
_floats = st.floats(allow_nan=False, allow_infinity=False)


def strategy_for(hint: Any) -> st.SearchStrategy[Any]:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return st.sampled_from(args)
    if origin in (Union, types.UnionType):
        return st.one_of([strategy_for(a) for a in args])
    if origin is tuple:
        return st.lists(strategy_for(args[0]), max_size=6).map(tuple)
    if hint is type(None):
        return st.none()
    if hint is int:
        return st.integers(-(2**53), 2**53)
    if hint is float:
        return _floats
    if hint is bool:
        return st.booleans()
    if hint is str:
        return _text
    raise TypeError(f"no strategy for {hint!r}")


def event_strategy(cls: type[Event]) -> st.SearchStrategy[Event]:
    hints = typing.get_type_hints(cls)
    return st.builds(cls, **{f.name: strategy_for(hints[f.name]) for f in dataclasses.fields(cls)})


any_event: st.SearchStrategy[Event] = st.one_of(
    [event_strategy(cls) for cls in EVENT_TYPES.values()]
)
