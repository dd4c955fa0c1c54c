"""What one prefill forward costs on a GPU, by prompt length, against what the simulator prices.

The question it answers (docs/validation.md, "The 2k figures"): is a short prompt's forward
slower per FLOP than a long one's, i.e. is there a large fixed cost per forward that the
simulator's compute model (step overhead + FLOPs / (peak x efficiency)) leaves out?

On a GPU machine with vLLM (the lent H200, after `scripts/gpu_live.sh run` installed it):
    PYTHONPATH=/tmp/kvplane-site python3 benchmarks/gpu_forward.py --out OUT.json
It builds a Qwen3-32B-shaped model (config.json from its public config, the test tokenizer,
random weights: `load_format="dummy"`), starts vLLM's engine in this process (compiled, CUDA
graphs, TP1, prefix caching off, `--max-num-batched-tokens` 8192 as vLLM's API server picks on
this GPU), and times `generate` of one prompt of N random tokens with one output token, `--reps`
times per length after one warm-up. The median is one request's whole engine time: schedule,
forward (ceil(N / 8192) chunked steps), sampling.

Here (no GPU needed): `python benchmarks/gpu_forward.py --compare OUT.json` prints the measured
medians beside the simulator's price of the same prefill (the model profile
scenarios/profiles/qwen3-32b.yaml, one H200 at TP1, the bundled H200 calibration's compute
efficiency and step overhead) and the ratio of the two.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = (512, 1024, 2048, 4096, 8192, 16384, 24576)
CHUNK = 8192
# Qwen/Qwen3-32B config.json (public), the fields vLLM reads
CONFIG = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 5120,
          "intermediate_size": 25600, "num_hidden_layers": 64, "num_attention_heads": 64,
          "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
          "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
          "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
          "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2}


def model_dir(root: Path) -> Path:
    sys.path.insert(0, str(ROOT / "tests" / "live"))
    from tiny_model import tiny_model_dir  # the test tokenizer (1,024 tokens)

    tiny = tiny_model_dir(root / "tiny")
    out = root / "qwen3-32b-shape"
    out.mkdir(parents=True, exist_ok=True)
    for f in tiny.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "config.json":
            shutil.copy(f, out / f.name)
    (out / "config.json").write_text(json.dumps(CONFIG, indent=1))
    return out


def measure(lengths: list[int], reps: int) -> dict[str, object]:
    from vllm import LLM, SamplingParams

    root = Path(tempfile.mkdtemp(prefix="kvplane-forward-"))
    t0 = time.perf_counter()
    llm = LLM(model=str(model_dir(root)), load_format="dummy", dtype="bfloat16",
              max_model_len=max(lengths) + 64, max_num_batched_tokens=CHUNK, max_num_seqs=4,
              enable_prefix_caching=False, gpu_memory_utilization=0.85, seed=0)
    ready = time.perf_counter() - t0
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    rng = random.Random(0)
    out: dict[str, list[float]] = {}
    for n in lengths:
        times = []
        for i in range(reps + 1):
            prompt = {"prompt_token_ids": [rng.randrange(10, 1000) for _ in range(n)]}
            t = time.perf_counter()
            llm.generate([prompt], sp, use_tqdm=False)
            if i:  # the first is a warm-up
                times.append(time.perf_counter() - t)
        out[str(n)] = times
        print(f"{n:6d} tokens: median {statistics.median(times) * 1e3:8.1f} ms "
              f"(min {min(times) * 1e3:.1f}, max {max(times) * 1e3:.1f}, {reps} reps)",
              flush=True)
    import torch
    import vllm

    return {"seconds": out, "engine_ready_s": ready, "chunk": CHUNK,
            "gpu": torch.cuda.get_device_name(0), "vllm": vllm.__version__,
            "model": "Qwen3-32B shape, dummy weights, bfloat16, TP1, compiled + CUDA graphs"}


def compare(path: Path) -> None:
    from kvplane.sim.calibration import bundled_calibration
    from kvplane.sim.config import load_scenario
    from kvplane.sim.costs import ComputeCost
    from kvplane.sim.profiles import load_profile

    got = json.loads(path.read_text())
    hw = load_scenario(ROOT / "tests" / "gpu" / "gpu_prediction.yaml").hardware  # H200, TP1
    model = load_profile("qwen3-32b")
    tp8 = load_profile("p5en-h200-tp8")
    cal = bundled_calibration(model, tp8)
    cost = ComputeCost(model, hw, None, 16, cal)
    print(f"{got['model']} on {got['gpu']}, vLLM {got['vllm']}, chunk {got['chunk']}")
    print(f"simulator: {cal.name} (compute efficiency {cal.compute_utilization.value:.3f}, "
          f"step overhead {cal.step_overhead.value * 1e3:.2f} ms), one H200 at TP1")
    print("| prompt | measured median | simulator | measured / simulator | "
          "measured TFLOP/s |")
    print("|---:|---:|---:|---:|---:|")
    for n, times in got["seconds"].items():
        n = int(n)
        med = statistics.median(times)
        priced = sum(cost.prefill_time(min(CHUNK, n - done), done)
                     for done in range(0, n, CHUNK))
        flops = sum(cost.flops(min(CHUNK, n - d), cost._pairs(min(CHUNK, n - d), d), 1)
                    for d in range(0, n, CHUNK))
        print(f"| {n:,} | {med * 1e3:.1f} ms | {priced * 1e3:.1f} ms | {med / priced:.2f} | "
              f"{flops / med / 1e12:.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="measure on this GPU; write the times here")
    ap.add_argument("--compare", type=Path, help="print a measured file against the simulator")
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    if a.out:
        res = measure([int(x) for x in a.lengths.split(",")], a.reps)
        a.out.write_text(json.dumps(res, indent=1))
    if a.compare:
        compare(a.compare)
    if not (a.out or a.compare):
        ap.error("give --out (measure, on a GPU) or --compare (print against the simulator)")


if __name__ == "__main__":
    main()
