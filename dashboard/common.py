"""What every page shares: the store, cached reads, the runs picked, scenario look-ups.

Rules kept here:
- The store URL is `--db URL` after `--` on the streamlit command line, else `$KVPLANE_DB`,
  else the store's default (`./kvplane.db`), exactly as every `kvplane` command resolves it.
- One engine per URL for the life of the server (`st.cache_resource`); query results are
  cached per (URL, arguments) for `TTL_S` seconds, so a page switch or a widget change
  re-queries nothing, while a run still being recorded shows up within a minute. The
  "Refresh" button in the sidebar clears the caches.
- The runs picked on the Runs page (one or two) are kept in `st.session_state["picked"]` (not
  a widget key, so they survive page switches) and seed every other page's run selector; the
  `run` and `run2` query parameters seed them from a link.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import pandas as pd
import streamlit as st
from sqlalchemy import Engine

from kvplane.store import EventStore, open_store, resolve_url

from . import queries as q
from . import rollup

TTL_S = 60
PICKED = "picked"


def db_url() -> str:
    """The store URL: `-- --db URL` on the command line, else $KVPLANE_DB, else the default."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--db", default=None)
    args, _ = parser.parse_known_args(sys.argv[1:])
    return resolve_url(args.db).render_as_string(hide_password=False)


@st.cache_resource(show_spinner=False)
def store(url: str) -> EventStore:
    # The dashboard only reads (read-only: a damaged, foreign or newer store is refused with
    # a clear error; an older one is read as it is); a missing store is first created empty,
    # as its What-if page fills it.
    return open_store(url, read_only=True, create_missing=True)


def engine(url: str) -> Engine:
    return store(url).engine


def _e(url: str) -> Engine:
    return engine(url)


@st.cache_data(ttl=TTL_S, show_spinner=False)
def runs(url: str) -> pd.DataFrame:
    return q.runs(_e(url))


@st.cache_data(ttl=TTL_S, show_spinner=False)
def children(url: str, run_id: str) -> pd.DataFrame:
    return q.children(_e(url), run_id)


@st.cache_data(ttl=TTL_S, show_spinner="Reading the run's requests...")
def request_index(url: str, run_id: str) -> pd.DataFrame:
    return q.request_index(_e(url), run_id)


@st.cache_data(ttl=TTL_S, show_spinner=False)
def request_table(url: str, run_id: str, requests: tuple[str, ...]) -> pd.DataFrame:
    return q.request_table(_e(url), run_id, requests)


@st.cache_data(ttl=TTL_S, show_spinner=False)
def request_events(url: str, run_id: str, requests: tuple[str, ...]) -> pd.DataFrame:
    return q.request_events(_e(url), run_id, requests)


@st.cache_data(ttl=TTL_S, show_spinner="Reading finished requests...")
def finished_requests(url: str, run_ids: tuple[str, ...]) -> pd.DataFrame:
    return q.finished_requests(_e(url), run_ids)


@st.cache_data(ttl=TTL_S, show_spinner=False)
def reuse_outcomes(url: str, run_ids: tuple[str, ...]) -> pd.DataFrame:
    return q.reuse_outcomes(_e(url), run_ids)


@st.cache_data(ttl=TTL_S, show_spinner=False)
def prefill_split(url: str, run_ids: tuple[str, ...], reuse: bool = True) -> pd.DataFrame:
    return q.prefill_split(_e(url), run_ids, reuse)


@st.cache_data(ttl=TTL_S, show_spinner=False)
def lease_events(url: str, run_id: str) -> pd.DataFrame:
    return q.lease_events(_e(url), run_id)


@st.cache_data(ttl=TTL_S, show_spinner=False)
def run_span(url: str, run_id: str) -> tuple[float, float] | None:
    return q.run_span(_e(url), run_id)


@st.cache_data(ttl=TTL_S, show_spinner="Reading where requests waited and ran...")
def instance_requests(url: str, run_id: str) -> pd.DataFrame:
    return q.instance_requests(_e(url), run_id)


@st.cache_data(ttl=TTL_S, show_spinner=False)
def block_bins(url: str, run_id: str, width: float) -> pd.DataFrame:
    return q.block_bins(_e(url), run_id, width)


@st.cache_data(ttl=TTL_S, show_spinner=False)
def transfer_bins(url: str, run_id: str, width: float) -> pd.DataFrame:
    return q.transfer_bins(_e(url), run_id, width)


