"""Live on a GPU is the ground truth: calibrate from one recorded workload, predict another.

The GPU counterpart of tests/live/test_live_prediction.py, on a dedicated H200 instead of the
shared 2-core CPU machine, with a model of a size users serve:

1. a Llama-3.1-8B-shaped model (KVPLANE_GPU_MODEL=dense8b, the default; `dense14b`: a
   Qwen2.5-14B-shaped one, tests/gpu/gpu_prediction_dense14b.yaml; `dense3b`: Llama-3.2-3B;
   `qwen3_8b`: Qwen3-8B; `moe30b`: Qwen3-30B-A3B, a mixture of experts) with random weights
   (`--load-format dummy`: the matmuls and the KV bytes of the real model; the vocabulary is
   the test tokenizer's 1,024, so nothing is downloaded), one prefill and one decode vLLM
   server (CUDA, bfloat16, block size 16, prefix caching off; vLLM's default compilation and
   CUDA graphs, as users run it, or eager with KVPLANE_GPU_EAGER=1, as sessions 1-3 ran), both
   on the one GPU the machine lends, KvplaneConnector over NIXL, `kvplane router` in
   bidirectional mode;
2. workloads A (192 single pull requests, prompts 512-3,072 tokens, 16 output tokens, one every
   0.5 s), B (48 conversations of 4 turns, prompts 1,024-2,632 tokens, turns 2-4 reading
   decode's retained KV, 24 output tokens, a conversation every 2 s) and C (192 single
   requests of 768-2,304 tokens and 32 output tokens in bursts of 8 at 16 per second: queued
   prefills, growing decode batches) recorded in alternating blocks, each kept as a run of its
   own (runs.db, copied to the report folder);
3. the calibration fitted from A's events alone (`kvplane.sim.live_calibration.fit_live`; with
   CUDA graphs also the graph step's fixed part, the host's launch floor per layer and the
   empty step), and B's and C's twins simulated under it (10 seeds), TTFT percentiles
   compared with the router's. B must meet the target; C too, except on one shared GPU when
   C's prefills ran at least 1.5x as long as A's of the same lengths (decode running beside
   them, which the twin, a device per engine, does not price): then an expected failure.

Target (the issue's, for the CPU run): p50 within 10 %, p90 within 20 %. The scenario the runs
ran under is tests/gpu/gpu_prediction.yaml. Results: $KVPLANE_GPU_REPORT/gpu_prediction.json
and runs.db (docs/measurements/gpu-prediction-h200/). Not part of `make test` (the file name
does not match test_*.py); `scripts/gpu_live.sh` runs it with GPU_SUITES=gpu_prediction.py.
The kept runs are re-predicted on any machine by tests/sim/test_gpu_prediction_replay.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from kvplane.sim.config import load_scenario

try:  # the GPU suite's layout (scripts/gpu_live.sh): this file's servers helper, then ours
    import kvplane_live_servers as _servers
except ImportError:
    import importlib.util
    import sys

    _path = Path(__file__).resolve().parent.parent / "live" / "servers.py"
    _spec = importlib.util.spec_from_file_location("kvplane_live_servers", _path)
    assert _spec is not None and _spec.loader is not None
    sys.modules["kvplane_live_servers"] = _servers = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_servers)

lw = _servers.helper("live_workloads")

pytestmark = [pytest.mark.live, pytest.mark.timeout(900)]

# KVPLANE_GPU_MODEL picks the model: its config.json fields over the tiny model's, and the
# scenario stating its profile
MODELS: dict[str, tuple[str, dict[str, object]]] = {
    "dense8b": ("gpu_prediction.yaml", {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128}),
    "dense14b": ("gpu_prediction_dense14b.yaml", {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 5120,
        "intermediate_size": 13824, "num_hidden_layers": 48, "num_attention_heads": 40,
        "num_key_value_heads": 8, "head_dim": 128, "use_sliding_window": False}),
    "dense3b": ("gpu_prediction_dense3b.yaml", {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 3072,
        "intermediate_size": 8192, "num_hidden_layers": 28, "num_attention_heads": 24,
        "num_key_value_heads": 8, "head_dim": 128}),
    "qwen3_8b": ("gpu_prediction_qwen3_8b.yaml", {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
        "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "attention_bias": False,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6}),
    "moe30b": ("gpu_prediction_moe30b.yaml", {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "attention_bias": False,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6}),
}
MODEL = os.environ.get("KVPLANE_GPU_MODEL", "dense8b")
SCENARIO = Path(__file__).with_name(MODELS[MODEL][0])
SEEDS = 10
TARGET = {0.5: 0.10, 0.9: 0.20}
KV_BYTES = 8 << 30  # per server: two engines profiling one GPU count each other's memory
# eager (no torch.compile, no CUDA graphs) starts in seconds, but a decode step is then bound by
# kernel launches; users run vLLM's default (compiled, CUDA graphs), so that is the default here
EAGER = os.environ.get("KVPLANE_GPU_EAGER", "0") == "1"
MODE = "eager" if EAGER else "compiled, CUDA graphs"


def _gpus() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30,
                             check=False)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


# with two GPUs each engine gets its own, as users deploy (and as the simulator prices); with
# one (the lent machine), both share it and CUDA time-slices their kernels
SHARED_GPU = _gpus() < 2

WORKLOAD_A = lw.Workload("A", "pull", 0, (512, 1024, 1536, 2048, 2560, 3072) * 32,
                         max_tokens=16, interval=0.5)
WORKLOAD_B = lw.Workload("B", "bidirectional", 48, (), first=1024, turns=4, new_tokens=512,
                         max_tokens=24, interval=2.0, think=0.1)
# bursts: 8 requests 62.5 ms apart (16 per second), so prefills queue and decode batches grow
WORKLOAD_C = lw.Workload("C", "pull", 0, (768, 1280, 1792, 2304) * 48, max_tokens=32,
                         interval=0.0625)
PREDICTED = (WORKLOAD_B, WORKLOAD_C)


def model_dir(root: Path) -> Path:
    """The tiny model's tokenizer with MODEL's shapes in config.json, no weights."""
    tiny = _servers.helper("tiny_model").tiny_model_dir()
    out = root / MODEL
    if out.exists():
        return out
    out.mkdir(parents=True)
    for f in tiny.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "config.json":
            shutil.copy(f, out / f.name)
    cfg = json.loads((tiny / "config.json").read_text())
    cfg.update({**MODELS[MODEL][1], "max_position_embeddings": 8192,
                "tie_word_embeddings": False, "torch_dtype": "bfloat16"})
    cfg.pop("dtype", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


def _set(cmd: list[str], flag: str, value: str) -> None:
    if flag in cmd:
        cmd[cmd.index(flag) + 1] = value
    else:
        cmd += [flag, value]


@dataclasses.dataclass
class GpuServer(_servers.VllmServer):  # type: ignore[misc]
    """A server of the scenario's engine settings: bfloat16, random weights, 8 GiB of KV."""

    def command(self) -> list[str]:
        cmd = list(super().command())
        for flag, value in (("--dtype", "bfloat16"), ("--max-model-len", "4096"),
                            ("--max-num-seqs", "16"), ("--block-size", "16"),
                            ("--max-num-batched-tokens", "4096"), ("--load-format", "dummy"),
                            ("--gpu-memory-utilization", "0.4"),
                            ("--kv-cache-memory-bytes", str(KV_BYTES))):
            _set(cmd, flag, value)
        if not EAGER and "--enforce-eager" in cmd:
            cmd.remove("--enforce-eager")
        return cmd

    def start(self) -> None:
        self.env = {**self.env, "VLLM_USE_FLASHINFER_SAMPLER": "0"}
        if not SHARED_GPU:
            self.env["CUDA_VISIBLE_DEVICES"] = "1" if self.name == "decode" else "0"
        super().start()


