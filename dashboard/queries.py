"""The dashboard's reads: aggregate SQL over the store, returned as small pandas frames.

Rules kept here:
- Read only. Every function takes an `Engine` (from `EventStore.engine`) and run ids, and
  issues plain SQLAlchemy Core against `runs_table` and `events_table`, so it runs alike on
  SQLite and PostgreSQL.
- The database does the heavy lifting: a query filters on (run, type) or (run, type,
  request), the store's covering index, and folds events into one row per request (or per
  run) with `GROUP BY` and `MIN(CASE ...)`. What comes back is sized by requests, never by events, and
  the per-event read (`request_events`) is for a handful of requests at a time. Percentiles
  are computed here in pandas from one value per request (SQLite has no percentile function).
- Payload fields are read with the JSON operators SQLAlchemy renders for each backend
  (`payload["ttft"].as_float()`), and only inside a `CASE` on the row's type, so a field is
  only ever extracted from rows that have it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pandas as pd
from sqlalchemy import Engine, Integer, String, and_, case, cast, func, or_, select

from kvplane.core.events import DecodeBlocksReserved
from kvplane.core.events import decode as decode_event
from kvplane.core.events import encode as encode_event
from kvplane.results import request_stmt
from kvplane.store import (
    all_types,
    by_type,
    events_of,
    events_of_runs,
    events_table,
    fresh_rollups,
    has_block_counts,
    has_packed_lists,
    merge_lists,
    run_id_of,
    run_ref,
    runs_table,
)

E = events_table
R = runs_table

#: Milestones of one request, in the order they normally happen: (column, event type,
#: extra condition on the row or None).
_DIRECTION = E.c.payload["direction"].as_string()
MILESTONES: tuple[tuple[str, str, Any], ...] = (
    ("arrived", "RequestArrived", None),
    ("routed", "RequestRouted", None),
    ("read_planned", "TransferPlanned", _DIRECTION == "D->P"),
    ("read_done", "TransferCompleted", _DIRECTION == "D->P"),
    ("prefill_started", "PrefillStarted", None),
    ("prefill_finished", "PrefillFinished", None),
    ("registration_sent", "RegistrationSent", None),
    ("registration_arrived", "RegistrationArrived", None),
    ("matched", "RendezvousMatched", None),
    ("transfer_planned", "TransferPlanned", _DIRECTION == "P->D"),
    ("transfer_done", "TransferCompleted", _DIRECTION == "P->D"),
    ("kv_received", "KVReceived", None),
    ("first_token", "FirstTokenEmitted", None),
    ("finished", "RequestFinished", None),
)

#: The Gantt phases: (name, start milestone(s), end milestone(s)); the first milestone of a
#: list that the request has is used.
PHASES: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("queue", ("arrived",), ("read_planned", "prefill_started")),
    ("reuse read (D->P)", ("read_planned",), ("read_done",)),
    ("prefill", ("prefill_started",), ("prefill_finished",)),
    ("registration wait", ("prefill_finished",), ("registration_arrived",)),
    ("rendezvous", ("prefill_finished",), ("transfer_planned",)),
    ("transfer (P->D)", ("transfer_planned",), ("kv_received", "transfer_done")),
    ("first decode step", ("kv_received",), ("first_token",)),
    ("decode", ("first_token",), ("finished",)),
)


def _fetch(engine: Engine, stmt: Any) -> pd.DataFrame:
    with engine.connect() as conn:
        result = conn.execute(stmt)
        columns = list(result.keys())
        # plain tuples: handed Row objects, pandas probes each for attributes (a third of
        # the time of a 16,000-row frame)
        rows = [tuple(r) for r in result.fetchall()]
    return pd.DataFrame.from_records(rows, columns=columns, coerce_float=False) if rows \
        else pd.DataFrame(columns=columns)


def _typed(engine: Engine, stmt: Any) -> pd.DataFrame:
    """`_fetch` of a read by event type: through the (run, type, ...) index (`by_type`)."""
    return _fetch(engine, by_type(stmt, engine))


def _when(type_name: str, value: Any, extra: Any = None) -> Any:
    cond = E.c.type == type_name if extra is None else and_(E.c.type == type_name, extra)
    return case((cond, value))


# --- runs -----------------------------------------------------------------------------------------


def runs(engine: Engine) -> pd.DataFrame:
    """Every run with its size and headline figures, newest first.

    Columns: id, kind, scenario, started, parent, meta, events, requests, finished, failed,
    ttft_ms, tpot_ms, e2e_ms (means over finished requests), children, points (children of
    kind sim or import: sweep points), leases (granted), reuse_decisions, rollup (whether the
    run has a current rollup, `rollup.py`).
    """
    base = _fetch(engine, select(R.c.id, R.c.kind, R.c.scenario, R.c.started, R.c.parent,
                                 R.c.meta).order_by(R.c.started.desc(), R.c.id))
    if base.empty:
        return base.assign(events=[], requests=[], finished=[], failed=[], ttft_ms=[],
                           tpot_ms=[], e2e_ms=[], children=[], points=[], leases=[],
                           reuse_decisions=[], rollup=[])
    # every filtered read names the runs, so it walks the (run, type) index run by run
    # instead of scanning every event of the store for a type
    ids = list(base["id"])
    # events per run: the last seq + 1 (seqs are contiguous from 0), one index probe a run
    last = select(func.max(E.c.seq)).where(E.c.run == run_ref(engine)).scalar_subquery()
    sizes = _fetch(engine, select(R.c.id, (last + 1).label("events")))
    kids = _fetch(engine, select(
        R.c.parent.label("id"), func.count().label("children"),
        func.sum(case((R.c.kind.in_(["sim", "import"]), 1), else_=0)).label("points"),
    ).where(R.c.parent.is_not(None)).group_by(R.c.parent))
    # a run with a current rollup (revision 0005) has its figures there; the others' from
    # their events
    rolled = fresh_rollups(engine, ids, "heads")
    heads = run_heads(engine, [i for i in ids if i not in rolled])
    if rolled:
        kept = pd.DataFrame([{"id": i, **{c: rolled[i].get(c) for c in HEAD_COLUMNS}}
                             for i in ids if i in rolled], columns=["id", *HEAD_COLUMNS])
        for col in ("ttft_ms", "tpot_ms", "e2e_ms"):
            kept[col] = kept[col].astype(float)
        heads = kept if heads.empty else pd.concat([heads, kept], ignore_index=True)
    out = base
    for extra in (sizes, heads, kids):
        out = out.merge(extra, on="id", how="left")
    for col in ("events", "requests", "finished", "failed", "children", "points", "leases",
                "reuse_decisions"):
        out[col] = out[col].fillna(0).astype(int)
    out["rollup"] = out["id"].isin(list(rolled))
    # imported summaries without per-request events: headline figures from meta.summary
    for i, meta in enumerate(out["meta"]):
        summary = meta.get("summary") if isinstance(meta, dict) else None
        if isinstance(summary, dict) and out.at[i, "finished"] == 0:
            out.at[i, "ttft_ms"] = _mean_of(summary, "ttft")
            out.at[i, "tpot_ms"] = _mean_of(summary, "tpot")
            out.at[i, "e2e_ms"] = _mean_of(summary, "e2el") or _mean_of(summary, "e2e")
            out.at[i, "finished"] = int(summary.get("completed") or summary.get("finished") or 0)
    return out


#: The figures of a run's row that come from its events (`run_heads`).
HEAD_COLUMNS: tuple[str, ...] = ("requests", "finished", "failed", "ttft_ms", "tpot_ms",
                                 "e2e_ms", "leases", "reuse_decisions")


def run_heads(engine: Engine, ids: Sequence[str]) -> pd.DataFrame:
    """Per run (of `ids`) with events of these kinds: id and HEAD_COLUMNS (requests arrived,
    finished, failed, TTFT/TPOT/E2E means in ms, leases granted, reuse decisions). A run
    without such events has no row."""
    if not ids:
        return pd.DataFrame(columns=["id", *HEAD_COLUMNS])
    ok = E.c.payload["ok"].as_boolean()
    heads = _typed(engine, select(
        run_id_of(engine).label("id"),
        func.count().label("finished"),
        func.sum(case((ok.is_(False), 1), else_=0)).label("failed"),
        (func.avg(E.c.payload["ttft"].as_float()) * 1e3).label("ttft_ms"),
        (func.avg(E.c.payload["tpot"].as_float()) * 1e3).label("tpot_ms"),
        (func.avg(E.c.payload["e2e"].as_float()) * 1e3).label("e2e_ms"),
    ).where(events_of_runs(engine, ids), E.c.type == "RequestFinished").group_by(E.c.run))
    # distinct: a live run records each arrival at every hop (router, prefill, decode)
    arrived = _typed(engine, select(run_id_of(engine).label("id"),
                                    func.count(func.distinct(E.c.request)).label("requests"))
                     .where(events_of_runs(engine, ids), E.c.type == "RequestArrived")
                     .group_by(E.c.run))
    lease_count = case((E.c.type == "LeaseGranted", 1), else_=0)
    reuse_count = case((E.c.type == "ReuseDecided", 1), else_=0)
    marks = _typed(engine, select(run_id_of(engine).label("id"),
                                  func.sum(lease_count).label("leases"),
                                  func.sum(reuse_count).label("reuse_decisions"))
                   .where(events_of_runs(engine, ids),
                          E.c.type.in_(["LeaseGranted", "ReuseDecided"]))
                   .group_by(E.c.run))
    out = pd.DataFrame({"id": list(ids)})
    for extra in (arrived, heads, marks):
        out = out.merge(extra, on="id", how="left")
    for col in ("requests", "finished", "failed", "leases", "reuse_decisions"):
        out[col] = out[col].fillna(0).astype(int)
    for col in ("ttft_ms", "tpot_ms", "e2e_ms"):
        out[col] = out[col].astype(float)
    return out[["id", *HEAD_COLUMNS]]


def _mean_of(summary: dict[str, Any], metric: str) -> float | None:
    v = summary.get(f"mean_{metric}_ms")
    if v is None and isinstance(summary.get(f"{metric}_ms"), dict):
        v = summary[f"{metric}_ms"].get("mean")
    return float(v) if isinstance(v, (int, float)) else None


def children(engine: Engine, run_id: str) -> pd.DataFrame:
    """The child runs of a run (sweep points, twins, what-ifs): id, kind, scenario, meta."""
    return _fetch(engine, select(R.c.id, R.c.kind, R.c.scenario, R.c.started, R.c.meta)
                  .where(R.c.parent == run_id).order_by(R.c.started, R.c.id))


# --- requests -------------------------------------------------------------------------------------


def request_index(engine: Engine, run_id: str) -> pd.DataFrame:
    """One light row per request of a run, to filter and sort on: request, arrived,
    prefill_started, prompt_tokens, output_tokens, mode, prefill, decode, finished, ttft,
    tpot, e2e, ok (`kvplane.results.request_stmt`, the per-request query the CLI shares).
    A few event types, never the whole run."""
    df = _typed(engine, request_stmt(engine, [run_id], fields=(
        "arrived", "prefill_started", "prompt_tokens", "output_tokens", "mode", "prefill",
        "decode", "finished", "ttft", "tpot", "e2e", "ok")))
    if df.empty:
        return df
    df = df.drop(columns=["run"])
    df["ok"] = df["ok"].fillna(0).astype(int).astype(bool) & df["finished"].notna()
    df["prompt_tokens"] = df["prompt_tokens"].fillna(0).astype(int)
    return df


_MILESTONE_TYPES = sorted({t for _, t, _ in MILESTONES} | {"PrefillStarted"})


def request_table(engine: Engine, run_id: str, requests: Sequence[str] | None = None
                  ) -> pd.DataFrame:
    """One row per request (of the run, or only `requests`): the time of every milestone
    (first occurrence), prompt and output tokens, the instances it was routed to, mode,
    cached tokens, TTFT/E2E and ok.

    One `GROUP BY request` over the milestone rows (through the (run, type, request, ...)
    index, also when `requests` is given: the timeline asks for a page of requests at a
    time).
    """
    cols: list[Any] = [E.c.request]
    for name, type_name, extra in MILESTONES:
        cols.append(func.min(_when(type_name, E.c.time, extra)).label(name))
    p = E.c.payload
    cols += [
        func.max(_when("RequestArrived", p["prompt_tokens"].as_integer())).label("prompt_tokens"),
        func.max(_when("RequestArrived", p["output_tokens"].as_integer())).label("output_tokens"),
        func.max(_when("RequestArrived", p["turn"].as_integer())).label("turn"),
        func.max(_when("RequestArrived", p["conversation"].as_string())).label("conversation"),
        func.max(_when("RequestRouted", p["mode"].as_string())).label("mode"),
        func.max(_when("RequestRouted", p["prefill"].as_string())).label("prefill"),
        func.max(_when("RequestRouted", p["decode"].as_string())).label("decode"),
        func.max(_when("PrefillStarted", p["cached_tokens"].as_integer())).label("cached_tokens"),
        func.max(_when("RequestFinished", p["ttft"].as_float())).label("ttft"),
        func.max(_when("RequestFinished", p["tpot"].as_float())).label("tpot"),
        func.max(_when("RequestFinished", p["e2e"].as_float())).label("e2e"),
        func.min(_when("RequestFinished", case((p["ok"].as_boolean().is_(False), 0), else_=1))
                 ).label("ok"),
    ]
    stmt = select(*cols).where(events_of(engine, run_id), E.c.request.is_not(None),
                               E.c.type.in_(_MILESTONE_TYPES))
    if requests is not None:
        stmt = stmt.where(E.c.request.in_(list(requests)))
    df = _fetch(engine, stmt.group_by(E.c.request))
    if df.empty:
        return df
    df["ttft"] = df["ttft"].fillna(df["first_token"] - df["arrived"])
    df["e2e"] = df["e2e"].fillna(df["finished"] - df["arrived"])
    df["ok"] = df["ok"].fillna(0).astype(int).astype(bool) & df["finished"].notna()
    return df


def phases(requests: pd.DataFrame) -> pd.DataFrame:
    """Gantt segments from `request_table` rows: request, phase, start, end (run time, s).

    A phase is drawn when the request has both ends and they are in order; registration wait
    only when the registration came after prefill finished (push, prefill first)."""
    rows = []
    for rec in requests.to_dict("records"):
        for name, starts, ends in PHASES:
            start = _first(rec, starts)
            end = _first(rec, ends)
            if name == "rendezvous":
                reg = _num(rec.get("registration_arrived"))
                if start is not None and reg is not None and reg > start:
                    start = reg
            if start is None or end is None or end < start:
                continue
            if name in ("queue", "registration wait") and end == start:
                continue
            rows.append({"request": rec["request"], "phase": name, "start": start, "end": end})
    return pd.DataFrame(rows, columns=["request", "phase", "start", "end"])


def _num(v: Any) -> float | None:
    return None if v is None or pd.isna(v) else float(v)


def _first(rec: dict[str, Any], names: Sequence[str]) -> float | None:
    for n in names:
        v = _num(rec.get(n))
        if v is not None:
            return v
    return None


def request_events(engine: Engine, run_id: str, requests: Sequence[str]) -> pd.DataFrame:
    """Every event of the given requests (a page of the timeline): seq, time, type, request,
    instance, payload."""
    if not requests:
        return pd.DataFrame(columns=["seq", "time", "type", "request", "instance", "payload"])
    lists = [E.c.lists] if has_packed_lists(engine) else []  # block lists packed apart
    # Sorted here, not by ORDER BY seq: that would steer SQLite to the (run, seq) key and a
    # scan of the whole run. Every type named: the (run, type, request, ...) index then finds
    # the rows, one probe per type and request (the store has no (run, request) index).
    by_request = by_type(select(E.c.seq, E.c.time, E.c.type, E.c.request, E.c.instance,
                                E.c.payload, *lists)
                         .where(events_of(engine, run_id), E.c.type.in_(all_types()),
                                E.c.request.in_(list(requests))), engine)
    df = _fetch(engine, by_request)
    if lists:
        df["payload"] = [_with_lists(p, b) for p, b in zip(df["payload"], df.pop("lists"),
                                                           strict=True)]
    grown = _decode_growth(engine, run_id, df, set(requests))
    if not grown.empty:
        df = pd.concat([df, grown], ignore_index=True)
    return df.sort_values("seq", kind="stable").reset_index(drop=True)


def _decode_growth(engine: Engine, run_id: str, found: pd.DataFrame, requests: set[str]
                   ) -> pd.DataFrame:
    """The `requests`' shares of the run's `DecodeBlocksReserved` rows (a decode macro-step's
    growth of several requests is one row, of no request): a `BlocksReserved` row each, with
    the grouped row's seq, as a run recorded before event schema 4 held them. Read within the
    time the requests' own rows (`found`) span, one range per request, overlaps merged."""
    cols = ["seq", "time", "type", "request", "instance", "payload"]
    if found.empty:
        return pd.DataFrame(columns=cols)
    spans: list[list[float]] = []
    for lo, hi in sorted(found.groupby("request")["time"].agg(["min", "max"]).itertuples(
            index=False)):
        if spans and lo <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], hi)
        else:
            spans.append([lo, hi])
    lists = [E.c.lists] if has_packed_lists(engine) else []
    rows = _typed(engine, select(E.c.seq, E.c.time, E.c.instance, E.c.payload, *lists).where(
        events_of(engine, run_id), E.c.type == "DecodeBlocksReserved", E.c.request.is_(None),
        or_(*(E.c.time.between(lo, hi) for lo, hi in spans))))
    out = []
    for row in rows.to_dict("records"):
        raw = row["payload"]
        payload = json.loads(raw) if isinstance(raw, str) else dict(raw)
        if row.get("lists") is not None:
            payload = merge_lists(payload, row["lists"])
        grown = decode_event("DecodeBlocksReserved", payload, at=row["time"],
                             instance=row["instance"], request=None)
        assert isinstance(grown, DecodeBlocksReserved)
        for one in grown.each():
            if one.request in requests:
                body = encode_event(one)[1]
                out.append((row["seq"], row["time"], "BlocksReserved", one.request,
                            row["instance"], json.dumps(body) if isinstance(raw, str) else body))
    return pd.DataFrame.from_records(out, columns=cols) if out else pd.DataFrame(columns=cols)


