"""The kvplane dashboard: `kvplane dashboard` runs `streamlit run` on this file.

Pages, picked in the sidebar (or `?page=` in the URL): Runs, Request timeline, Push vs pull,
Reuse, Leases, Sim vs live, What-if. Every page reads the store through `common` (cached,
aggregated in SQL); only What-if and "make a twin" write, through the simulator.
"""

from __future__ import annotations

import streamlit as st

from kvplane.dashboard import common
from kvplane.dashboard.views import PAGES

st.set_page_config(page_title="kvplane", page_icon="🧭", layout="wide")

url = common.db_url()
names = list(PAGES)
wanted = st.query_params.get("page")
if "page" not in st.session_state:
    slugs = {v.SLUG: k for k, v in PAGES.items()}
    st.session_state["page"] = slugs.get(wanted or "", names[0])

with st.sidebar:
    st.title("kvplane")
    page = st.radio("Page", names, key="page")
    st.caption(f"store: `{url.split('@')[-1]}`")
    try:
        note = common.store(url).upgrade_note
    except Exception:  # noqa: BLE001 - an unreadable store: reported below
        note = None
    if note:
        st.warning(note[0].upper() + note[1:], icon="🐢")
    if st.button("Refresh", help="Read the store again (queries are cached for a minute)."):
        common.clear_caches()

st.query_params["page"] = PAGES[page].SLUG
try:
    table = common.runs(url)
except Exception as exc:  # noqa: BLE001 - a store we cannot read: say so, show nothing else
    st.error(f"Cannot read the store at {url}: {exc}")
    st.stop()
PAGES[page].render(url, table)