@st.cache_data(ttl=TTL_S, show_spinner=False)
def prefix_bins(url: str, run_id: str, width: float) -> pd.DataFrame:
    return q.prefix_bins(_e(url), run_id, width)


@st.cache_data(ttl=TTL_S, show_spinner=False)
def rollup_part(url: str, run_id: str, name: str) -> dict[str, Any] | None:
    """A part of the run's current rollup (`rollup`), or None: read the events instead."""
    return rollup.part(_e(url), run_id, name)


@st.cache_data(ttl=TTL_S, show_spinner="Reading finished requests...")
def request_stats(url: str, run_id: str) -> dict[str, dict[str, float]]:
    """n, mean, p50, p90, p99 (ms) of TTFT, TPOT and E2E over the run's finished requests:
    from its rollup, else from its events."""
    body = rollup_part(url, run_id, "stats")
    if body is not None:
        return rollup.stats_of(body)
    fin = finished_requests(url, (run_id,))
    return {m: q.stats(fin[m]) for m in ("ttft", "tpot", "e2e")}


@st.cache_data(ttl=TTL_S, show_spinner="Reading where requests waited and ran...")
def operations_series(url: str, run_id: str) -> dict[str, Any] | None:
    """The Operations page's series (`rollup.operations_series`, without `reqs`): from the
    run's rollup, else from its events."""
    body = rollup_part(url, run_id, "operations")
    if body is not None:
        return {"span": tuple(body["span"]), "width": float(body["width"]),
                **{k: rollup.from_json(body[k]) for k in ("occ", "blocks", "prefix",
                                                          "transfers")},
                "prefill_n": int(body["prefill_n"]), "decode_n": int(body["decode_n"])}
    got = rollup.operations_series(_e(url), run_id)
    if got is not None:
        got.pop("reqs")
    return got


@st.cache_data(ttl=TTL_S, show_spinner=False)
def operations_slo(url: str, run_id: str, ttft_ms: float, tpot_ms: float
                   ) -> dict[str, Any] | None:
    """The Operations page's SLO part (`rollup.operations_slo`): from the run's rollup when
    it was kept for this SLO, else from the run's requests."""
    body = rollup_part(url, run_id, "operations")
    if body is not None and (body["slo"]["ttft_ms"], body["slo"]["tpot_ms"]) == (ttft_ms,
                                                                                 tpot_ms):
        slo = body["slo"]
        return {"win": rollup.from_json(slo["win"]), "done": int(slo["done"]),
                "met": int(slo["met"]), "dur": rollup.as_float(slo["dur"])}
    series = operations_series(url, run_id)
    if series is None:
        return None
    return rollup.operations_slo(instance_requests(url, run_id), series["span"],
                                 series["width"], ttft_ms, tpot_ms)


def clear_caches() -> None:
    for fn in (rollup_part, request_stats, operations_series, operations_slo, runs, children, request_index, request_table, request_events, finished_requests,
               reuse_outcomes, prefill_split, lease_events, scenario_of, run_span,
               instance_requests, block_bins, transfer_bins, prefix_bins, pool_capacity,
               sweep_scenario):
        fn.clear()


# --- runs and labels ------------------------------------------------------------------------------


def run_label(row: Any) -> str:
    size = f"{int(row['requests'])} req" if row["requests"] else f"{int(row['children'])} points" \
        if row["children"] else "empty"
    return f"{row['scenario']} · {row['kind']} · {size} · {row['id'][:8]}"


def labels(table: pd.DataFrame) -> dict[str, str]:
    return {r["id"]: run_label(r) for r in table.to_dict("records")}


def picked() -> list[str]:
    """The runs picked on the Runs page (seeded from ?run=&run2= on first load, each a run id
    or a unique prefix of one, as the pages show them)."""
    if PICKED not in st.session_state:
        qp = st.query_params
        refs = [v for v in (qp.get("run"), qp.get("run2")) if v]
        st.session_state[PICKED] = [_full_id(r) for r in refs]
    return list(st.session_state[PICKED])


def _full_id(ref: str) -> str:
    """The run id a unique prefix names (the reference itself when it names none or many)."""
    try:
        ids = list(runs(db_url())["id"])
    except Exception:  # noqa: BLE001 - an unreadable store: app.py reports it
        return ref
    if ref in ids:
        return ref
    found = [i for i in ids if i.startswith(ref)]
    return found[0] if len(found) == 1 else ref