def _with_lists(payload: Any, lists: bytes | None) -> Any:
    """A stored payload with its packed block lists put back (the event's whole payload)."""
    if lists is None:
        return payload
    whole = merge_lists(json.loads(payload) if isinstance(payload, str) else dict(payload),
                        lists)
    return json.dumps(whole) if isinstance(payload, str) else whole


def finished_requests(engine: Engine, run_ids: Sequence[str]) -> pd.DataFrame:
    """Per finished request of the runs: run, request, arrived, prompt_tokens, output_tokens,
    mode, bidirectional, finished, ttft, tpot, e2e (s), ok (`request_stmt`)."""
    if not run_ids:
        return pd.DataFrame(columns=["run", "request", "arrived", "prompt_tokens",
                                     "output_tokens", "ttft", "tpot", "e2e", "ok"])
    df = _typed(engine, request_stmt(engine, run_ids, fields=(
        "arrived", "prompt_tokens", "output_tokens", "mode", "bidirectional", "finished",
        "ttft", "tpot", "e2e", "ok")))
    if df.empty:
        return df
    df = df[df["e2e"].notna()].copy()
    df["ok"] = df["ok"].fillna(1).astype(int).astype(bool)
    df["arrived"] = df["arrived"].fillna(0.0)
    return df.reset_index(drop=True)


