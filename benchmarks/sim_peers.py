"""Requests simulated per CPU-second: kvplane against Vidur and DistServe, on the peers' workloads.

The goal (issue 12): kvplane simulates at least 10x the requests per CPU-second of each peer on
that peer's own documented workload. The peers are not installed in CI: without them this script
runs kvplane's side and prints the peers' figures last recorded in
docs/measurements/sim-peers.json (labelled as recorded, with the date and the command). Given a
peer's interpreter and checkout, it runs the peer in the same invocation and prints the ratios.

The two workloads (what each peer simulates, and kvplane's closest scenario):

vidur  Vidur (microsoft/vidur, the README's "big example"): Meta-Llama-3-8B on one A100 80GB of a
       DGX node, one replica, TP1 PP1, the Sarathi scheduler (chunked prefill, chunk 512 tokens,
       batch cap 512), 512 requests from the synthetic generator: Poisson arrivals at 6.45
       requests/s, prompt and output lengths drawn from Vidur's copy of the Azure LLM inference
       trace 2023, conversation part (data/processed_traces/splitwise_conv.csv: 19,366 requests,
       prompts mean 1,155 tokens, outputs mean 211, at most 16,384 tokens per request), random
       forest execution-time predictor, no prefix caching. Vidur simulates one colocated replica:
       prefill chunks and decodes share each batch, no KV transfer.
       kvplane: the same model on A100 80GB (an A100 hardware profile built here from the
       datasheet, the efficiencies of the H100 calibration), 1 prefill + 1 decode instance, TP1
       each, on one node (KV over NVLink), push transfers, chunked prefill with a 512-token
       budget, max_num_seqs 512, block size 16, prefix caching off, 512 requests at 6.45/s from
       the same length distribution (101 quantiles of the trace's prompt and output lengths,
       each drawn independently: the pairing of the trace is not kept). Differs: kvplane
       simulates P/D disaggregation on two GPUs (each request is also planned, transferred and
       notified through the protocol core), Vidur one GPU serving both phases.

distserve DistServe's simulator (LLMServe/DistServe, simdistserve/benchmarks/simulate_dist.py,
       the run its README's placement search repeats for each candidate): OPT-13B on A100 80GB,
       disaggregated: 1 prefill instance at TP2 and 1 decode instance at TP1 (the configuration
       the README's example finds best), no chunked prefill, batches bounded by DistServe's
       memory estimate, 1,000 requests, Poisson arrivals at 4.68 requests/s (the example's best
       rate, 1.56 per GPU, times 3 GPUs). The README's workload is ShareGPT, whose preprocessed
       file is not in the repository (it is a download) and not reachable here: this script gives
       DistServe the same Azure conversation length distribution as above, drawn until
       prompt + output < 2,048 tokens (DistServe's own filter for OPT's 2,048 positions), as its
       documented custom workload file ({start_time, prompt_len, output_len}). DistServe prices
       steps with its fitted latency model and does not simulate the KV transfer.
       kvplane: the same requests (the same file, as a trace), OPT-13B (fp16) on the A100 profile,
       1 prefill (TP2) + 1 decode (TP1) instance on one node (KV over NVLink), push transfers,
       no chunked prefill (budget 8,192 tokens), max_num_seqs 256, prefix caching off. Differs:
       kvplane also simulates the transfer (planned, posted and notified per request).

Measured: CPU seconds of the process (`time.process_time`, all threads) around the simulation
only, in a fresh process per run (interpreter start-up and imports not counted, on either
side); requests = requests that finished. "Recording off": kvplane with no recorder; Vidur with
`--no-metrics_config_write_metrics --no-metrics_config_enable_chrome_trace
--no-metrics_config_store_plots`; DistServe's event loop alone. "Recording on": kvplane with
every event through the batching recorder into a fresh SQLite store (`kvplane sim run`'s
default); Vidur with its defaults (metrics, plots and the Chrome trace written); DistServe's
`simulate_dist.main` (its per-request latency tables and SLO attainment). Vidur's execution-time
models are trained (and cached in its `cache/` folder) on its first run: one untimed run warms
the cache, so its figures are the warm ones (start-up = building the simulator, counted). Its
grid search for them is narrowed to one of its settings (`VIDUR_TRAINING`): the full search is
hours of CPU here, and it only changes the predicted step times, not the simulation's work.

Vidur's attention profile for this model and device (data/profiling/compute/a100/
meta-llama/Meta-Llama-3-8B/attention.csv) is a Git LFS object; when the checkout lacks it
(a plain snapshot), `--vidur-stand-in` writes one in Vidur's format over Vidur's profiling grid
from a two-term model (prefill: fixed + per query-key pair; decode: fixed + per cached token read)
anchored on the published file's first rows, and the report says so. Vidur's MLP and network
profiles are its own.

Setting the peers up (each in its own virtual environment, outside this repository):
  Vidur: a checkout of microsoft/vidur (with `git lfs pull` for its profiles, or
    `--vidur-stand-in`), Python 3.10, `pip install numpy pandas scikit-learn wandb ddsketch
    plotly_express "plotly<6" "kaleido==0.2.1" matplotlib seaborn fasteners pyyaml` (kaleido 1.x
    wants a browser download; plotly 6+ wants kaleido 1.x). Its first run trains and caches its
    models (minutes; about 800 MB in its `cache/`).
  DistServe: a checkout of LLMServe/DistServe (the `simdistserve` folder is enough), Python 3.11,
    `pip install simpy pandas numpy tqdm matplotlib tabulate`.

Usage: python benchmarks/sim_peers.py [--repeat 3]
           [--vidur-python PY --vidur-repo DIR [--vidur-stand-in]]
           [--distserve-python PY --distserve-repo DIR] [--save]
`--save` writes the peers' figures of this run into docs/measurements/sim-peers.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
RECORDED = REPO / "docs" / "measurements" / "sim-peers.json"
PROFILES = REPO / "scenarios" / "profiles"
GOAL = 10.0


@dataclass(frozen=True)
class PeerWorkload:
    key: str
    peer: str
    requests: int
    qps: float
    seed: int
    max_total_tokens: int   # prompt + output, exclusive bound (DistServe) or inclusive (Vidur)


VIDUR = PeerWorkload("vidur", "Vidur", requests=512, qps=6.45, seed=42, max_total_tokens=16384)
DISTSERVE = PeerWorkload("distserve", "DistServe", requests=1000, qps=4.68, seed=0,
                         max_total_tokens=2048)
WORKLOADS = {w.key: w for w in (VIDUR, DISTSERVE)}


# --- the workload: lengths, arrivals, files ------------------------------------------------------


def recorded() -> dict[str, Any]:
    return dict(json.loads(RECORDED.read_text(encoding="utf-8")))


def draw_requests(w: PeerWorkload) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(arrival s, prompt tokens, output tokens) of `w`: Poisson arrivals, lengths drawn from the
    recorded quantiles of the Azure conversation trace (linear between quantiles)."""
    lengths = recorded()["lengths"]
    q = np.asarray(lengths["percent"], dtype=np.float64)
    prompt_q = np.asarray(lengths["prompt"], dtype=np.float64)
    output_q = np.asarray(lengths["output"], dtype=np.float64)
    rng = np.random.default_rng(w.seed)
    prompts: list[int] = []
    outputs: list[int] = []
    while len(prompts) < w.requests:
        n = w.requests - len(prompts)
        p = np.maximum(np.rint(np.interp(rng.random(n) * 100.0, q, prompt_q)), 1).astype(int)
        o = np.maximum(np.rint(np.interp(rng.random(n) * 100.0, q, output_q)), 1).astype(int)
        keep = (p + o) < w.max_total_tokens if w.key == "distserve" else (p + o) <= w.max_total_tokens
        prompts.extend(p[keep].tolist())
        outputs.extend(o[keep].tolist())
    gaps = rng.exponential(1.0 / w.qps, size=w.requests)
    gaps[0] = 0.0
    return np.cumsum(gaps), np.asarray(prompts[:w.requests]), np.asarray(outputs[:w.requests])