def verdict(err: float, p: float) -> str:
    return "pass" if abs(err) <= TARGET[p] else "miss"


def test_gpu_calibrated_on_one_live_run_predicts_another() -> None:
    from kvplane.sim.calibration import apply_calibration, calibration_for
    from kvplane.sim.live_calibration import describe, fit_live, predict
    from kvplane.store import open_store

    scenario = load_scenario(SCENARIO)
    # what the engines ran: decode batches up to 2 x max_num_seqs replayed from CUDA graphs
    # (vLLM 0.25.1's capture sizes), or none (eager); kept with the runs, read by the fit
    graphs = 0 if EAGER else min(2 * scenario.engine.max_num_seqs, 512)
    scenario = scenario.model_copy(update={"engine": scenario.engine.model_copy(
        update={"cuda_graph_max_batch": graphs})})
    model = model_dir(_servers.log_dir("gpu-prediction-model"))
    t0 = time.monotonic()
    cluster = lw.start("gpu-prediction", model=model, server=GpuServer)
    started = time.monotonic() - t0
    print(f"servers ready in {started:.0f} s ({MODE})")
    runs_db = cluster.logs / "runs.db"
    runs = f"sqlite:///{runs_db}"
    sampler = lw.HostSampler()
    try:
        lw.warm_up(cluster, [WORKLOAD_A, *PREDICTED])
        ids = lw.interleave(cluster.router.use("bidirectional"),
                            [WORKLOAD_A, *PREDICTED], lw.BLOCKS, sampler)
        lw.settle(cluster.db, cluster.run, [r for got in ids.values() for r in got])
        for tag, got in ids.items():
            lw.keep_run(cluster.db, cluster.run, got, runs, tag,
                        scenario.model_dump(mode="json"))
    finally:
        sampler.stop()
        lw.stop(cluster)
    out = Path(os.environ.get("KVPLANE_GPU_REPORT", str(cluster.logs)))
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(runs_db, out / "runs.db")
    with open_store(runs) as store:  # fitted from A alone
        fit = fit_live(store, "A", scenario.model, scenario.hardware,
                       calibration_for(scenario), block_size=scenario.engine.block_size,
                       link=scenario.link, graph_batch=graphs)
    predicted = apply_calibration(scenario, fit.calibration)
    with open_store(runs) as store:
        own = predict(store, "A", predicted, SEEDS)
        res = {w.name: predict(store, w.name, predicted, SEEDS) for w in PREDICTED}
    verdicts = {(w, p): verdict(r.error(p), p) for w, r in res.items() for p in TARGET}
    tags = ["A", *res]
    report = [*describe(fit), *own.lines(), *(ln for r in res.values() for ln in r.lines()),
              "host during the blocks: " + "; ".join(sampler.text(w) for w in tags),
              f"execution: {MODE}; servers ready in {started:.0f} s",
              "verdict: " + ", ".join(f"{w} p{int(p * 100)} {v}"
                                      for (w, p), v in verdicts.items())]
    print("\n" + "\n".join(report))
    (out / "gpu_prediction.json").write_text(json.dumps({
        "calibration": fit.calibration.model_dump(mode="json"),
        "measured_a": fit.measured,
        "a": {"live": own.live, "error_p50": own.error(0.5), "error_p90": own.error(0.9)},
        **{w.lower(): {"live": r.live, "predicted": r.predicted, "error_p50": r.error(0.5),
                       "error_p90": r.error(0.9), "interval_p50": r.live_interval(0.5),
                       "interval_p90": r.live_interval(0.9), "reads_live": r.reads_live,
                       "reads_twin": r.reads_twin} for w, r in res.items()},
        "host": {w: sampler.summary(w) for w in tags},
        "execution": MODE, "servers_ready_s": started,
        "verdict": {f"{w} {p}": v for (w, p), v in verdicts.items()}, "report": report},
        indent=1))
    for w in PREDICTED:
        assert len(res[w.name].live) == len(ids[w.name]), report
    later_turns = WORKLOAD_B.conversations * (WORKLOAD_B.turns - 1)
    assert res["B"].reads_live >= later_turns // 2, report
    assert res["B"].reads_twin >= later_turns // 2, report
    assert all(v == "pass" for (w, _), v in verdicts.items() if w == "B"), report
    if SHARED_GPU and any(v != "pass" for (w, _), v in verdicts.items() if w == "C"):
        # C's bursts keep decode busy while prefills run; on one shared GPU that slows them,
        # which the twin (a device per engine) does not price: a miss, if that is its cause
        slower = shared_gpu_slowdown(runs, "C")
        why = (f"C misses and its prefills ran only {slower:.2f}x as long as A's of the same "
               "lengths: not the decode sharing their GPU")
        assert slower >= SHARED_SLOWER, (why, report)
        pytest.xfail(f"C: both engines share the one GPU; C's one-step prefills took {slower:.2f}x "
                     "as long as A's of the same lengths (decode running beside them, mostly "
                     "idle in A); the simulator gives each engine its own device")
    assert all(v == "pass" for v in verdicts.values()), report


# C's prefills at least this much slower than A's of the same lengths: the shared GPU's doing
# (C predicted at 1.36x in session 2; missed at 1.58-4.6x in sessions 4-7)
SHARED_SLOWER = 1.5


def shared_gpu_slowdown(runs: str, run: str) -> float:
    """How much longer `run`'s one-step prefills took than A's of the same lengths."""
    from kvplane.sim.live_calibration import prefill_slowdown
    from kvplane.store import open_store

    with open_store(runs) as store:
        got = prefill_slowdown(store, run, "A")
    return float("nan") if got is None else got
