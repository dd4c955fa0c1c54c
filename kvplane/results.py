"""Results you can take away: run ids by prefix, per-request rows, run summaries, comparisons.

What `kvplane runs`, `show`, `compare` and `export` print, computed from the store with plain
SQLAlchemy Core (SQLite and PostgreSQL alike) and the standard library, so these commands need
no dashboard extra.

Rules kept here:
- A run is named by its full id, by `latest` (the newest top-level run), or by any unique
  prefix of its id (the dashboard shows 8 characters); an ambiguous prefix is refused with the
  runs it matches.
- Per-request figures come from one `GROUP BY (run, request)` over a few event types
  (`request_stmt`, which the dashboard shares), so a request recorded at several hops (a
  live run: router, prefill leg, decode leg) counts once.
- Percentiles interpolate linearly between order statistics (numpy's and pandas' default).
  A statistic with no sample is None, never NaN: every JSON written here is valid JSON.
- A multi-turn run's rate is new conversations per second, and is labelled so.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, case, cast, func, null, select, union_all

from kvplane.store import (
    EventStore,
    RunInfo,
    RunNotFound,
    by_type,
    events_of,
    events_of_runs,
    events_table,
    run_id_of,
    runs_table,
)

E = events_table
R = runs_table

#: The columns of `request_rows`, in order (times in seconds from the run's first arrival).
REQUEST_COLUMNS = ("request", "arrived", "prompt_tokens", "output_tokens", "conversation",
                   "turn", "mode", "bidirectional", "prefill", "decode", "ttft", "tpot", "e2e",
                   "ok")


class RunRefError(LookupError):
    """A run reference that names no run, or more than one."""


def json_safe(value: Any) -> Any:
    """`value` with every non-finite float (NaN, inf) replaced by None, for strict JSON."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


# --- naming runs ----------------------------------------------------------------------------


def resolve_run(store: EventStore, ref: str) -> RunInfo:
    """The run `ref` names: a full id, `latest`, or a unique prefix of an id."""
    with store.engine.connect() as conn:
        if ref == "latest":
            row = conn.execute(select(R.c.id).where(R.c.parent.is_(None))
                               .order_by(R.c.started.desc(), R.c.id.desc()).limit(1)).first()
            if row is None:
                raise RunRefError(f"no runs in {store.url}")
            return store.run(str(row[0]))
        exact = conn.execute(select(R.c.id).where(R.c.id == ref)).first()
        if exact is not None:
            return store.run(ref)
        like = ref.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        found = [str(r[0]) for r in conn.execute(
            select(R.c.id).where(R.c.id.like(like, escape="\\")).order_by(R.c.id).limit(6))]
    if not found:
        raise RunRefError(f"no run {ref!r} in {store.url} (see `kvplane runs`)")
    if len(found) > 1:
        shown = ", ".join(found[:5]) + (", ..." if len(found) > 5 else "")
        raise RunRefError(f"{ref!r} names more than one run ({shown}): give more characters")
    return store.run(found[0])


def resolve_id(store: EventStore, ref: str) -> str:
    return resolve_run(store, ref).id


# --- per request ----------------------------------------------------------------------------


def _when(type_name: str, value: Any) -> Any:
    return case((E.c.type == type_name, value))


#: A column of `request_stmt`: the aggregate over a request's rows (min or max) and the
#: (event type, value) pairs it reads, in order of precedence: with two, the first type's
#: value where the request has it, else the second's.
_Field = tuple[Any, tuple[tuple[str, Any], ...]]


def _request_fields() -> dict[str, _Field]:
    """Every column `request_stmt` can give: name -> (aggregate, ((event type, value), ...))."""
    p, t = E.c.payload, E.c.time
    return {
        "arrived": (func.min, (("RequestArrived", t),)),
        "routed": (func.min, (("RequestRouted", t),)),
        "prefill_started": (func.min, (("PrefillStarted", t),)),
        "prompt_tokens": (func.max, (("RequestArrived", p["prompt_tokens"].as_integer()),)),
        "output_tokens": (func.max, (("RequestFinished", p["output_tokens"].as_integer()),
                                     ("RequestArrived", p["output_tokens"].as_integer()))),
        "conversation": (func.max, (("RequestArrived", p["conversation"].as_string()),)),
        "turn": (func.max, (("RequestArrived", p["turn"].as_integer()),)),
        "mode": (func.max, (("RequestRouted", p["mode"].as_string()),)),
        "bidirectional": (func.max, (("RequestRouted", case(
            (p["bidirectional"].as_boolean().is_(True), 1), else_=0)),)),
        "prefill": (func.max, (("RequestRouted", p["prefill"].as_string()),)),
        "decode": (func.max, (("RequestRouted", p["decode"].as_string()),)),
        "finished": (func.min, (("RequestFinished", t),)),
        "ttft": (func.max, (("RequestFinished", p["ttft"].as_float()),)),
        "tpot": (func.max, (("RequestFinished", p["tpot"].as_float()),)),
        "e2e": (func.max, (("RequestFinished", p["e2e"].as_float()),)),
        "ok": (func.min, (("RequestFinished", case(
            (p["ok"].as_boolean().is_(False), 0), else_=1)),)),
    }