def write_trace(w: PeerWorkload, folder: Path) -> tuple[Path, Path]:
    """The workload as a kvplane trace (Mooncake JSONL: unique hash ids, so no prefix is shared)
    and as DistServe's custom workload file (one JSON list). Same requests in both."""
    arrival, prompt, output = draw_requests(w)
    trace = folder / f"{w.key}.jsonl"
    custom = folder / f"{w.key}.json"
    next_id = 0
    with trace.open("w", encoding="utf-8") as out:
        for t, p, o in zip(arrival.tolist(), prompt.tolist(), output.tolist(), strict=True):
            blocks = -(-p // 512)
            ids = list(range(next_id, next_id + blocks))
            next_id += blocks
            out.write(json.dumps({"timestamp": t * 1000.0, "input_length": p,
                                  "output_length": o, "hash_ids": ids}) + "\n")
    custom.write_text(json.dumps([
        {"start_time": t, "prompt_len": p, "output_len": o}
        for t, p, o in zip(arrival.tolist(), prompt.tolist(), output.tolist(), strict=True)
    ]), encoding="utf-8")
    return trace, custom


# --- kvplane's closest scenarios -----------------------------------------------------------------


def _s(value: float, source: str, unit: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"value": value, "source": source}
    if unit:
        out["unit"] = unit
    return out


def llama3_8b() -> dict[str, Any]:
    cfg = "config: meta-llama/Meta-Llama-3-8B config.json"
    return {
        "kind": "model", "name": "llama-3-8b",
        "description": "Llama 3 8B dense decoder, GQA 32 query / 8 KV heads, bf16 (Vidur's model).",
        "num_layers": _s(32, f"{cfg} num_hidden_layers"),
        "num_attention_heads": _s(32, f"{cfg} num_attention_heads"),
        "num_kv_heads": _s(8, f"{cfg} num_key_value_heads"),
        "head_dim": _s(128, f"{cfg} hidden_size / num_attention_heads = 4096 / 32"),
        "hidden_size": _s(4096, f"{cfg} hidden_size"),
        "intermediate_size": _s(14336, f"{cfg} intermediate_size"),
        "vocab_size": _s(128256, f"{cfg} vocab_size"),
        "total_params": _s(8030261248, "derived: 32 layers x 218,112,000 (q/o 4096x4096, k/v "
                           "4096x1024, MLP 3x4096x14336, norms) + 2 x 128,256 x 4,096 untied "
                           "embeddings + final norm"),
        "active_params": _s(8030261248, "derived: dense model (= total_params)"),
        "embedding_params": _s(1050673152, "derived: 2 x vocab_size x hidden_size (untied)"),
        "weight_dtype": "bf16", "kv_dtype": "bf16",
    }


def opt_13b() -> dict[str, Any]:
    cfg = "config: facebook/opt-13b config.json"
    return {
        "kind": "model", "name": "opt-13b",
        "description": "OPT 13B dense decoder, 40 heads (no GQA), fp16 (DistServe's model).",
        "num_layers": _s(40, f"{cfg} num_hidden_layers"),
        "num_attention_heads": _s(40, f"{cfg} num_attention_heads"),
        "num_kv_heads": _s(40, f"{cfg} num_attention_heads (multi-head attention)"),
        "head_dim": _s(128, f"{cfg} hidden_size / num_attention_heads = 5120 / 40"),
        "hidden_size": _s(5120, f"{cfg} hidden_size"),
        "intermediate_size": _s(20480, f"{cfg} ffn_dim"),
        "vocab_size": _s(50272, f"{cfg} vocab_size"),
        "total_params": _s(12853473280, "derived: 40 layers x 314,639,360 (attention 4x5120x5120, "
                           "MLP 2x5120x20480, biases, norms) + 50,272 x 5,120 tied embedding + "
                           "2,050 x 5,120 positions + final norm"),
        "active_params": _s(12853473280, "derived: dense model (= total_params)"),
        "embedding_params": _s(257392640, "derived: vocab_size x hidden_size (tied)"),
        "weight_dtype": "fp16", "kv_dtype": "fp16", "compute_dtype": "fp16",
        "activation_dtype": "fp16",
    }


def _bundled(name: str) -> dict[str, Any]:
    import yaml

    return dict(yaml.safe_load((PROFILES / f"{name}.yaml").read_text(encoding="utf-8")))


def a100_node() -> dict[str, Any]:
    """An A100 80GB SXM node (DGX A100) as a hardware profile: the device from its datasheet, the
    NIXL and network costs taken over from p5-h100-tp8 (no A100 measurement exists here)."""
    hw = _bundled("p5-h100-tp8")
    ds = "datasheet: NVIDIA A100 Tensor Core GPU (SXM4 80GB)"
    hw.update({
        "name": "a100-sxm4-80gb",
        "description": "DGX A100: 8x A100 SXM4 80 GB, NVLink 3 / NVSwitch (benchmark stand-in).",
        "device": {
            "name": "NVIDIA A100 SXM4 80GB",
            "peak_flops_bf16": _s(312e12, f"{ds}, BF16/FP16 Tensor Core 312 TFLOPS dense", "FLOP/s"),
            "hbm_bandwidth": _s(2.039e12, f"{ds}, 2,039 GB/s", "B/s"),
            "hbm_capacity": _s(80e9, f"{ds}, 80 GB HBM2e", "B"),
        },
        "node": {
            "devices_per_node": _s(8, "datasheet: NVIDIA DGX A100, 8 x A100", "devices"),
            "tp_size": _s(1, "derived: the peers' runs use TP1 (Vidur) and TP1/TP2 (DistServe)",
                          "devices"),
        },
        "tp_collective": {
            "allreduce_latency": _s(10e-6, "derived: taken from p5-h100-tp8 (NVSwitch all-reduce "
                                    "latency, same order on NVLink 3)", "s"),
            "allreduce_bandwidth": _s(150e9, "derived: half the H100 profile's 275 GB/s algorithm "
                                      "bandwidth, NVLink 3 having half NVLink 4's 900 GB/s", "B/s"),
        },
    })
    nv = dict(hw["links"]["nvlink"])
    nv["name"] = "nvlink3-nvswitch (NIXL UCX, inside one node)"
    nv["bandwidth_per_rail"] = _s(150e9, "derived: the H100 profile's 377 GB/s scaled by "
                                  "NVLink 3 / NVLink 4 (600 / 900 GB/s), rounded down", "B/s")
    hw["links"] = {**hw["links"], "nvlink": nv}
    return hw


def a100_calibration() -> dict[str, Any]:
    cal = _bundled("calib-dense-p5-h100-tp8")
    cal.update({"name": "calib-dense-a100-sxm4-80gb", "hardware": "a100-sxm4-80gb",
                "description": "dense models on the A100 stand-in: the H100 prior, unfitted, "
                               "without a per-request prefill overhead"})
    # Neither peer prices time outside the forward pass per request (Vidur skips its CPU
    # overhead model by default, DistServe's latency model is per batch): the H100 prior's
    # 0.11 s per request would put kvplane's prefill past saturation where the peers' are not.
    cal["prefill_request_overhead"] = {
        "value": 0.0, "unit": "s", "fitted_to": [],
        "source": "derived: 0, as the peers compared with model no per-request overhead"}
    return cal


def scenario_data(w: PeerWorkload, trace: Path) -> dict[str, Any]:
    """kvplane's closest scenario to `w`, as scenario data (see the module docstring)."""
    if w.key == "vidur":
        model, cluster = llama3_8b(), {"prefill_tp": 1, "decode_tp": 1}
        engine = {"max_num_seqs": 512, "max_num_batched_tokens": 512, "chunked_prefill": True,
                  "max_model_len": 16384}
    else:
        model, cluster = opt_13b(), {"prefill_tp": 2, "decode_tp": 1}
        engine = {"max_num_seqs": 256, "max_num_batched_tokens": 8192, "chunked_prefill": False,
                  "max_model_len": 2048}
    return {
        "name": f"peer_{w.key}",
        "description": f"kvplane's closest scenario to {w.peer}'s workload "
                       "(benchmarks/sim_peers.py)",
        "seed": w.seed,
        "requests": w.requests,
        "cluster": {"prefill_instances": 1, "decode_instances": 1, "colocated": True, **cluster},
        "profiles": {"model": model, "hardware": a100_node(), "calibration": a100_calibration()},
        "engine": {"block_size": 16, **engine},
        "connector": {"mode": "push", "prefix_caching": {"prefill": False, "decode": False}},
        "workload": {"kind": "trace", "path": str(trace)},
    }


def build_scenario(w: PeerWorkload, folder: Path) -> Any:
    from kvplane.sim.config import scenario_from_data

    trace, _ = write_trace(w, folder)
    return scenario_from_data(scenario_data(w, trace), file=f"<sim_peers {w.key}>")


# --- measuring kvplane ---------------------------------------------------------------------------


def kvplane_once(key: str, record: bool) -> dict[str, Any]:
    """One kvplane run of workload `key` in this process (the child's side)."""
    from kvplane.sim.runner import simulate

    w = WORKLOADS[key]
    with tempfile.TemporaryDirectory(prefix="kvplane-peers-") as tmp:
        point = build_scenario(w, Path(tmp)).points()[0]
        if not record:
            cpu = time.process_time()
            _, s = simulate(point, None, drain=False)
            return {"cpu": time.process_time() - cpu, "requests": s["finished"],
                    "sim_s": s["simulated_s"]}
        from kvplane.store import BatchingRecorder, open_store

        with open_store(f"sqlite:///{Path(tmp) / 'run.db'}") as store:
            run_id = store.create_run("sim", point.label)
            cpu = time.process_time()
            rec = BatchingRecorder(store, run_id)
            _, s = simulate(point, rec.record, drain=False)
            rec.close()
            return {"cpu": time.process_time() - cpu, "requests": s["finished"],
                    "sim_s": s["simulated_s"], "events": rec.written}


def child(cmd: list[str], cwd: Path | None = None, env: dict[str, str] | None = None
          ) -> dict[str, Any]:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout)[-2000:]
        raise SystemExit(f"sim_peers: {shlex.join(cmd[:3])} ... failed ({done.returncode}):\n{tail}")
    return dict(json.loads(lines[-1]))