def stats(values: pd.Series) -> dict[str, float]:
    """mean, p50, p90, p99 of a series in seconds, as milliseconds (NaN when empty)."""
    v = pd.to_numeric(values, errors="coerce").dropna() * 1e3
    if v.empty:
        return {"n": 0, "mean": float("nan"), "p50": float("nan"), "p90": float("nan"),
                "p99": float("nan")}
    return {"n": int(v.size), "mean": float(v.mean()), "p50": float(v.quantile(0.5)),
            "p90": float(v.quantile(0.9)), "p99": float(v.quantile(0.99))}


# --- reuse ----------------------------------------------------------------------------------------


def reuse_outcomes(engine: Engine, run_ids: Sequence[str]) -> pd.DataFrame:
    """How reuse went, per run: run, what, count. `what` is a ReuseDecided outcome (read,
    recompute, miss, mismatch, expired, refused), `read refused`, `lease expired`,
    `session missed`."""
    if not run_ids:
        return pd.DataFrame(columns=["run", "what", "count"])
    outcome = E.c.payload["outcome"].as_string()
    decided = _typed(engine, select(run_id_of(engine).label("run"), outcome.label("what"), func.count().label("count"))
                     .where(events_of_runs(engine, run_ids), E.c.type == "ReuseDecided")
                     .group_by(E.c.run, outcome))
    other = _typed(engine, select(run_id_of(engine).label("run"), E.c.type.label("what"), func.count().label("count"))
                   .where(events_of_runs(engine, run_ids),
                          E.c.type.in_(["ReadRefused", "LeaseExpired", "SessionMissed"]))
                   .group_by(E.c.run, E.c.type))
    other["what"] = other["what"].map({"ReadRefused": "read refused",
                                       "LeaseExpired": "lease expired",
                                       "SessionMissed": "session missed"})
    return pd.concat([decided, other], ignore_index=True)


