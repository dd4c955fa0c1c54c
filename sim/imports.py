"""Bringing outside measurements into the store: `vllm bench serve` results and request traces.

Rules kept here:
- A `vllm bench serve` result directory holds files named like the runner's points,
  `<mode>[_bidi]_qps<q>_in<in>_out<out>_iter<i>.json`. Each file becomes one run of kind
  `import` (scenario `vllm-bench:<dir>:<label>`), a child of one import run for the directory,
  so the dashboard reads an imported sweep exactly like a simulated one. The summary fields
  (`mean_ttft_ms`, `p99_tpot_ms`, `completed`, `request_throughput`, ...) go to the run's
  `meta.summary`.
- Per-request fields (`--save-detailed`: `ttfts`, `itls`, `latencies` or `e2els`, `input_lens`,
  `output_lens`, `start_times`, `errors`; times in seconds) become events: `RequestArrived`,
  `FirstTokenEmitted` and `RequestFinished` per request, on instance `client`, so per-request
  figures and a simulated twin work on imports too. Without `start_times` arrivals are spaced
  evenly at the file's request rate and `meta.arrivals` says so.
- Everything is read and checked before anything is written: a bad file raises
  `ImportProblem` listing every bad file with what is wrong, and nothing is stored. The runs
  and events are written in one transaction, so an import is whole or absent.
- A Mooncake trace is checked line by line (`workloads.read_trace`: file:line, field,
  expected) and becomes a scenario YAML next to it (`kind: trace` workload; cluster, profiles,
  engine and connector from a base scenario); optionally its arrivals are stored as an import
  run too, which `kvplane twin` can re-simulate.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from kvplane.core.events import (
    SCHEMA_VERSION,
    Event,
    FirstTokenEmitted,
    RequestArrived,
    RequestFinished,
)
from kvplane.store import EventStore, encode_batch, open_store, runs_table
from kvplane.store.bulk import bulk_insert, run_keys
from kvplane.store.engine import WRITE_LOCK

from .config import ScenarioError, load_scenario
from .profiles import bundled_profile_names
from .replay_sim import parse_label
from .workloads import read_trace

__all__ = [
    "BadFile",
    "BenchFile",
    "ImportProblem",
    "import_trace",
    "import_vllm_bench",
    "read_bench_file",
]

_STAT_KEY = re.compile(r"^(mean|median|std|p\d+(\.\d+)?)_(ttft|tpot|itl|e2el)_ms$")
_SUMMARY_KEYS = (
    "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
    "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
    "request_rate", "burstiness", "max_concurrency", "num_prompts", "model_id", "backend",
    "date", "max_output_tokens_per_s", "max_concurrent_requests",
)


class ImportProblem(ValueError):
    """Files that cannot be imported, each with what is wrong; nothing was stored."""

    def __init__(self, problems: Sequence[tuple[str, str]]) -> None:
        self.problems = list(problems)
        lines = "\n".join(f"  {where}: {what}" for where, what in self.problems)
        super().__init__(f"{len(self.problems)} problem(s), nothing imported:\n{lines}")


class BadFile(ValueError):
    """What is wrong with one file (the caller adds the file name)."""


@dataclass
class BenchFile:
    """One checked result file: its point, summary, and the events it turns into."""

    path: Path
    label: str
    axes: dict[str, Any]
    summary: dict[str, Any]
    events: list[Event] = field(default_factory=list)
    arrivals: str = "none"


# --- vllm bench serve -----------------------------------------------------------------------------


def _num(value: Any, where: str, *, allow_none: bool = False) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadFile(f"{where}: expected a finite number, got {value!r}")
    return float(value)


def _list(data: dict[str, Any], key: str, n: int | None) -> list[Any] | None:
    if key not in data:
        return None
    value = data[key]
    if not isinstance(value, list):
        raise BadFile(f"{key}: expected a list, got {type(value).__name__}")
    if n is not None and len(value) != n:
        raise BadFile(f"{key}: {len(value)} entries, but other per-request fields have {n}")
    return value


def read_bench_file(path: Path) -> BenchFile:
    """Check one result file; BadFile says what is wrong with it (without the file name)."""
    label = path.stem
    axes = parse_label(label)
    if axes is None:
        raise BadFile(
            "file name is not <mode>[_bidi]_qps<q>_in<in>_out<out>_iter<i>.json "
            "(mode push or pull)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise BadFile(f"cannot read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise BadFile(f"not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    if not isinstance(data, dict):
        raise BadFile(f"expected a JSON object at the top, got {type(data).__name__}")
    summary: dict[str, Any] = {}
    for key, value in data.items():
        if _STAT_KEY.match(key):
            summary[key] = _num(value, key, allow_none=True)
        elif key in _SUMMARY_KEYS:
            if isinstance(value, float) and not math.isfinite(value):
                value = str(value)  # request_rate: inf
            summary[key] = value
    if "completed" in data:
        c = data["completed"]
        if isinstance(c, bool) or not isinstance(c, int) or c < 0:
            raise BadFile(f"completed: expected a non-negative integer, got {c!r}")
    ttfts = _list(data, "ttfts", None)
    if ttfts is None:
        if "mean_ttft_ms" not in summary:
            raise BadFile("neither per-request fields (ttfts, ...) nor summary fields "
                             "(mean_ttft_ms, ...): not a vllm bench serve result")
        return BenchFile(path, label, axes, summary)
    n = len(ttfts)
    latencies = _list(data, "latencies", n)
    if latencies is None:
        latencies = _list(data, "e2els", n)
    inputs = _list(data, "input_lens", n)
    outputs = _list(data, "output_lens", n)
    starts = _list(data, "start_times", n)
    errors = _list(data, "errors", n) or [""] * n
    itls = _list(data, "itls", n)
    missing = [k for k, v in (("latencies or e2els", latencies), ("input_lens", inputs),
                              ("output_lens", outputs)) if v is None]
    if missing:
        raise BadFile(f"ttfts given but not {', '.join(missing)}")
    assert latencies is not None and inputs is not None and outputs is not None
    arrivals = "start_times"
    if starts is None:
        rate = data.get("request_rate")
        rate_f = float(rate) if isinstance(rate, (int, float)) and not isinstance(rate, bool) \
            else float("inf")
        step = 1.0 / rate_f if math.isfinite(rate_f) and rate_f > 0 else 0.0
        starts = [i * step for i in range(n)]
        arrivals = (f"synthesized: evenly spaced at request_rate {rate!r} (the file has no "
                    "start_times)")
    t0 = min((_num(s, f"start_times[{i}]") or 0.0 for i, s in enumerate(starts)), default=0.0)
    events: list[Event] = []
    for i in range(n):
        req = f"req-{i}"
        start = (_num(starts[i], f"start_times[{i}]") or 0.0) - t0
        n_in, n_out = inputs[i], outputs[i]
        for key, v in (("input_lens", n_in), ("output_lens", n_out)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise BadFile(f"{key}[{i}]: expected a non-negative integer, got {v!r}")
        ok = not errors[i]
        ttft = _num(ttfts[i], f"ttfts[{i}]") or 0.0
        lat = _num(latencies[i], f"latencies[{i}]") or 0.0
        if ok and (ttft <= 0 or lat < ttft):
            raise BadFile(f"request {i}: ttft {ttft!r} s and latency {lat!r} s are not "
                             "0 < ttft <= latency")
        if itls is not None and not isinstance(itls[i], list):
            raise BadFile(f"itls[{i}]: expected a list of seconds")
        events.append(RequestArrived(at=start, instance="client", request=req,
                                     prompt_tokens=max(n_in, 1), output_tokens=max(n_out, 1)))
        if ok:
            events.append(FirstTokenEmitted(at=start + ttft, instance="client", request=req,
                                            ttft=ttft))
        tpot = (lat - ttft) / (n_out - 1) if ok and n_out > 1 else 0.0
        events.append(RequestFinished(at=start + (lat if ok else 0.0), instance="client",
                                      request=req, output_tokens=n_out if ok else 0,
                                      ttft=ttft if ok else 0.0, tpot=tpot,
                                      e2e=lat if ok else 0.0, ok=ok))
    events.sort(key=lambda e: e.at)
    return BenchFile(path, label, axes, summary, events, arrivals)


def import_vllm_bench(db: str | EventStore | None, directory: str | Path, *,
                      scenario: str | None = None) -> dict[str, Any]:
    """Import every `*.json` of a `vllm bench serve` result directory as one sweep.

    `scenario` names the scenario the measurements reproduce (its `published:` figures are then
    overlaid by the dashboard). Returns {"run_id", "points": [{"label", "run_id", "requests"}]}.
    Raises ImportProblem (nothing stored) when any file is bad or there is none.
    """
    folder = Path(directory)
    if not folder.is_dir():
        raise ImportProblem([(str(folder), "not a directory")])
    files = sorted(folder.glob("*.json"))
    if not files:
        raise ImportProblem([(str(folder), "no *.json result files in it")])
    if scenario is not None:
        try:
            load_scenario(scenario)
        except ScenarioError as exc:
            raise ImportProblem([(f"--scenario {scenario}", str(exc))]) from None
    problems: list[tuple[str, str]] = []
    checked: list[BenchFile] = []
    for path in files:
        try:
            checked.append(read_bench_file(path))
        except BadFile as exc:
            problems.append((str(path), str(exc)))
    labels = [b.label for b in checked]
    for label in sorted({x for x in labels if labels.count(x) > 1}):
        problems.append((label, "two files for one point"))
    if problems:
        raise ImportProblem(problems)
    encoded = []
    for b in checked:
        try:
            encoded.append(encode_batch(b.events))
        except Exception as exc:  # noqa: BLE001 - EventRefused: name the file
            problems.append((str(b.path), str(exc)))
    if problems:
        raise ImportProblem(problems)
    if isinstance(db, EventStore):
        return _write_bench(db, folder, checked, encoded, scenario)
    with open_store(db) as store:
        return _write_bench(store, folder, checked, encoded, scenario)


def _write_bench(store: EventStore, folder: Path, checked: list[BenchFile],
                 encoded: list[Any], scenario: str | None) -> dict[str, Any]:
    now = datetime.now(UTC)
    parent = str(uuid.uuid4())
    rows = [{
        "id": parent, "kind": "import", "scenario": f"vllm-bench:{folder.name}",
        "started": now, "parent": None, "schema_version": SCHEMA_VERSION,
        "meta": {"source": "vllm bench serve", "directory": str(folder.resolve()),
                 "points": len(checked), "compare_with": scenario},
    }]
    points = []
    for b in checked:
        run_id = str(uuid.uuid4())
        rows.append({
            "id": run_id, "kind": "import", "scenario": f"vllm-bench:{folder.name}:{b.label}",
            "started": now, "parent": parent, "schema_version": SCHEMA_VERSION,
            "meta": {"point": b.label, **b.axes, "file": b.path.name, "summary": b.summary,
                     "arrivals": b.arrivals, "requests": sum(
                         1 for e in b.events if isinstance(e, RequestArrived))},
        })
        points.append({"label": b.label, "run_id": run_id, "requests": rows[-1]["meta"]["requests"]})
    writer = store.engine.execution_options(**{WRITE_LOCK: True})
    with writer.begin() as conn:  # one transaction: the whole directory or nothing
        conn.execute(runs_table.insert(), rows[:1])
        if len(rows) > 1:
            conn.execute(runs_table.insert(), rows[1:])
        keys = run_keys(conn, [p["run_id"] for p in points])  # the database gave them
        for point, enc in zip(points, encoded, strict=True):
            if enc:
                bulk_insert(conn, keys[point["run_id"]], 0, enc)
    return {"run_id": parent, "points": points}


# --- traces ---------------------------------------------------------------------------------------


def import_trace(path: str | Path, *, fmt: str = "mooncake", base: str = "seed_push_vs_pull",
                 out: str | Path | None = None, db: str | EventStore | None = None,
                 record: bool = False, time_scale: float = 1.0,
                 hash_block_tokens: int = 512) -> dict[str, Any]:
    """Check a trace, write a scenario YAML replaying it, optionally store its arrivals.

    Returns {"scenario": yaml path, "requests": n, "run_id": id or None}. A bad line raises
    ScenarioError naming file:line; nothing is written then.
    """
    if fmt != "mooncake":
        raise ScenarioError(str(path), [("--format", "mooncake", repr(fmt), None)])
    trace = Path(path)
    batch = read_trace(trace, time_scale=time_scale, hash_block_tokens=hash_block_tokens)
    if len(batch) == 0:
        raise ScenarioError(str(trace), [("", "at least one request line", "none", None)])
    base_sc = load_scenario(base)
    target = Path(out) if out is not None else trace.with_suffix(".scenario.yaml")
    longest = int(batch.prompt_tokens.max() + batch.output_tokens.max())
    data = base_sc.model_dump(mode="json", exclude={"sweep", "published", "assumptions"})
    bundled = {kind: bundled_profile_names(kind) for kind in ("model", "hardware")}
    for kind, prof in (("model", base_sc.model), ("hardware", base_sc.hardware)):
        if prof.name in bundled[kind]:
            data["profiles"][kind] = prof.name  # a name keeps the YAML short and readable
    data["name"] = f"trace_{trace.stem}"
    data["description"] = (f"Replay of the {fmt} trace {trace.name} ({len(batch)} requests) on "
                           f"{base_sc.name}'s cluster, profiles, engine and connector.")
    data["requests"] = len(batch)
    data["warmup_requests"] = 0
    data["engine"]["max_model_len"] = max(data["engine"]["max_model_len"], longest)
    if not data["engine"]["chunked_prefill"]:
        data["engine"]["max_num_batched_tokens"] = max(data["engine"]["max_num_batched_tokens"],
                                                       data["engine"]["max_model_len"])
    try:
        rel = Path(trace.resolve()).relative_to(target.resolve().parent)
        trace_ref = str(rel)
    except ValueError:
        trace_ref = str(trace.resolve())
    data["workload"] = {"kind": "trace", "path": trace_ref, "time_scale": time_scale,
                        "hash_block_tokens": hash_block_tokens}
    text = (f"# Written by `kvplane import trace {trace.name} --format {fmt}` from {base}.\n"
            + yaml.safe_dump(data, sort_keys=False, width=100))
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    try:
        load_scenario(tmp.rename(target))  # check the file we wrote loads as a scenario
    except ScenarioError:
        target.unlink(missing_ok=True)
        raise
    run_id = None
    if record:
        events: list[Event] = [
            RequestArrived(at=float(batch.arrival[i]), instance="client", request=f"req-{i}",
                           prompt_tokens=int(batch.prompt_tokens[i]),
                           output_tokens=int(batch.output_tokens[i]))
            for i in range(len(batch))
        ]
        meta = {"source": f"{fmt} trace", "file": str(trace.resolve()),
                "scenario": load_scenario(target).model_dump(mode="json"),
                "requests": len(batch)}
        if isinstance(db, EventStore):
            run_id = _store_arrivals(db, f"trace:{trace.stem}", meta, events)
        else:
            with open_store(db) as store:
                run_id = _store_arrivals(store, f"trace:{trace.stem}", meta, events)
    return {"scenario": str(target), "requests": len(batch), "run_id": run_id}


def _store_arrivals(store: EventStore, name: str, meta: dict[str, Any],
                    events: list[Event]) -> str:
    enc = encode_batch(events)
    run_id = str(uuid.uuid4())
    writer = store.engine.execution_options(**{WRITE_LOCK: True})
    with writer.begin() as conn:
        conn.execute(runs_table.insert(), [{
            "id": run_id, "kind": "import", "scenario": name, "started": datetime.now(UTC),
            "parent": None, "schema_version": SCHEMA_VERSION, "meta": meta}])
        bulk_insert(conn, run_keys(conn, [run_id])[run_id], 0, enc)
    return run_id