def kvplane_run(key: str, record: bool) -> dict[str, Any]:
    return child([sys.executable, __file__, "--one", json.dumps([key, record])])


# --- measuring the peers -------------------------------------------------------------------------

VIDUR_ARGS = [
    "--replica_config_device", "a100",
    "--replica_config_model_name", "meta-llama/Meta-Llama-3-8B",
    "--cluster_config_num_replicas", "1",
    "--replica_config_tensor_parallel_size", "1",
    "--replica_config_num_pipeline_stages", "1",
    "--request_generator_config_type", "synthetic",
    "--synthetic_request_generator_config_num_requests", str(VIDUR.requests),
    "--length_generator_config_type", "trace",
    "--trace_request_length_generator_config_max_tokens", "16384",
    "--trace_request_length_generator_config_trace_file",
    "./data/processed_traces/splitwise_conv.csv",
    "--interval_generator_config_type", "poisson",
    "--poisson_request_interval_generator_config_qps", str(VIDUR.qps),
    "--replica_scheduler_config_type", "sarathi",
    "--sarathi_scheduler_config_batch_size_cap", "512",
    "--sarathi_scheduler_config_chunk_size", "512",
    "--random_forrest_execution_time_predictor_config_prediction_max_prefill_chunk_size", "16384",
    "--random_forrest_execution_time_predictor_config_prediction_max_batch_size", "512",
    "--random_forrest_execution_time_predictor_config_prediction_max_tokens_per_request", "16384",
]
# Vidur fits its random forests once (then cached) by a grid search: 27 settings x 10 folds per
# model, hours on a shared 2-core machine. One setting of its grid (250 trees, depth 16, split 2)
# and 2 folds instead: its predictions change a little, the simulation's work does not.
VIDUR_TRAINING = [
    "--random_forrest_execution_time_predictor_config_num_estimators", "250",
    "--random_forrest_execution_time_predictor_config_max_depth", "16",
    "--random_forrest_execution_time_predictor_config_min_samples_split", "2",
    "--random_forrest_execution_time_predictor_config_k_fold_cv_splits", "2",
]
VIDUR_OFF = ["--no-metrics_config_write_metrics", "--no-metrics_config_enable_chrome_trace",
             "--no-metrics_config_store_plots"]