def prefill_split(engine: Engine, run_ids: Sequence[str], reuse: bool = True) -> pd.DataFrame:
    """Per request: run, request, prompt_tokens, ttft, recompute (prefill compute, s), read
    (D->P reuse read, s; 0 when none), cached_tokens, outcome, bidirectional.

    `reuse=False` (the runs hold no reuse decision, so no D->P read): the transfer rows are
    not read at all (telling a read from a push transfer parses a transfer's payload, block
    lists and all)."""
    if not run_ids:
        return pd.DataFrame(columns=["run", "request", "prompt_tokens", "ttft", "recompute",
                                     "read", "cached_tokens", "outcome", "bidirectional"])
    p = E.c.payload
    stmt = select(
        run_id_of(engine).label("run"), E.c.request,
        func.max(_when("RequestArrived", p["prompt_tokens"].as_integer())).label("prompt_tokens"),
        func.max(_when("RequestFinished", p["ttft"].as_float())).label("ttft"),
        func.min(_when("PrefillStarted", E.c.time)).label("ps"),
        func.min(_when("PrefillFinished", E.c.time)).label("pf"),
        func.min(_when("TransferPlanned", E.c.time, _DIRECTION == "D->P")).label("rp"),
        func.min(_when("TransferCompleted", E.c.time, _DIRECTION == "D->P")).label("rd"),
        func.max(_when("PrefillStarted", p["cached_tokens"].as_integer())).label("cached_tokens"),
        func.max(_when("ReuseDecided", p["outcome"].as_string())).label("outcome"),
        func.max(_when("RequestRouted", case((p["bidirectional"].as_boolean().is_(True), 1),
                                             else_=0))).label("bidirectional"),
    ).where(events_of_runs(engine, run_ids), E.c.type.in_([
        "RequestArrived", "RequestFinished", "PrefillStarted", "PrefillFinished",
        "RequestRouted", *(["TransferPlanned", "TransferCompleted", "ReuseDecided"]
                           if reuse else []),
    ])).group_by(E.c.run, E.c.request)
    df = _typed(engine, stmt)
    if df.empty:
        return df
    df["recompute"] = df["pf"] - df["ps"]
    df["read"] = (df["rd"] - df["rp"]).fillna(0.0)
    return df.drop(columns=["ps", "pf", "rp", "rd"])