#: Every column `request_stmt` gives by default, after run and request.
REQUEST_FIELDS = tuple(_request_fields())


def request_stmt(engine: Engine, run_ids: Sequence[str],
                 times: Mapping[str, str] | None = None,
                 fields: Sequence[str] = REQUEST_FIELDS) -> Any:
    """One row per (run, request): run, request and `fields` (of REQUEST_FIELDS: arrived,
    routed, prefill_started, prompt_tokens, output_tokens (generated when finished, else
    asked for), conversation, turn, mode, bidirectional, prefill, decode, finished, ttft,
    tpot, e2e (s), ok); plus a time column per `times` entry (column name -> event type: its
    first occurrence).

    The one per-request query (the CLI's results and the dashboard's pages share it): one
    branch per event type it needs, glued with `UNION ALL` and folded by one
    `GROUP BY (run, request)`. Each branch reads one type of the runs through the (run, type,
    ...) index, and reads the payload only where that type has fields in it, so a type that
    gives only times is read from the index alone, and what the grouping sorts is the
    extracted values, not the payloads (half the CPU of folding the raw rows with `CASE` on
    the cluster run's 50,000 requests). A request recorded at several hops (a live run:
    router, prefill leg, decode leg) is one row."""
    known = _request_fields()
    spec: dict[str, _Field] = {f: known[f] for f in fields}
    spec.update({name: (func.min, ((t, E.c.time),)) for name, t in (times or {}).items()})
    # inner columns: one per (column, type) pair, named col__i
    parts = [(f"{name}__{i}", agg, ty, value) for name, (agg, pairs) in spec.items()
             for i, (ty, value) in enumerate(pairs)]
    runs = list(run_ids)
    branches = []
    for ty in sorted({p[2] for p in parts}):
        branches.append(select(E.c.run, E.c.request, *(
            (value if t == ty else cast(null(), value.type)).label(col)
            for col, _, t, value in parts)).where(
            events_of_runs(engine, runs), E.c.type == ty, E.c.request.is_not(None)))
    rows = union_all(*branches).subquery("per_type") if len(branches) > 1 \
        else branches[0].subquery("per_type")
    outer = []
    for name, (agg, pairs) in spec.items():
        aggs = [agg(rows.c[f"{name}__{i}"]) for i in range(len(pairs))]
        outer.append((aggs[0] if len(aggs) == 1 else func.coalesce(*aggs)).label(name))
    return select(run_id_of(engine, rows.c.run).label("run"), rows.c.request, *outer
                  ).group_by(rows.c.run, rows.c.request)


def request_rows(engine: Engine, run_id: str) -> list[dict[str, Any]]:
    """One dict per request of the run (REQUEST_COLUMNS), in arrival order."""
    with engine.connect() as conn:
        rows = [dict(r._mapping)
                for r in conn.execute(by_type(request_stmt(engine, [run_id]), engine))]
    t0 = min((r["arrived"] for r in rows if r["arrived"] is not None), default=0.0)
    out = []
    for r in rows:
        done = r["finished"] is not None
        out.append({
            "request": r["request"],
            "arrived": None if r["arrived"] is None else r["arrived"] - t0,
            "prompt_tokens": r["prompt_tokens"], "output_tokens": r["output_tokens"],
            "conversation": r["conversation"], "turn": r["turn"], "mode": r["mode"],
            "bidirectional": None if r["mode"] is None else bool(r["bidirectional"]),
            "prefill": r["prefill"], "decode": r["decode"],
            "ttft": r["ttft"], "tpot": r["tpot"], "e2e": r["e2e"],
            "ok": bool(done and (r["ok"] if r["ok"] is not None else 1)),
        })
    out.sort(key=lambda r: (r["arrived"] is None, r["arrived"] or 0.0, r["request"]))
    return out