# Run inside the peer's interpreter, in its checkout: time building the simulator (execution-time
# models trained or loaded from cache, requests generated), the event loop, and the output.
VIDUR_DRIVER = r"""
import atexit, json, sys, time
from vidur.config import SimulationConfig
from vidur.simulator import Simulator
from vidur.utils.random import set_seeds
record = sys.argv[1] == "on"
sys.argv = ["vidur"] + sys.argv[2:]
config = SimulationConfig.create_from_cli_args()
set_seeds(config.seed)
t0 = time.process_time()
sim = Simulator(config)
t1 = time.process_time()
sim.run()
t2 = time.process_time()
atexit.unregister(sim._write_output)
if record:
    sim._write_output()
t3 = time.process_time()
print(json.dumps({"cpu": t3 - t0, "setup": t1 - t0, "loop": t2 - t1, "output": t3 - t2,
                  "requests": config.request_generator_config.num_requests
                  if sim._scheduler.is_empty() else 0, "sim_s": sim._time}))
"""

DISTSERVE_DRIVER = r"""
import json, sys, time
import simpy
from simdistserve.benchmarks import simulate_dist as sd
record = sys.argv[1] == "on"
args = sd.parse_args(sys.argv[2:])
t0 = time.process_time()
if record:
    sd.main(args)
    n = args.N
else:
    from simdistserve.base.worker import WorkerConfig
    from simdistserve.clusters.disagg import DisaggCluster
    from simdistserve.base.scheduler import put_requests_with_interarrivals
    from simdistserve.constants import ModelTypes
    from simdistserve.estimators.memory_estimator import get_max_num_tokens
    model = ModelTypes.model_str_to_object(args.model)
    requests, arrival = sd.load_workload(args.workload, args.N, args.rate, args.cv, args.seed,
                                         args.arrival)
    env = simpy.Environment()
    cfg = WorkerConfig(model_type=model, TP=args.tp_prefill, TP_Prefill=args.tp_prefill,
                       TP_Decode=args.tp_decode, prefill_max_batch_size=10 ** 7,
                       decode_max_batch_size=10 ** 7,
                       prefill_max_tokens=get_max_num_tokens(model, args.tp_prefill,
                                                             args.pp_prefill),
                       decode_max_tokens=get_max_num_tokens(model, args.tp_decode, args.pp_decode),
                       enable_chunked_prefill=False, engine_type="distserve")
    cluster = DisaggCluster(env=env, PP_prefill=args.pp_prefill, PP_decode=args.pp_decode,
                            worker_configs=cfg)
    cluster.run()
    put_requests_with_interarrivals(env, cluster.scheduler, arrival, requests)
    env.run()
    n = len(requests)
    sim_s = env.now / 1000.0
t1 = time.process_time()
print(json.dumps({"cpu": t1 - t0, "requests": n, "sim_s": None if record else sim_s}))
"""