# --- leases ---------------------------------------------------------------------------------------


def lease_events(engine: Engine, run_id: str) -> pd.DataFrame:
    """Every lease event of a run: time, type, instance, lease, blocks (grants only), purpose,
    expires_at. Lease events are a few per request, so this is sized by requests."""
    p = E.c.payload
    df = _typed(engine, select(
        E.c.seq, E.c.time, E.c.type, E.c.instance, E.c.request,
        p["lease"].as_string().label("lease"),
        case((E.c.type == "LeaseGranted", _block_count(engine)), else_=None).label("blocks"),
        case((E.c.type == "LeaseGranted", p["purpose"].as_string()), else_=None).label("purpose"),
        case((E.c.type.in_(["LeaseGranted", "LeaseRenewed"]), p["expires_at"].as_float()),
             else_=None).label("expires_at"),
    ).where(events_of(engine, run_id), E.c.type.in_([
        "LeaseGranted", "LeaseRenewed", "LeaseExpired", "LeaseReleased", "LeaseRenewalRefused",
        "ReadRefused",
    ])))
    return df.sort_values(["time", "seq"], kind="stable").reset_index(drop=True)


def retained_blocks(leases: pd.DataFrame, purpose: str = "retained") -> pd.DataFrame:
    """Blocks held under leases of `purpose` over time, per instance: time, instance, blocks.

    A grant adds its blocks on its instance; the lease's expiry or release takes them back."""
    if leases.empty:
        return pd.DataFrame(columns=["time", "instance", "blocks"])
    grants = leases[(leases["type"] == "LeaseGranted") & (leases["purpose"] == purpose)]
    size = dict(zip(grants["lease"], grants["blocks"].astype(int), strict=True))
    where = dict(zip(grants["lease"], grants["instance"], strict=True))
    ends = leases[leases["type"].isin(["LeaseExpired", "LeaseReleased"])
                  & leases["lease"].isin(size)].drop_duplicates("lease")
    delta = pd.concat([
        pd.DataFrame({"time": grants["time"], "instance": grants["instance"],
                      "delta": grants["blocks"].astype(int)}),
        pd.DataFrame({"time": ends["time"], "instance": ends["lease"].map(where),
                      "delta": -ends["lease"].map(size)}),
    ], ignore_index=True).sort_values("time", kind="stable")
    delta["blocks"] = delta.groupby("instance")["delta"].cumsum()
    return delta[["time", "instance", "blocks"]].reset_index(drop=True)