# --- statistics -----------------------------------------------------------------------------


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (0 <= q <= 1) of already sorted values; None if empty."""
    n = len(sorted_values)
    if n == 0:
        return None
    pos = q * (n - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, n - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def stats_ms(values: Iterable[float | None]) -> dict[str, float | None]:
    """n, mean, p50, p90, p99 of values in seconds, as milliseconds (None when empty)."""
    v = sorted(x * 1e3 for x in values if x is not None and math.isfinite(x))
    if not v:
        return {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None}
    return {"n": len(v), "mean": sum(v) / len(v), "p50": percentile(v, 0.5),
            "p90": percentile(v, 0.9), "p99": percentile(v, 0.99)}


@dataclass(frozen=True)
class RunSummary:
    """What `kvplane show` prints and `compare` lines up."""

    run: RunInfo
    requests: int
    finished: int
    failed: int
    conversations: int
    multi_turn: bool
    span_s: float | None
    rate: float | None  # offered: requests/s, or new conversations/s when multi-turn
    modes: dict[str, int]
    ttft: dict[str, float | None]
    tpot: dict[str, float | None]
    e2e: dict[str, float | None]
    throughput_tok_s: float | None
    events: int
    children: list[RunInfo]
    # RequestPreempted events of the run and its child runs (vllm:num_preemptions_total,
    # summed over instances)
    preemptions: int = 0

    @property
    def rate_unit(self) -> str:
        return "conversations/s" if self.multi_turn else "requests/s"

    def as_dict(self) -> dict[str, Any]:
        r = self.run
        return json_safe({
            "id": r.id, "kind": r.kind, "scenario": r.scenario, "started": str(r.started),
            "parent": r.parent, "requests": self.requests, "finished": self.finished,
            "failed": self.failed, "conversations": self.conversations,
            "multi_turn": self.multi_turn, "span_s": self.span_s,
            "rate": self.rate, "rate_unit": self.rate_unit, "modes": self.modes,
            "ttft_ms": self.ttft, "tpot_ms": self.tpot, "e2e_ms": self.e2e,
            "throughput_tok_s": self.throughput_tok_s, "events": self.events,
            "preemptions": self.preemptions, "children": [c.id for c in self.children],
        })


def summarize_run(store: EventStore, run: RunInfo) -> RunSummary:
    rows = request_rows(store.engine, run.id)
    with store.engine.connect() as conn:
        events = int(conn.execute(select(func.count()).select_from(E)
                                  .where(events_of(store.engine, run.id))).scalar() or 0)
    kids = sorted((r for r in store.runs() if r.parent == run.id), key=lambda r: r.scenario)
    with store.engine.connect() as conn:
        preemptions = int(conn.execute(select(func.count()).select_from(E).where(
            events_of_runs(store.engine, [run.id, *(k.id for k in kids)]),
            E.c.type == "RequestPreempted")).scalar() or 0)
    done = [r for r in rows if r["e2e"] is not None or r["ok"]]
    per_conv: dict[str, list[float]] = {}
    for r in rows:
        if r["conversation"] is not None and r["arrived"] is not None:
            per_conv.setdefault(r["conversation"], []).append(r["arrived"])
    convs = set(per_conv)
    multi = any(len(v) > 1 for v in per_conv.values()) or _multi_turn_meta(run)
    arrivals = [r["arrived"] for r in rows if r["arrived"] is not None]
    ends = [r["arrived"] + r["e2e"] for r in rows
            if r["arrived"] is not None and r["e2e"] is not None]
    span = (max(ends) - min(arrivals)) if ends and arrivals else None
    # the offered rate: of requests, or of new conversations (their first turns)
    first_turns = ([min(v) for v in per_conv.values()] if multi else arrivals)
    rate = None
    if len(first_turns) > 1 and max(first_turns) > min(first_turns):
        rate = (len(first_turns) - 1) / (max(first_turns) - min(first_turns))
    modes: dict[str, int] = {}
    for r in rows:
        if r["mode"] is not None:
            key = r["mode"] + ("+reuse" if r["bidirectional"] else "")
            modes[key] = modes.get(key, 0) + 1
    out_tokens = sum(r["output_tokens"] or 0 for r in done if r["ok"])
    return RunSummary(
        run=run, requests=len(rows), finished=len(done),
        failed=sum(1 for r in done if not r["ok"]), conversations=len(convs), multi_turn=multi,
        span_s=span, rate=rate, modes=modes,
        ttft=stats_ms(r["ttft"] for r in done if r["ok"]),
        tpot=stats_ms(r["tpot"] for r in done if r["ok"] and (r["output_tokens"] or 0) > 1),
        e2e=stats_ms(r["e2e"] for r in done if r["ok"]),
        throughput_tok_s=out_tokens / span if span else None,
        events=events, children=kids, preemptions=preemptions)


def _multi_turn_meta(run: RunInfo) -> bool:
    sc = run.meta.get("scenario") if isinstance(run.meta, dict) else None
    return isinstance(sc, dict) and (sc.get("workload") or {}).get("kind") == "multi_turn"


# --- the runs table -------------------------------------------------------------------------


def runs_table_rows(store: EventStore) -> list[dict[str, Any]]:
    """Every run, newest first, with requests and TTFT/TPOT p50/p90 (ms) of finished ones."""
    engine = store.engine
    with engine.connect() as conn:
        base = [dict(r._mapping) for r in conn.execute(
            select(R.c.id, R.c.kind, R.c.scenario, R.c.started, R.c.parent, R.c.meta)
            .order_by(R.c.started.desc(), R.c.id))]
        p = E.c.payload
        per_req = conn.execute(by_type(select(
            run_id_of(engine).label("run"), E.c.request,
            func.max(_when("RequestFinished", p["ttft"].as_float())).label("ttft"),
            func.max(_when("RequestFinished", p["tpot"].as_float())).label("tpot"),
            func.max(_when("RequestArrived", p["turn"].as_integer())).label("turn"),
            func.max(_when("RequestArrived", p["conversation"].as_string())).label("conv"),
        ).where(events_of_runs(engine, [b["id"] for b in base]),  # (run, type) index, by run
                E.c.type.in_(["RequestArrived", "RequestFinished"]), E.c.request.is_not(None))
            .group_by(E.c.run, E.c.request), engine)).all()
        kids = dict(conn.execute(select(R.c.parent, func.count()).where(R.c.parent.is_not(None))
                                 .group_by(R.c.parent)).all())
    by_run: dict[str, list[Any]] = {}
    for row in per_req:
        by_run.setdefault(row.run, []).append(row)
    out = []
    for b in base:
        reqs = by_run.get(b["id"], [])
        ttft = sorted(r.ttft * 1e3 for r in reqs if r.ttft is not None)
        tpot = sorted(r.tpot * 1e3 for r in reqs if r.tpot is not None)
        out.append({
            **b, "requests": len(reqs), "children": int(kids.get(b["id"], 0)),
            "multi_turn": _repeats(r.conv for r in reqs),
            "ttft_p50": percentile(ttft, 0.5), "ttft_p90": percentile(ttft, 0.9),
            "tpot_p50": percentile(tpot, 0.5), "tpot_p90": percentile(tpot, 0.9),
        })
    return out


def _repeats(conversations: Iterable[str | None]) -> bool:
    seen: set[str] = set()
    for c in conversations:
        if c is not None:
            if c in seen:
                return True
            seen.add(c)
    return False


def rate_label(label: str, multi_turn: bool) -> str:
    """A point label with its rate named in the workload's unit (`qps0.01` -> `0.01conv/s`
    for a multi-turn run, whose rate is new conversations per second)."""
    if not multi_turn:
        return label
    import re

    return re.sub(r"(^|_)qps([0-9.eE+-]+)(?=_|$)", r"\1\2conv/s", label)


def short(run_id: str) -> str:
    return run_id[:8]


def _fmt(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def format_runs_table(rows: Sequence[dict[str, Any]]) -> str:
    head = (f"{'ID':<8}  {'KIND':<6}  {'STARTED':<19}  {'REQS':>6}  {'TTFT p50':>9}  "
            f"{'p90':>8}  {'TPOT p50':>9}  {'p90':>7}  SCENARIO")
    lines = [head]
    for r in rows:
        name = str(r["scenario"])
        if ":" in name:
            sc, _, label = name.rpartition(":")
            name = f"{sc}:{rate_label(label, r['multi_turn'])}"
        plan = isinstance(r.get("meta"), dict) and "plan" in r["meta"]
        size = str(r["requests"]) if r["requests"] else (
            f"{r['children']}pt" if r["children"] else "plan" if plan else "0")
        parent = f"  (in {short(r['parent'])})" if r["parent"] else ""
        lines.append(
            f"{short(r['id']):<8}  {r['kind']:<6}  {str(r['started'])[:19]:<19}  {size:>6}  "
            f"{_fmt(r['ttft_p50']):>9}  {_fmt(r['ttft_p90']):>8}  {_fmt(r['tpot_p50'], 2):>9}  "
            f"{_fmt(r['tpot_p90'], 2):>7}  {name}{parent}")
    lines.append("(times in ms; REQS: requests, sweep points `Npt`, or a `kvplane plan` search; "
                 "any unique id prefix names a run)")
    return "\n".join(lines)


# --- show and compare -----------------------------------------------------------------------


def _name(s: RunSummary) -> str:
    sc, sep, label = s.run.scenario.rpartition(":")
    return f"{sc}{sep}{rate_label(label, s.multi_turn)}" if sep else s.run.scenario


def format_summary(s: RunSummary) -> str:
    r = s.run
    lines = [f"run {r.id}", f"  kind {r.kind}, scenario {_name(s)}, started "
             f"{str(r.started)[:19]}" + (f", part of {r.parent}" if r.parent else "")]
    if s.requests:
        rate = f"{s.rate:.4g} {s.rate_unit}" if s.rate is not None else "-"
        lines.append(f"  {s.requests} requests ({s.finished} finished, {s.failed} failed)"
                     + (f", {s.conversations} conversations" if s.multi_turn else "")
                     + f"; offered {rate}; over {_fmt(s.span_s, 2)} s")
        if s.modes:
            lines.append("  routed: " + ", ".join(f"{k} {v}" for k, v in sorted(s.modes.items())))
        lines.append(f"  {'(ms)':<6} {'mean':>9} {'p50':>9} {'p90':>9} {'p99':>9}")
        for name, st in (("TTFT", s.ttft), ("TPOT", s.tpot), ("E2E", s.e2e)):
            d = 2 if name == "TPOT" else 1
            lines.append(f"  {name:<6} {_fmt(st['mean'], d):>9} {_fmt(st['p50'], d):>9} "
                         f"{_fmt(st['p90'], d):>9} {_fmt(st['p99'], d):>9}")
        if s.throughput_tok_s is not None:
            lines.append(f"  output throughput {s.throughput_tok_s:.1f} tok/s")
    lines.append(f"  {s.preemptions} preemptions" + (" (with the child runs')" if s.children
                                                       else ""))
    lines.append(f"  {s.events} events")
    if s.children:
        lines.append(f"  {len(s.children)} child runs:")
        for c in s.children:
            lines.append(f"    {short(c.id)}  {c.kind:<6} {c.scenario}")
    return "\n".join(lines)


def differences(a: RunSummary, b: RunSummary) -> list[str]:
    """What differs between two runs besides their results: size, rate, modes, scenario."""
    out = []
    if a.requests != b.requests:
        out.append(f"requests: {a.requests} vs {b.requests}")
    if a.multi_turn != b.multi_turn:
        out.append("workload: " + ("multi-turn" if a.multi_turn else "single-turn") + " vs "
                   + ("multi-turn" if b.multi_turn else "single-turn"))
    if a.rate and b.rate and abs(a.rate - b.rate) > 0.1 * max(a.rate, b.rate):
        out.append(f"offered rate: {a.rate:.3g} vs {b.rate:.3g} {a.rate_unit}")
    if set(a.modes) != set(b.modes):
        out.append(f"routing: {', '.join(sorted(a.modes)) or '-'} vs "
                   f"{', '.join(sorted(b.modes)) or '-'}")
    return out


def format_compare(a: RunSummary, b: RunSummary) -> str:
    lines = [f"A {a.run.id}  {a.run.kind} {_name(a)}",
             f"B {b.run.id}  {b.run.kind} {_name(b)}",
             f"{'(ms)':<10} {'A':>10} {'B':>10} {'B vs A':>9}"]
    for name, sa, sb in (("TTFT", a.ttft, b.ttft), ("TPOT", a.tpot, b.tpot),
                         ("E2E", a.e2e, b.e2e)):
        for stat in ("mean", "p50", "p90", "p99"):
            x, y = sa[stat], sb[stat]
            rel = f"{(y - x) / x * 100:+.1f}%" if x and y is not None else "-"
            d = 2 if name == "TPOT" else 1
            lines.append(f"{name + ' ' + stat:<10} {_fmt(x, d):>10} {_fmt(y, d):>10} {rel:>9}")
    lines.append(f"{'requests':<10} {a.requests:>10} {b.requests:>10}")
    diff = differences(a, b)
    if diff:
        lines.append("what differs between the runs: " + "; ".join(diff))
    return "\n".join(lines)


def resolve_many(store: EventStore, refs: Iterable[str]) -> list[RunInfo]:
    out = []
    for ref in refs:
        try:
            out.append(resolve_run(store, ref))
        except RunNotFound as exc:  # deleted between the lookup and the read
            raise RunRefError(str(exc)) from None
    return out
