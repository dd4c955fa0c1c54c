"""Request timeline: a Gantt chart per request (queue, prefill, registration wait, rendezvous,
transfer, first decode step, decode), slowest first, filterable, the events behind each bar
on hover."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from .. import common, figures, rollup
from ..queries import PHASES, phases

TITLE = "Request timeline"
SLUG = "timeline"


def render(url: str, table: pd.DataFrame) -> None:
    st.header("Request timeline")
    run_id = common.pick_run("Run", common.point_runs(table), "timeline_run")
    if run_id is None:
        st.info("No run with requests in the store.")
        return
    # the widgets start from the run's rollup when it has a current one; the whole request
    # index is read only when a filter narrows it (or the run has no rollup)
    digest = common.rollup_part(url, run_id, "timeline")
    reqs = None
    if digest is None:
        reqs = common.request_index(url, run_id)
        if reqs.empty:
            st.info("This run holds no request events.")
            return
        digest = rollup.timeline_digest(reqs)
    c1, c2, c3, c4 = st.columns(4)
    order_by = c1.selectbox("Slowest by", ["e2e", "ttft", "queue"], key="timeline_order")
    limit = c2.number_input("Requests shown", 5, rollup.TIMELINE_TOP, 40, step=5,
                            key="timeline_limit")
    lo, hi = int(digest["lo"]), int(digest["hi"])
    span = c3.slider("Prompt tokens", lo, max(hi, lo + 1), (lo, max(hi, lo + 1)),
                     key="timeline_prompt")
    align = c4.toggle("Align at arrival", True, key="timeline_align")
    c5, c6, c7, c8 = st.columns(4)
    decodes = list(digest["decodes"])
    chosen_dec = c5.multiselect("Decode instance", decodes, default=decodes,
                                key="timeline_decode")
    only_failed = c6.checkbox("Only failed or unfinished", False, key="timeline_failed")
    search = c7.text_input("Request id contains", "", key="timeline_search")
    all_phases = [p[0] for p in PHASES]
    shown_phases = c8.multiselect("Phases", all_phases, default=all_phases,
                                  key="timeline_phases",
                                  help="Leave decode out to see the short phases better.")

    unfiltered = (tuple(span) == (lo, max(hi, lo + 1)) and list(chosen_dec) == decodes
                  and not only_failed and not search)
    if reqs is None and unfiltered:  # every request matches: the rollup's slowest
        total = matched = int(digest["requests"])
        view = rollup.from_json(digest["top"][order_by])
    else:
        if reqs is None:
            reqs = common.request_index(url, run_id)
        view = reqs[(reqs["prompt_tokens"] >= span[0]) & (reqs["prompt_tokens"] <= span[1])]
        if decodes and chosen_dec != decodes:
            view = view[view["decode"].isin(chosen_dec)]
        if only_failed:
            view = view[~view["ok"]]
        if search:
            view = view[view["request"].str.contains(search, regex=False)]
        total, matched = len(reqs), len(view)
        view = rollup.slowest(view, order_by)
    shown = list(view["request"].head(int(limit)))
    # milestones only for the page of requests shown: a million-event run stays quick
    page = common.request_table(url, run_id, tuple(shown)).set_index("request").loc[shown] \
        .reset_index() if shown else view.head(0)
    st.caption(f"{matched} of {total} requests match; showing the {len(page)} slowest "
               f"by {order_by}.")
    if page.empty:
        return
    segs = phases(page)
    segs = segs[segs["phase"].isin(shown_phases)]
    events = common.request_events(url, run_id, tuple(page["request"]))
    st.plotly_chart(figures.timeline(page, segs, events, align=align), width="stretch",
                    key="timeline_chart")
    summary = segs.assign(ms=(segs["end"] - segs["start"]) * 1e3).groupby("phase")["ms"] \
        .agg(["count", "mean", "max"]).round(2)
    st.subheader("Phases of the requests shown (ms)")
    st.dataframe(summary, width="stretch")
    with st.expander("Requests shown"):
        cols = ["request", "prompt_tokens", "output_tokens", "mode", "prefill", "decode",
                "cached_tokens", "ttft", "e2e", "ok", "events"]
        st.dataframe(page[[c for c in cols if c in page]], hide_index=True,
                     width="stretch")
    pick = st.selectbox("Events of one request", list(page["request"]), key="timeline_req")
    ev = events[events["request"] == pick]
    st.dataframe(ev.assign(ms=(ev["time"] - float(page.set_index("request").loc[pick, "arrived"]
                                                  or 0.0)) * 1e3)[
        ["seq", "ms", "type", "instance", "payload"]].round({"ms": 3}),
        hide_index=True, width="stretch")
