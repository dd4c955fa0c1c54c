"""Per-run rollups: what the pages show of a whole run, computed once from its events.

A page's first visit on a long run should not read the run's events (an hour of the bundled
32P32D cluster is about 23 million of them, 720,000 requests). So when a run is done, `write`
computes, with the very functions the pages use on events, what those pages show of the whole
run, and keeps it in the store (`run_rollups`, revision 0005), one part per page:

- `heads`: the run's row of the Runs table (requests, finished, failed, TTFT/TPOT/E2E means,
  leases, reuse decisions: `queries.run_heads`);
- `stats`: n, mean, p50, p90, p99 of TTFT, TPOT and E2E over finished requests (Runs page);
- `operations`: the run's span and bin width, the per-instance series of the Operations page
  (requests waiting and running reduced to per-bin peaks, KV blocks, prefix hits, transfer
  bytes), the instance counts, and the SLO windows and counts at the page's default SLO;
- `point`: the run's figures on the Push vs pull page (TTFT and TPOT mean and percentiles,
  requests) under its sweep's warm-up;
- `timeline`: the run's request count, prompt-token range, decode instances, and the slowest
  `TIMELINE_TOP` requests by each order the timeline offers (its most shown);
- `reuse`: the Reuse page's requests (prefill split; every one in a run of at most
  `REUSE_POINTS`, an even sample of that many in a longer one: `reuse_sample`) and the run's
  reuse outcome counts.

A rollup is stamped with the run's event count; the pages use it only while the run still has
exactly that many events (a run recorded on since is read from its events again), and only for
what it holds (an SLO other than the default, or a timeline filter, reads the events).
`kvplane sim run` writes one per point it records; `kvplane rollup` writes them for runs
recorded otherwise (live runs, imports, stores from before revision 0005).
"""

from __future__ import annotations

import math
from typing import Any, Final

import numpy as np
import pandas as pd
from sqlalchemy import Engine

from kvplane.store import EventStore, fresh_rollups

from . import queries as q

#: The Operations page's default SLO (ms): the SLO windows are kept for it.
DEFAULT_TTFT_MS: Final = 1000.0
DEFAULT_TPOT_MS: Final = 50.0
#: The timeline shows at most this many requests (its limit's maximum).
TIMELINE_TOP: Final = 500
TIMELINE_ORDERS: Final = ("e2e", "ttft", "queue")
#: The Operations page's bins: about this many over the run's span.
BINS: Final = 200
#: The Reuse page draws at most this many requests of a run (a scatter of an hour's 720,000
#: is neither readable nor quick in a browser): a longer run is shown by an even sample.
REUSE_POINTS: Final = 5000


# --- frames as plain JSON ---------------------------------------------------------------------


def to_json(df: pd.DataFrame) -> dict[str, Any]:
    """A frame as plain JSON (columns, dtypes, values; NaN as null) that `from_json` rebuilds
    with the same values and dtypes."""
    data = {}
    for col in df.columns:
        values = df[col].tolist()
        data[str(col)] = [None if isinstance(v, float) and not math.isfinite(v) else v
                          for v in values]
    return {"columns": [str(c) for c in df.columns],
            "dtypes": [str(t) for t in df.dtypes], "data": data}


def from_json(body: dict[str, Any]) -> pd.DataFrame:
    cols = body["columns"]
    df = pd.DataFrame({c: body["data"][c] for c in cols}, columns=cols)
    for c, t in zip(cols, body["dtypes"], strict=True):
        if t == "object":
            df[c] = df[c].astype(object).where(df[c].notna(), None)
        else:
            df[c] = df[c].astype(t)
    return df


def _num(v: Any) -> Any:
    """A JSON-safe number: NaN and infinities as null, numpy scalars as Python ones."""
    if v is None:
        return None
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def as_float(v: Any) -> float:
    """A number kept by `_num` back as a float (null: NaN)."""
    return float("nan") if v is None else float(v)


# --- what the pages compute (shared by the pages and `build`) ---------------------------------


def bin_width(span: tuple[float, float]) -> float:
    """A bin width giving about BINS bins, rounded to 1, 2 or 5 x 10^k seconds."""
    raw = max((span[1] - span[0]) / BINS, 1e-3)
    mag = 10 ** int(f"{raw:e}".split("e")[1])
    return float(next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw))


