"""Leases: retained KV blocks over time per decode instance, and grants, renewals, expiries
and releases over time."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from .. import common, figures
from ..queries import retained_blocks

TITLE = "Leases"
SLUG = "leases"


def render(url: str, table: pd.DataFrame) -> None:
    st.header("Leases")
    points = common.point_runs(table)
    points = common.preferring(points, points["leases"] > 0)
    run_id = common.pick_run("Run", points, "leases_run")
    if run_id is None:
        st.info("No run with requests in the store.")
        return
    rows = common.lease_events(url, run_id)
    if rows.empty:
        st.info("No lease in this run (reuse off and push mode hold no lease).")
        return
    purposes = sorted(rows["purpose"].dropna().unique())
    default = "retained" if "retained" in purposes else purposes[0] if purposes else "retained"
    purpose = st.radio("Leases on", purposes or ["retained"], horizontal=True,
                       index=(purposes or ["retained"]).index(default), key="leases_purpose",
                       help="retained: decode keeps a finished turn's KV for the next turn; "
                            "pull_hold: prefill holds blocks until decode has read them")
    blocks = retained_blocks(rows, purpose)
    grants = rows[(rows["type"] == "LeaseGranted") & (rows["purpose"] == purpose)]
    mine = rows[rows["lease"].isin(set(grants["lease"]))]
    st.plotly_chart(figures.leases(blocks, mine, purpose), width="stretch",
                    key="leases_chart")
    counts = mine.groupby(["instance", "type"]).size().unstack(fill_value=0)
    peak = blocks.groupby("instance")["blocks"].max().rename("peak blocks held")
    st.dataframe(counts.join(peak), width="stretch")
    ends = mine[mine["type"].isin(["LeaseExpired", "LeaseReleased"])].drop_duplicates("lease")
    held = ends.set_index("lease")["time"] - grants.set_index("lease")["time"]
    if not held.dropna().empty:
        st.caption(f"{len(grants)} leases; held {held.mean():.1f} s on average, "
                   f"{held.max():.1f} s at most; {int((ends['type'] == 'LeaseExpired').sum())} "
                   "expired, the rest released.")