# --- operations: per-instance time series ---------------------------------------------------------


def _bin(engine: Engine, width: float) -> Any:
    """The time bin of an event row, floor(time / width), in SQL. SQLite's floor() exists only
    when built with its math functions; CAST truncates, which is floor for the non-negative
    times of a run."""
    if engine.dialect.name == "sqlite":
        return cast(E.c.time / width, Integer).label("bin")
    return func.floor(E.c.time / width).label("bin")


def run_span(engine: Engine, run_id: str, edge: int = 2000) -> tuple[float, float] | None:
    """First and last event time of a run, or None. Read from the first and last `edge`
    events by seq (the primary key): events are recorded about in time order (a live run's
    processes interleave by a little), so a million-event run is not scanned for it."""
    with engine.connect() as conn:
        top = conn.execute(select(func.max(E.c.seq)).where(events_of(engine, run_id))).scalar()
        if top is None:
            return None
        lo = conn.execute(select(func.min(E.c.time)).where(
            events_of(engine, run_id), E.c.seq < edge)).scalar()
        hi = conn.execute(select(func.max(E.c.time)).where(
            events_of(engine, run_id), E.c.seq > top - edge)).scalar()
    if lo is None or hi is None:
        return None
    return float(lo), float(hi)


def instance_requests(engine: Engine, run_id: str) -> pd.DataFrame:
    """Per request, where and when it waited and ran: prefill, decode (instances it was routed
    to), arrived (= routed: the router routes as a request arrives), routed, prefill_started,
    prefill_finished, kv_received, first_token, finished (s), ttft, tpot: `request_stmt` with
    two more milestones, one row per request (the fewest rows that tell it)."""
    df = _typed(engine, request_stmt(
        engine, [run_id], {"prefill_finished": "PrefillFinished", "kv_received": "KVReceived"},
        fields=("routed", "prefill_started", "prefill", "decode", "finished", "ttft", "tpot")))
    df["arrived"] = df["routed"] if not df.empty else pd.Series(dtype=float)
    # a request without KVReceived (decode computed it locally) runs from its first token,
    # at routing + TTFT
    df["first_token"] = df["routed"] + df["ttft"] if not df.empty else pd.Series(dtype=float)
    return df