def distserve_args(custom: Path) -> list[str]:
    return ["--backend", "distserve", "--model", "facebook/opt-13b", "--seed", "0",
            "--N", str(DISTSERVE.requests), "--arrival", "custom", "--workload", str(custom),
            "--rate", str(DISTSERVE.qps), "--tp-prefill", "2", "--pp-prefill", "1",
            "--tp-decode", "1", "--pp-decode", "1",
            "--prefill-target", "200", "--decode-target", "100"]


def peer_env(repo: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = str(repo)
    env["WANDB_MODE"] = "disabled"
    return env


def vidur_run(python: str, repo: Path, record: bool) -> dict[str, Any]:
    cmd = [python, "-c", VIDUR_DRIVER, "on" if record else "off", *VIDUR_ARGS, *VIDUR_TRAINING,
           *([] if record else VIDUR_OFF)]
    return child(cmd, cwd=repo, env=peer_env(repo))


def distserve_run(python: str, repo: Path, custom: Path, record: bool) -> dict[str, Any]:
    cmd = [python, "-c", DISTSERVE_DRIVER, "on" if record else "off", *distserve_args(custom)]
    return child(cmd, cwd=repo, env=peer_env(repo))


# --- Vidur's attention profile stand-in ----------------------------------------------------------

_ATTN_COLUMNS = [f"time_stats.attn_{op}.{stat}"
                 for op in ("input_reshape", "kv_cache_save", "prefill", "decode", "output_reshape")
                 for stat in ("min", "max", "mean", "median", "std")]
_ATTN_KEYS = ["n_embd", "n_q_head", "n_kv_head", "block_size", "num_tensor_parallel_workers",
              "max_model_len", "batch_size", "prefill_chunk_size", "kv_cache_size", "is_prefill",
              "attention_backend"]


def vidur_attention_stand_in(path: Path) -> int:
    """Write a stand-in attention.csv for Llama-3-8B on A100 (TP1) in Vidur's format; rows.

    Per layer, in ms: prefill 0.011 + 2.0e-7 x chunk x (cached + chunk / 2) query-key pairs
    (the published file's first rows: 0.011 ms at 64 tokens and no cache, 0.064 ms at 64 tokens
    against 4,096 cached); decode 0.010 + 2.93e-6 x batch x cached tokens (4 KiB of K and V per
    token and layer read at 1.4 TB/s, 70 % of the A100's 2.0 TB/s); KV save 0.019 ms + 1e-6 per
    token. The grid is Vidur's profiling grid (chunk sizes, batch sizes), cached lengths in steps
    of 512 (prefill) and 256 (decode) up to 16,384 tokens."""
    chunks = (list(range(64, 129, 16)) + list(range(160, 1025, 32)) + list(range(1088, 4097, 64))
              + list(range(4224, 16385, 128)))
    batches = list(range(1, 129)) + list(range(136, 513, 8))
    rows: list[str] = []

    def row(batch: int, chunk: int, kv: int, save: float, prefill: float, decode: float) -> str:
        stats = []
        for v in (0.0, save, prefill, decode, 0.0):
            stats += [v, v, v, v, 0.0]
        keys = [4096, 32, 8, 16, 1, 16384, batch, chunk, kv, chunk > 0,
                "AttentionBackend.FLASHINFER"]
        return ",".join(f"{x:.6g}" if isinstance(x, float) else str(x) for x in stats + keys)

    for chunk in chunks:
        for kv in range(0, 16384 - chunk + 1, 512):
            rows.append(row(1, chunk, kv, 0.019 + 1e-6 * chunk,
                            0.011 + 2.0e-7 * chunk * (kv + chunk / 2), 0.0))
    for batch in batches:
        for kv in range(256, 16385, 256):
            rows.append(row(batch, 0, kv, 0.019 + 1e-6 * batch, 0.0,
                            0.010 + 2.93e-6 * batch * kv))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(",".join(_ATTN_COLUMNS + _ATTN_KEYS) + "\n" + "\n".join(rows) + "\n",
                    encoding="utf-8")
    return len(rows)


VIDUR_ATTENTION = Path("data/profiling/compute/a100/meta-llama/Meta-Llama-3-8B/attention.csv")


# --- the report ----------------------------------------------------------------------------------


def best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return min(runs, key=lambda r: r["cpu"] / max(r["requests"], 1))


def rate(r: dict[str, Any]) -> float:
    return float(r["requests"]) / r["cpu"] if r["cpu"] > 0 else math.inf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3, help="runs per measurement; the best counts")
    ap.add_argument("--only", choices=sorted(WORKLOADS), help="one workload only")
    ap.add_argument("--vidur-python")
    ap.add_argument("--vidur-repo", type=Path)
    ap.add_argument("--vidur-stand-in", action="store_true",
                    help="write the stand-in attention profile if the checkout lacks it")
    ap.add_argument("--distserve-python")
    ap.add_argument("--distserve-repo", type=Path)
    ap.add_argument("--save", action="store_true", help="record the peers' figures of this run")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        key, record = json.loads(a.one)
        print(json.dumps(kvplane_once(key, bool(record))))
        return
    for name in ("vidur", "distserve"):
        if bool(getattr(a, f"{name}_python")) != bool(getattr(a, f"{name}_repo")):
            ap.error(f"--{name}-python and --{name}-repo go together")
    keys = [a.only] if a.only else list(WORKLOADS)
    rec = recorded()
    measured: dict[str, Any] = {}
    stand_in = False
    if a.vidur_repo is not None and "vidur" in keys:
        attn = a.vidur_repo / VIDUR_ATTENTION
        head = attn.read_bytes()[:200] if attn.exists() else b""
        if not head or head.startswith(b"version https://git-lfs"):
            if not a.vidur_stand_in:
                ap.error(f"{attn} is missing or a Git LFS pointer: fetch it (git lfs pull) or "
                         "pass --vidur-stand-in")
            print(f"Vidur: {attn} absent; wrote a stand-in "
                  f"({vidur_attention_stand_in(attn)} rows, see vidur_attention_stand_in)")
        stand_in = _is_stand_in(attn)
    print(f"requests per CPU-second, best of {a.repeat}, each run in a fresh process "
          "(simulation only: start-up and imports not counted)")
    rows: list[tuple[str, str, dict[str, Any], dict[str, Any] | None, str]] = []
    with tempfile.TemporaryDirectory(prefix="kvplane-peers-") as tmp:
        for key in keys:
            w = WORKLOADS[key]
            _, custom = write_trace(w, Path(tmp))
            peer: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
            mine: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
            has_peer = bool(getattr(a, f"{key}_python"))
            if key == "vidur" and has_peer:
                vidur_run(a.vidur_python, a.vidur_repo, record=False)  # warms Vidur's model cache
            for _ in range(a.repeat):
                for record in (False, True):
                    side = "on" if record else "off"
                    mine[side].append(kvplane_run(key, record))
                    if key == "vidur" and has_peer:
                        peer[side].append(vidur_run(a.vidur_python, a.vidur_repo, record))
                    elif key == "distserve" and has_peer:
                        peer[side].append(distserve_run(a.distserve_python, a.distserve_repo,
                                                        custom, record))
            for side in ("off", "on"):
                got = best(peer[side]) if peer[side] else None
                origin = "this run"
                if got is None and key in rec.get("peers", {}):
                    got = rec["peers"][key][side]
                    origin = f"recorded {rec['peers'][key]['date']}"
                rows.append((key, side, best(mine[side]), got, origin))
                if peer[side]:
                    measured.setdefault(key, {})[side] = best(peer[side])
    print(f"  {'workload':<10} {'recording':<9} {'kvplane req/CPU-s':>17} {'peer req/CPU-s':>14} "
          f"{'ratio':>7}  peer figure")
    for key, side, m, p, origin in rows:
        ratio = f"{rate(m) / rate(p):6.2f}x" if p else "    -  "
        pr = f"{rate(p):14.1f}" if p else f"{'-':>14}"
        print(f"  {key:<10} {side:<9} {rate(m):17.1f} {pr} {ratio}  {origin if p else 'none'}")
    for key, side, m, p, _ in rows:
        if p is None:
            continue
        r = rate(m) / rate(p)
        line = f"  goal >= {GOAL:.0f}x, {key} recording {side}: {r:.2f}x ({_verdict(r)})"
        if "loop" in p:  # Vidur: also without its per-run start-up
            r2 = rate(m) * (p["loop"] + p["output"]) / p["requests"]
            line += f", {r2:.2f}x without Vidur's start-up ({_verdict(r2)})"
        print(line)
    for key, side, m, p, _ in rows:
        extra = [f"kvplane simulated {m['sim_s']:.0f} s"]
        if p and p.get("sim_s"):
            extra.append(f"the peer {p['sim_s']:.0f} s")
        if p and "loop" in p:
            run = p["loop"] + p["output"]
            extra.append(f"Vidur's CPU: build {p['setup']:.2f} s (loading its cached "
                         f"predictions), event loop {p['loop']:.2f} s, output {p['output']:.2f} s; "
                         f"against Vidur without its build {rate(m) / (p['requests'] / run):.2f}x")
        if "events" in m:
            extra.append(f"kvplane recorded {m['events']} events")
        print(f"  {key} {side}: " + "; ".join(extra))
    shown = {k for k, *_ in rows}
    for key in sorted(shown):
        if key in rec.get("peers", {}) and key not in measured:
            info = rec["peers"][key]
            print(f"  recorded {key}: {info['date']}, `{info['command']}`; {info.get('note', '')}")
    if stand_in:
        print("  Vidur ran with the stand-in attention profile (its own file is a Git LFS object "
              "this checkout lacks); its MLP and network profiles are its own.")
    if a.save and measured:
        cmd = "python benchmarks/sim_peers.py " + shlex.join(_placeholders(sys.argv[1:]))
        for key, sides in measured.items():
            entry = dict(rec.setdefault("peers", {}).get(key, {}))
            entry.update(sides)
            entry["date"] = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
            entry["command"] = cmd
            if key == "vidur":
                entry["note"] = ("Vidur with the stand-in attention profile" if stand_in
                                 else "Vidur with its own profiles")
            rec["peers"][key] = entry
        RECORDED.write_text(dump(rec), encoding="utf-8")
        print(f"  saved the peers' figures to {RECORDED.relative_to(REPO)}")


def _verdict(ratio: float) -> str:
    return "met" if ratio >= GOAL else "not met"


def _placeholders(argv: list[str]) -> list[str]:
    """The command line with this machine's paths of the peers replaced by names."""
    out = list(argv)
    for i, arg in enumerate(argv[:-1]):
        if arg.endswith(("-python", "-repo")) and arg.startswith(("--vidur", "--distserve")):
            out[i + 1] = arg[2:].upper().replace("-", "_")
    return out


def dump(rec: dict[str, Any]) -> str:
    """JSON with one line per list of numbers (the length quantiles)."""
    text = json.dumps(rec, indent=1)
    return re.sub(r"\[\s+([-0-9.,\s]+?)\s+\]",
                  lambda m: "[" + ", ".join(m.group(1).split()).replace(",,", ",") + "]",
                  text) + "\n"


def _is_stand_in(path: Path) -> bool:
    """Whether `path` is the stand-in written here (its decode column starts like ours)."""
    try:
        with path.open(encoding="utf-8") as f:
            f.readline()
            first = f.readline()
    except OSError:
        return False
    return first.startswith("0,0,0,0,0,0.019") and "AttentionBackend.FLASHINFER" in first


if __name__ == "__main__":
    main()