def peaks(occ: pd.DataFrame, width: float) -> pd.DataFrame:
    """A count series per `series` reduced to its peak in each time bin (held through bins
    without a change), so a figure stays a few hundred points whatever the run's size."""
    occ = occ.assign(bin=(occ["time"] // width).astype(int))
    peak = occ.groupby(["series", "bin"])["count"].max().unstack("series")
    bins = range(int(peak.index.min()), int(peak.index.max()) + 1)
    last = occ.groupby(["series", "bin"])["count"].last().unstack("series")
    held = last.reindex(bins).ffill().fillna(0)  # the level a bin ends at, carried on
    full = peak.reindex(bins).fillna(held.shift(1).fillna(0)).clip(lower=0)
    out = full.stack().rename("count").reset_index()
    out["time"] = out["bin"] * width
    return out


def operations_series(engine: Engine, run_id: str) -> dict[str, Any] | None:
    """What the Operations page draws that no widget changes: span, width, the occupancy
    peaks (`occ`: series, bin, count, time from the run's start), the block deltas per bin
    (`blocks`), prefix and reuse counts per bin (`prefix`), transfer bytes per bin
    (`transfers`), and the prefill and decode instance counts. None for a run without
    events."""
    span = q.run_span(engine, run_id)
    if span is None:
        return None
    width = bin_width(span)
    t0 = span[0]
    reqs = q.instance_requests(engine, run_id)
    occ = q.occupancy(reqs)
    if not occ.empty:
        occ = peaks(occ.assign(time=occ["time"] - t0,
                               series=occ["instance"] + " · " + occ["state"]), width)
    return {"span": span, "width": width, "occ": occ,
            "blocks": q.block_bins(engine, run_id, width),
            "prefix": q.prefix_bins(engine, run_id, width),
            "transfers": q.transfer_bins(engine, run_id, width),
            "prefill_n": int(reqs["prefill"].nunique()) if not reqs.empty else 0,
            "decode_n": int(reqs["decode"].nunique()) if not reqs.empty else 0,
            "reqs": reqs}


def operations_slo(reqs: pd.DataFrame, span: tuple[float, float], width: float,
                   ttft_ms: float, tpot_ms: float) -> dict[str, Any]:
    """The Operations page's SLO part for one SLO: the windows of arrivals (`win`), finished
    requests, those meeting the SLO, and the span from the first arrival to the last finish."""
    win = q.attainment_windows(reqs, ttft_ms / 1e3, tpot_ms / 1e3,
                               max((span[1] - span[0]) / 20, width))
    done = reqs.dropna(subset=["ttft"])
    met = int(((done["ttft"] <= ttft_ms / 1e3) & (done["tpot"].fillna(0) <= tpot_ms / 1e3)).sum())
    dur = float(reqs["finished"].max() - reqs["arrived"].min()) if not done.empty else 0.0
    return {"win": win, "done": len(done), "met": met, "dur": dur}


def order_key(view: pd.DataFrame, order_by: str) -> pd.Series:
    """The timeline's sort key of each request (larger first)."""
    return {"e2e": lambda: view["e2e"], "ttft": lambda: view["ttft"],
            "queue": lambda: view["prefill_started"] - view["arrived"]}[order_by]()


def slowest(view: pd.DataFrame, order_by: str) -> pd.DataFrame:
    """The timeline's requests, slowest first by `order_by` (requests without it first)."""
    return view.assign(_key=order_key(view, order_by)).sort_values(
        "_key", ascending=False, na_position="first")


def timeline_digest(reqs: pd.DataFrame) -> dict[str, Any]:
    """The request index's figures the timeline's widgets start from: requests, prompt-token
    range (lo, hi), decode instances."""
    return {"requests": len(reqs), "lo": int(reqs["prompt_tokens"].min()),
            "hi": int(reqs["prompt_tokens"].max()),
            "decodes": sorted(str(x) for x in reqs["decode"].dropna().unique())}


def reuse_sample(split: pd.DataFrame, limit: int = REUSE_POINTS) -> pd.DataFrame:
    """One run's Reuse-page requests (`queries.prefill_split`): all of them when there are at
    most `limit`, else `limit` of them evenly spaced in request order."""
    if len(split) <= limit:
        return split
    ordered = split.sort_values("request", kind="stable")
    return ordered.iloc[np.linspace(0, len(ordered) - 1, limit).round().astype(int)]


def sweep_scenario_from(scenario: str, meta: dict[str, Any] | None) -> dict[str, Any] | None:
    """The scenario of a sweep run (its `runs.scenario` and `meta`) as recorded or named
    (with its `published:` section): the sweep's own, else the bundled scenario its name or
    `compare_with` points at."""
    from kvplane.sim.config import ScenarioError, load_scenario

    meta = meta or {}
    name = meta.get("compare_with") or str(scenario).partition(":")[0]
    if isinstance(meta.get("scenario"), dict) and meta["scenario"].get("published"):
        return dict(meta["scenario"])
    try:
        return load_scenario(name).model_dump(mode="json")
    except ScenarioError:
        return None


def warmup_of(scenario: dict[str, Any] | None) -> tuple[int, int]:
    """A sweep's warm-up requests and the requests a point of exactly its size has."""
    warmup = int(scenario.get("warmup_requests", 0)) if scenario else 0
    expected = int(scenario.get("requests", 0)) + warmup if scenario else 0
    return warmup, expected


def point_figures(fin: pd.DataFrame, meta: dict[str, Any] | None, warmup: int,
                  expected: int) -> dict[str, Any]:
    """A sweep point's figures on the Push vs pull page from its finished requests (not
    empty): ttft_/tpot_ mean, p50, p90, p99 (ms) and requests."""
    mine = fin.sort_values("arrived")
    if warmup and meta and "seed" in meta and len(mine) == expected:
        # a simulated point of exactly the named scenario's size: leave its warm-up
        # requests out, as the simulator's own summary does (the sweep run does not
        # record the scenario it ran, so a point of another size keeps every request)
        mine = mine.iloc[warmup:]
    rec: dict[str, Any] = {}
    for metric in ("ttft", "tpot"):
        s = q.stats(mine[metric] if metric == "ttft" else mine.loc[
            mine["output_tokens"] > 1, metric])
        for stat in ("mean", "p50", "p90", "p99"):
            rec[f"{metric}_{stat}"] = s[stat]
    rec["requests"] = len(mine)
    return rec


def _point(engine: Engine, run_id: str, fin: pd.DataFrame) -> dict[str, Any] | None:
    """The `point` part: the run's Push vs pull figures under its parent sweep's warm-up."""
    from sqlalchemy import select

    from kvplane.store import runs_table as r

    with engine.connect() as conn:
        row = conn.execute(select(r.c.parent, r.c.meta).where(r.c.id == run_id)).first()
        parent = None if row is None or row[0] is None else conn.execute(
            select(r.c.scenario, r.c.meta).where(r.c.id == row[0])).first()
    if row is None or parent is None or fin.empty:
        return None
    warmup, expected = warmup_of(sweep_scenario_from(parent[0], parent[1]))
    rec = point_figures(fin, row[1], warmup, expected)
    return {"warmup": warmup, "expected": expected,
            "figures": {k: _num(v) for k, v in rec.items()}}


def point_of(body: dict[str, Any], warmup: int, expected: int) -> dict[str, Any] | None:
    """The `point` part's figures when kept under this warm-up, else None."""
    if (body.get("warmup"), body.get("expected")) != (warmup, expected):
        return None
    return {k: (int(v) if k == "requests" else as_float(v))
            for k, v in body["figures"].items()}


# --- building and reading ---------------------------------------------------------------------


def build(engine: Engine, run_id: str) -> dict[str, dict[str, Any]]:
    """Every part of the run's rollup, from its events (see the module)."""
    parts: dict[str, dict[str, Any]] = {}
    heads = q.run_heads(engine, [run_id])
    row = heads.iloc[0].to_dict() if not heads.empty else {}
    parts["heads"] = {k: _num(row.get(k)) for k in q.HEAD_COLUMNS}
    fin = q.finished_requests(engine, [run_id])
    parts["stats"] = {m: {k: _num(v) for k, v in q.stats(fin[m] if not fin.empty else
                                                         pd.Series(dtype=float)).items()}
                      for m in ("ttft", "tpot", "e2e")}
    point = _point(engine, run_id, fin)
    if point is not None:
        parts["point"] = point
    ops = operations_series(engine, run_id)
    if ops is not None:
        slo = operations_slo(ops["reqs"], ops["span"], ops["width"], DEFAULT_TTFT_MS,
                             DEFAULT_TPOT_MS)
        parts["operations"] = {
            "span": list(ops["span"]), "width": ops["width"],
            "occ": to_json(ops["occ"]), "blocks": to_json(ops["blocks"]),
            "prefix": to_json(ops["prefix"]), "transfers": to_json(ops["transfers"]),
            "prefill_n": ops["prefill_n"], "decode_n": ops["decode_n"],
            "slo": {"ttft_ms": DEFAULT_TTFT_MS, "tpot_ms": DEFAULT_TPOT_MS,
                    "win": to_json(slo["win"]), "done": slo["done"], "met": slo["met"],
                    "dur": _num(slo["dur"])},
        }
    split = q.prefill_split(engine, [run_id], bool(row.get("reuse_decisions")))
    parts["reuse"] = {"requests": len(split), "split": to_json(reuse_sample(split)),
                      "outcomes": to_json(q.reuse_outcomes(engine, [run_id]))}
    reqs = q.request_index(engine, run_id)
    if not reqs.empty:
        parts["timeline"] = {**timeline_digest(reqs), "top": {
            o: to_json(slowest(reqs, o).head(TIMELINE_TOP)) for o in TIMELINE_ORDERS}}
    return parts


def write(store: EventStore, run_id: str) -> int:
    """Compute the run's rollup and keep it in the store; the run's events it covers."""
    return store.put_rollup(run_id, build(store.engine, run_id))


def heads(engine: Engine, run_ids: list[str]) -> dict[str, dict[str, Any]]:
    """The `heads` part of the runs that have a current rollup."""
    return fresh_rollups(engine, run_ids, "heads")


def part(engine: Engine, run_id: str, name: str) -> dict[str, Any] | None:
    """One part of the run's current rollup, or None."""
    return fresh_rollups(engine, [run_id], name).get(run_id)


def stats_of(body: dict[str, Any]) -> dict[str, dict[str, float]]:
    """The `stats` part as `queries.stats` gives it (NaN where it was null)."""
    return {m: {k: (int(v) if k == "n" else as_float(v)) for k, v in s.items()}
            for m, s in body.items()}