def set_picked(ids: list[str]) -> None:
    st.session_state[PICKED] = list(ids)


def pick_run(label: str, table: pd.DataFrame, key: str, *, prefer: int = 0,
             help: str | None = None) -> str | None:
    """A run selector over `table`'s runs, defaulting to the `prefer`-th picked run."""
    if table.empty:
        return None
    ids = list(table["id"])
    names = labels(table)
    chosen = picked()
    default = chosen[prefer] if len(chosen) > prefer and chosen[prefer] in ids else None
    if default is None and prefer > 0 and chosen and chosen[0] in ids and len(ids) > 1:
        default = next(i for i in ids if i != chosen[0])
    index = ids.index(default) if default in ids else 0
    if key in st.session_state and st.session_state[key] not in ids:
        del st.session_state[key]
    return st.selectbox(label, ids, index=index, format_func=lambda i: names.get(i, i), key=key,
                        help=help)


def point_runs(table: pd.DataFrame) -> pd.DataFrame:
    """Runs that hold requests (points, twins, imports with events)."""
    return table[table["requests"] > 0]


def preferring(table: pd.DataFrame, first: pd.Series) -> pd.DataFrame:
    """`table` with the rows where `first` is true moved to the top (stable otherwise): a
    page's selector then defaults to a run that has something to show there."""
    return pd.concat([table[first], table[~first]])


def sweep_runs(table: pd.DataFrame) -> pd.DataFrame:
    """Runs with sweep points as children (sweeps, what-ifs, import directories)."""
    return table[table["points"] > 0]


# --- scenarios and published figures --------------------------------------------------------------


@st.cache_data(ttl=TTL_S, show_spinner=False)
def scenario_of(url: str, run_id: str) -> dict[str, Any] | None:
    """The scenario (model_dump) a run was made under, or None when it cannot be told."""
    from kvplane.sim.config import ScenarioError, load_scenario
    from kvplane.sim.replay_sim import scenario_for_run

    reader = store(url)
    try:
        info = reader.run(run_id)
    except Exception:  # noqa: BLE001 - deleted meanwhile
        return None
    compare = info.meta.get("compare_with") if isinstance(info.meta, dict) else None
    if isinstance(compare, str):
        try:
            return load_scenario(compare).model_dump(mode="json")
        except ScenarioError:
            return None
    try:
        return scenario_for_run(reader, info).model_dump(mode="json")
    except (ScenarioError, ValueError):
        return None


@st.cache_data(ttl=TTL_S, show_spinner=False)
def sweep_scenario(url: str, sweep_id: str) -> dict[str, Any] | None:
    """The scenario of a sweep as recorded or named (with its `published:` section): the
    sweep's own, else the bundled scenario its name or `compare_with` points at."""
    table = runs(url)
    row = table[table["id"] == sweep_id]
    if row.empty:
        return None
    return rollup.sweep_scenario_from(str(row.iloc[0]["scenario"]), row.iloc[0]["meta"])


def point_axes(scenario_name: str, meta: dict[str, Any] | None) -> dict[str, Any] | None:
    """mode, bidirectional, qps, input_len, output_len, iteration of a point run."""
    from kvplane.sim.replay_sim import parse_label

    label = (meta or {}).get("point") or scenario_name.rpartition(":")[2]
    return parse_label(str(label))


@st.cache_data(ttl=TTL_S, show_spinner=False)
def pool_capacity(url: str, run_id: str) -> dict[str, Any] | None:
    """KV pool blocks per prefill and decode instance and TP sizes, from the run's scenario as
    the simulator sizes them (for a live run: the scenario it ships with, a prediction: vLLM's
    own pool size is not recorded). None when the run's scenario cannot be told."""
    from kvplane.sim.config import scenario_from_data
    from kvplane.sim.costs import SimCosts

    data = scenario_of(url, run_id)
    if data is None:
        return None
    try:
        sc = scenario_from_data(data, file=f"run {run_id}")
        costs = SimCosts.from_scenario(sc)
    except Exception:  # noqa: BLE001 - a scenario that no longer loads: no capacity line
        return None
    return {"prefill": int(costs.pool_blocks["prefill"]),
            "decode": int(costs.pool_blocks["decode"]),
            "prefill_tp": sc.prefill_tp, "decode_tp": sc.decode_tp}