def _array_length(engine: Engine, field: str) -> Any:
    """Length of a payload's JSON array. On SQLite with a path (json_array_length(payload,
    '$.f')): SQLAlchemy's payload[f] would quote the extracted array and parse it again."""
    if engine.dialect.name == "sqlite":
        return func.json_array_length(E.c.payload, f"$.{field}")
    return func.json_array_length(E.c.payload[field])


def _block_count(engine: Engine) -> Any:
    """An event row's block count: the stored `blocks` column (read from the covering index),
    or, in a store not yet migrated to it, the length of the payload's `blocks` list (parsed:
    correct, slower)."""
    return E.c.blocks if has_block_counts(engine) else _array_length(engine, "blocks")


def block_bins(engine: Engine, run_id: str, width: float) -> pd.DataFrame:
    """KV blocks reserved minus freed per (instance, time bin): instance, bin, delta. Summed
    in SQL; the page accumulates the deltas into blocks in use."""
    n = _block_count(engine)
    delta = case((E.c.type == "BlocksFreed", -n), else_=n)
    return _typed(engine, select(E.c.instance, _bin(engine, width), func.sum(delta).label("delta"))
                  .where(events_of(engine, run_id), E.c.type.in_(
                      ["BlocksReserved", "DecodeBlocksReserved", "BlocksFreed"]))
                  .group_by(E.c.instance, "bin"))


def transfer_bins(engine: Engine, run_id: str, width: float) -> pd.DataFrame:
    """KV bytes planned for transfer per (receiving instance, direction, time bin): dst,
    direction, bin, bytes, transfers."""
    p = E.c.payload
    where = (events_of(engine, run_id), E.c.type == "TransferPlanned")
    if engine.dialect.name == "sqlite":
        # A TransferPlanned payload carries both block lists (kilobytes), and SQLite parses
        # the whole text for every json_extract: one extract of the three fields as one JSON
        # array, read here, is a third of the parsing (one row per transfer comes back).
        fields = func.json_extract(E.c.payload, "$.dst", "$.direction", "$.bytes",
                                   type_=String).label("f")
        rows = _typed(engine, select(fields, _bin(engine, width)).where(*where))
        cols = ["dst", "direction", "bin", "bytes", "transfers"]
        if rows.empty:
            return pd.DataFrame(columns=cols)
        # one parse of all rows' arrays (not one json.loads call a row)
        df = pd.DataFrame(json.loads("[" + ",".join(rows["f"]) + "]"),
                          columns=["dst", "direction", "bytes"])
        df["bin"] = rows["bin"].to_numpy()
        return (df.groupby(["dst", "direction", "bin"], as_index=False)
                .agg(bytes=("bytes", "sum"), transfers=("bytes", "size")))[cols]
    dst, direction = p["dst"].as_string(), p["direction"].as_string()
    return _typed(engine, select(
        dst.label("dst"), direction.label("direction"), _bin(engine, width),
        func.sum(p["bytes"].as_integer()).label("bytes"), func.count().label("transfers"),
    ).where(*where).group_by(dst, direction, "bin"))


