"""Where sweep points and plan candidates run: local processes (the default) or Ray tasks.

Rules kept here:
- A point is a pure function of (scenario, point seed), so an engine changes only where the
  work runs, never its result: same seed, same numbers, same events, whichever engine.
- Results come back in the order the work was given, whichever finished first.
- `local`: in this process when one job is asked for (or there is one item), else a
  `ProcessPoolExecutor` of `jobs` workers (default: one per core).
- `ray`: each item is one Ray task of one CPU. With `address` the driver joins that cluster
  (`ray start --head` somewhere, or `auto`); without it, it joins the cluster this process
  already joined (`ray.init` beforehand), else starts a private local one for the call and
  stops it afterwards. The nodes need kvplane installed (`pip install kvplane[sim,ray]`); they
  need no access to the driver's disk or store: see `runner.py` for how events come back.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

ENGINES: tuple[str, ...] = ("local", "ray")


class EngineError(ValueError):
    """An engine that cannot be used as asked (unknown name, Ray missing or unreachable)."""


def check_engine(engine: str, address: str | None = None) -> None:
    if engine not in ENGINES:
        raise EngineError(f"--engine must be one of {', '.join(ENGINES)}, not {engine!r}")
    if address is not None and engine != "ray":
        raise EngineError("--address is for --engine ray (a Ray cluster's address)")


def map_ordered(fn: Callable[[T], R], work: Sequence[T], *, engine: str = "local",
                jobs: int = 0, address: str | None = None) -> Iterator[R]:
    """`fn` over `work`, results yielded in the order of `work` as they are ready.

    `fn` must be a module-level function (it is pickled to the workers)."""
    check_engine(engine, address)
    if not work:
        return
    if engine == "ray":
        yield from _ray_map(fn, work, address)
        return
    jobs = jobs or (os.cpu_count() or 1)
    if jobs <= 1 or len(work) == 1:
        for w in work:
            yield fn(w)
        return
    with ProcessPoolExecutor(max_workers=min(jobs, len(work))) as pool:
        yield from pool.map(fn, work)


def _ray_map(fn: Callable[[T], R], work: Sequence[T], address: str | None) -> Iterator[R]:
    try:
        import ray
    except ImportError:
        raise EngineError("--engine ray needs Ray: pip install 'kvplane[ray]'") from None
    started = False
    if not ray.is_initialized():
        try:
            if address is None:
                ray.init(include_dashboard=False, log_to_driver=False,
                         configure_logging=False)
            else:
                ray.init(address=address, log_to_driver=False, configure_logging=False)
        except ConnectionError as exc:
            raise EngineError(f"cannot reach the Ray cluster at {address!r}: {exc}") from None
        started = True
    try:
        task = ray.remote(num_cpus=1)(fn)
        refs = [task.remote(w) for w in work]
        for ref in refs:
            yield ray.get(ref)
    finally:
        if started:
            ray.shutdown()