def prefix_bins(engine: Engine, run_id: str, width: float) -> pd.DataFrame:
    """Prompt tokens served from prefill's prefix cache against computed, per (prefill
    instance, bin): instance, bin, cached, computed; and reuse reads among reuse decisions:
    reuse_read, reuse_decided."""
    p = E.c.payload
    started = E.c.type == "PrefillStarted"
    decided = E.c.type == "ReuseDecided"
    return _typed(engine, select(
        E.c.instance, _bin(engine, width),
        func.sum(case((started, p["cached_tokens"].as_integer()), else_=0)).label("cached"),
        func.sum(case((started, p["computed_tokens"].as_integer()), else_=0)).label("computed"),
        func.sum(case((and_(decided, p["outcome"].as_string() == "read"), 1), else_=0)
                 ).label("reuse_read"),
        func.sum(case((decided, 1), else_=0)).label("reuse_decided"),
    ).where(events_of(engine, run_id), E.c.type.in_(["PrefillStarted", "ReuseDecided"]))
        .group_by(E.c.instance, "bin"))


def occupancy(reqs: pd.DataFrame) -> pd.DataFrame:
    """Waiting and running requests over time per instance, from `instance_requests` rows:
    time, instance, state (waiting | running), count. Prefill: waiting from routing to prefill
    start, running until prefill ends. Decode: waiting from routing until its KV arrived (or
    its first token), running until it finished."""
    parts = []
    r = reqs.copy()
    r["routed"] = r["routed"].fillna(r["arrived"])
    r["kv_or_first"] = r["kv_received"].fillna(r["first_token"])

    def spans(inst: str, start: str, end: str, state: str) -> None:
        d = r[[inst, start, end]].dropna(subset=[inst, start])
        if d.empty:
            return
        ends = d[end].fillna(float("inf"))
        parts.append(pd.DataFrame({"time": d[start], "instance": d[inst], "state": state,
                                   "delta": 1}))
        closed = ends != float("inf")
        parts.append(pd.DataFrame({"time": ends[closed], "instance": d.loc[closed, inst],
                                   "state": state, "delta": -1}))

    spans("prefill", "routed", "prefill_started", "waiting")
    spans("prefill", "prefill_started", "prefill_finished", "running")
    spans("decode", "routed", "kv_or_first", "waiting")
    spans("decode", "kv_or_first", "finished", "running")
    if not parts:
        return pd.DataFrame(columns=["time", "instance", "state", "count"])
    d = pd.concat(parts, ignore_index=True).sort_values(["time", "delta"], kind="stable")
    d["count"] = d.groupby(["instance", "state"])["delta"].cumsum()
    return d[["time", "instance", "state", "count"]].reset_index(drop=True)


def attainment_windows(reqs: pd.DataFrame, ttft_s: float, tpot_s: float, width: float
                       ) -> pd.DataFrame:
    """Per time window of arrivals: offered (requests/s arriving), attainment (share of those
    requests meeting both SLOs, among finished ones), goodput (such requests per second)."""
    d = reqs.dropna(subset=["arrived"])
    if d.empty:
        return pd.DataFrame(columns=["window", "offered", "attainment", "goodput"])
    t0 = d["arrived"].min()
    w = ((d["arrived"] - t0) // width).astype(int)
    met = (d["ttft"] <= ttft_s) & (d["tpot"].fillna(0.0) <= tpot_s) & d["ttft"].notna()
    g = pd.DataFrame({"window": w, "met": met, "done": d["ttft"].notna()}).groupby("window")
    out = pd.DataFrame({"offered": g.size() / width, "met": g["met"].sum(),
                        "done": g["done"].sum()}).reset_index()
    out["attainment"] = out["met"] / out["done"].where(out["done"] > 0)
    out["goodput"] = out["met"] / width
    return out[["window", "offered", "attainment", "goodput"]]
