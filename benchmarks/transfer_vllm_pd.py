"""Fragmented KV transfers inside real vLLM P/D: per-run descriptors vs staging, side by side.

One prefill and one decode vLLM server with KvplaneConnector per transfer method (`--variants`:
`direct` forces one NIXL descriptor per merged run, `staged` forces the gather / one WRITE per
slot / scatter path, `ipc` the CUDA IPC copy (live/ipc.py: one kernel from one server's cache
into the other's, GPU only), `auto` lets the transport choose per transfer from its estimate
(IPC included where both servers share a host and GPU); set
through the servers' `KVPLANE_STAGING`, docs/deploy.md), plus a plain server (no connector) for
the greedy reference, all on one device, with `kvplane router` in front of each pair. The model
has a real model's per-layer KV geometry (default: Llama-3-8B's, 32 layers x 8 KV heads x 128,
bf16 on a GPU: 128 KiB of KV per token) with small, random weights built here (no download):
what a transfer moves is the same as for the real model, prefill is cheaper.

What is done, in this order:
- fresh pool: an uncounted warm-up exchange per pair (NIXL handshakes, first kernels), then one
  pull and one push exchange of `--tokens` tokens while both pools still hand out blocks in
  ascending order (the transfer is one or a few runs: the contiguous reference);
- fragmented pool: before every exchange, each server of the pair gets a burst of concurrent
  requests of random lengths (`--burst` times its KV pool in tokens, few output tokens): vLLM
  frees each request's blocks last-first, so the next long prompt gets blocks in descending
  runs interleaved between requests, on prefill and decode independently. Then pull, push and
  (`bidirectional`) a two-turn conversation whose second turn makes prefill READ decode's
  retained KV (D->P; prefill's own copy is evicted by the burst between the turns);
  `--repeats` times, the variants interleaved, the same prompts for every variant.

What is reported (JSON with `--json`, a table on stdout): per phase, mode, direction and variant
the KV transfer time from the recorded events (TransferPlanned to TransferCompleted on the
instance that moved the bytes, as tests/gpu/gpu_live.py computes it), the transfer thread's own
post-to-done time and method (the servers run with `KVPLANE_LOG_TRANSFERS=1`), the descriptors
per-run posting needs and the mean run length in blocks (from the planned block ids), the
client's TTFT through the router (streamed), and whether the tokens equal the plain server's and
each other's. Ratios against `direct` are within one run.

    python benchmarks/transfer_vllm_pd.py                      # on a GPU: Llama-3-8B shape, 16k
    python benchmarks/transfer_vllm_pd.py --device cpu --layers 4 --kv-heads 2 --head-dim 64 \
        --hidden 256 --heads 4 --tokens 1000 --variants direct staged --repeats 1  # CPU check

Timings on a shared CPU say little: compare variants within one run. Nothing here asserts a
duration; tokens that differ between variants are an error (exit status 1).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import itertools
import json
import os
import random
import re
import statistics
import sys
import tarfile
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
HANDLE_KEY = "transfer-vllm-pd-bench-key"
LOG_LINE = re.compile(r"kvplane transfer (?P<xfer>\S+) (?P<attempt>\d+) (?P<kind>\w+) "
                      r"(?P<ok>ok|failed): (?P<bytes>\d+) bytes, (?P<method>\w+), "
                      r"(?P<desc>\d+) descriptors, (?P<ms>[\d.]+) ms")


import live_pd  # a sibling script: its directory is on sys.path

servers = live_pd._load("servers")


# ---- the model ----------------------------------------------------------------------------------


def model_dir(args: argparse.Namespace) -> Path:
    """A Llama with the KV geometry asked for and random weights, built once per machine
    (tests/live/tiny_model.py's cache and tokenizer)."""
    tiny = servers.helper("tiny_model")
    shape = (f"l{args.layers}-kv{args.kv_heads}x{args.head_dim}-q{args.heads}-h{args.hidden}"
             f"-i{args.intermediate}-{args.dtype}")
    return tiny.built(f"kvplane-kvshape-llama-{shape}-v1",
                      lambda out: _build_model(out, args, tiny.tiny_model_dir()))


def _build_model(out: Path, args: argparse.Namespace, tokenizer_dir: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, LlamaConfig

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.save_pretrained(out)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    h, d, q, kv, inter = args.hidden, args.head_dim, args.heads, args.kv_heads, args.intermediate
    vocab = len(tok)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=h, intermediate_size=inter,
        num_hidden_layers=args.layers, num_attention_heads=q, num_key_value_heads=kv,
        head_dim=d, max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=500000.0,
        tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        torch_dtype=args.dtype)
    config.save_pretrained(out)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(4321)

    def rand(rows: int, cols: int, gain: float) -> Any:
        # std gain/sqrt(fan-in): activations keep their scale through 32 layers, and with a
        # gain above 1 greedy output still depends on the whole prompt (not " 1 1 1")
        w = torch.randn(rows, cols, generator=gen, device=device) * (gain / cols ** 0.5)
        return w.to(dtype).cpu().contiguous()

    weights = {"model.embed_tokens.weight": rand(vocab, h, h ** 0.5),
               "model.norm.weight": torch.ones(h, dtype=dtype),
               "lm_head.weight": rand(vocab, h, 8.0)}
    for i in range(args.layers):
        p = f"model.layers.{i}."
        weights |= {p + "self_attn.q_proj.weight": rand(q * d, h, 2.0),
                    p + "self_attn.k_proj.weight": rand(kv * d, h, 2.0),
                    p + "self_attn.v_proj.weight": rand(kv * d, h, 1.0),
                    p + "self_attn.o_proj.weight": rand(h, q * d, 1.0),
                    p + "mlp.gate_proj.weight": rand(inter, h, 1.0),
                    p + "mlp.up_proj.weight": rand(inter, h, 1.0),
                    p + "mlp.down_proj.weight": rand(h, inter, 1.0),
                    p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
                    p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype)}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "kvplane_recipe.json").write_text(json.dumps({
        "layers": args.layers, "kv_heads": kv, "head_dim": d, "heads": q, "hidden": h,
        "intermediate": inter, "dtype": args.dtype, "seed": 4321}))


# ---- servers and routers -------------------------------------------------------------------------


@dataclass
class BenchServer(servers.VllmServer):  # type: ignore[misc,name-defined]
    """servers.VllmServer with this benchmark's flags: vLLM's defaults where they matter
    (prefix caching on, chunked prefill, block size 16 on a GPU), a long context, a fixed KV
    pool."""

    gpu: bool = False
    dtype: str = "float32"
    block_size: int = 16
    max_model_len: int = 17408
    kv_bytes: int = 8 << 30  # GPU
    num_blocks: int = 0  # CPU: --num-gpu-blocks-override

    def command(self) -> list[str]:
        cmd = list(super().command())
        for flag, value in (("--dtype", self.dtype), ("--max-model-len", str(self.max_model_len)),
                            ("--max-num-seqs", "64"), ("--block-size", str(self.block_size))):
            cmd[cmd.index(flag) + 1] = value
        if self.gpu:
            # a fixed KV pool: engines starting together on one GPU count each other's memory
            cmd += ["--gpu-memory-utilization", "0.2", "--kv-cache-memory-bytes",
                    str(self.kv_bytes)]
        elif self.num_blocks:
            cmd += ["--num-gpu-blocks-override", str(self.num_blocks)]
        return cmd

    def pool_tokens(self) -> int:
        found = re.findall(r"KV cache size: ([\d,]+) tokens",
                           self.log_path.read_text(errors="replace"))
        if not found:
            raise RuntimeError(f"{self.name}'s log does not say its KV cache size")
        return int(found[-1].replace(",", ""))


@dataclass
class Pair:
    variant: str
    prefill: BenchServer
    decode: BenchServer
    router: live_pd.Router


# ---- the workload --------------------------------------------------------------------------------


@dataclass
class Exchange:
    variant: str
    phase: str  # "fresh" or "fragmented"
    mode: str  # pull, push, bidirectional
    rep: int
    turn: int
    xfer: str
    prompt_tokens: int
    ttft_ms: float
    tokens: list[int]
    prompt: list[int] = field(default_factory=list, repr=False)
    reference: list[int] | None = None
    # the plain server's answer when asked again (its prefix cache serves all but the last
    # block: the prompt's KV read back, the tail computed, as decode does after a transfer)
    reference_cached: list[int] | None = None
    transfers: list[dict[str, Any]] = field(default_factory=list)

    def record(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if k != "prompt"}


def burst(server: BenchServer, pool_tokens: int, factor: float, seed: int,
          longest: int) -> None:
    """Concurrent requests of random lengths, `factor` x the pool in prompt tokens, 1-8 output
    tokens each: every block of the pool is handed out and freed again, in vLLM's order."""
    rng = random.Random(seed)
    lengths: list[int] = []
    while sum(lengths) < factor * pool_tokens:
        lengths.append(rng.randrange(64, longest))
    prompts = [[rng.randrange(10, 1000) for _ in range(n)] for n in lengths]
    with cf.ThreadPoolExecutor(16) as pool:
        for f in [pool.submit(servers.complete, server.url, p, rng.randrange(1, 9))
                  for p in prompts]:
            f.result()


def fragment(pair: Pair, pools: dict[str, int], args: argparse.Namespace, seed: int) -> None:
    longest = min(4096, args.tokens)
    with cf.ThreadPoolExecutor(2) as pool:
        for f in [pool.submit(burst, s, pools[s.name], args.burst, seed + i, longest)
                  for i, s in enumerate((pair.prefill, pair.decode))]:
            f.result()


def exchange(pair: Pair, phase: str, mode: str, rep: int, prompt: list[int],
             args: argparse.Namespace, pools: dict[str, int], seed: int) -> list[Exchange]:
    """One request through the pair's router (bidirectional: two turns of one conversation,
    with a burst between them)."""
    url = pair.router.url
    if mode != "bidirectional":
        ids, ttft, _, xfer = live_pd.stream_one(url, prompt, args.max_tokens, None)
        return [Exchange(pair.variant, phase, mode, rep, 1, xfer, len(prompt), ttft * 1e3, ids,
                         prompt)]
    conv = f"conv-{pair.variant}-{rep}-{uuid.uuid4().hex[:6]}"
    ids, ttft, _, xfer = live_pd.stream_one(url, prompt, args.max_tokens, conv)
    out = [Exchange(pair.variant, phase, mode, rep, 1, xfer, len(prompt), ttft * 1e3, ids,
                    prompt)]
    fragment(pair, pools, args, seed + 7)  # evicts prefill's own copy of turn 1
    second = prompt + ids + live_pd.prompt(seed + 11, 48)
    ids2, ttft2, _, xfer2 = live_pd.stream_one(url, second, args.max_tokens, conv)
    out.append(Exchange(pair.variant, phase, mode, rep, 2, xfer2, len(second), ttft2 * 1e3,
                        ids2, second))
    return out


# ---- what was recorded ---------------------------------------------------------------------------


def mean_run_blocks(src: tuple[int, ...], dst: tuple[int, ...], by_src: bool) -> float:
    """Blocks per run as the transport merges them: pairs sorted by the mover's block id, a run
    continues while both ids go up by one."""
    pairs = sorted(zip(src, dst, strict=False), key=lambda p: p[0] if by_src else p[1])
    if not pairs:
        return 0.0
    runs = 1 + sum(1 for (a, b), (c, d) in itertools.pairwise(pairs)
                   if not (c == a + 1 and d == b + 1))
    return len(pairs) / runs


def transfers_of(evs: list[Any], logs: dict[str, list[dict[str, Any]]],
                 xfer: str) -> list[dict[str, Any]]:
    from kvplane.core import events as ev

    mine = [e for e in evs if e.request == xfer]
    planned = {(e.instance, e.attempt, e.direction): e for e in mine
               if isinstance(e, ev.TransferPlanned)}
    out = []
    for e in mine:
        if not isinstance(e, ev.TransferCompleted | ev.TransferFailed):
            continue
        p = planned.get((e.instance, e.attempt, e.direction))
        if p is None:
            continue
        kind = "write" if e.instance == p.src else "read"
        seen = [r for r in logs.get(e.instance, []) if r["xfer"] == xfer
                and int(r["attempt"]) == e.attempt and r["kind"] == kind]
        out.append({
            "direction": e.direction, "by": e.instance, "op": kind.upper(),
            "ok": isinstance(e, ev.TransferCompleted),
            "ms": round((e.at - p.at) * 1e3, 3), "bytes": p.bytes, "tokens": p.num_tokens,
            "blocks": len(p.src_blocks), "per_run_descriptors": p.descriptors,
            "run_blocks": round(mean_run_blocks(p.src_blocks, p.dst_blocks,
                                                by_src=kind == "write"), 3),
            "method": ",".join(sorted({r["method"] for r in seen})) or "?",
            "posted_descriptors": sum(int(r["desc"]) for r in seen),
            "worker_ms": round(sum(float(r["ms"]) for r in seen), 3) if seen else None})
    return out


def transfer_logs(names: list[BenchServer]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for s in names:
        text = s.log_path.read_text(errors="replace")
        out[s.name] = [m.groupdict() for m in LOG_LINE.finditer(text)]
    return out


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(rows: list[Exchange], variants: list[str]) -> list[dict[str, Any]]:
    """One line per (phase, mode, turn, direction, variant), with ratios against `direct`."""
    groups: dict[tuple[str, str, int, str, str], list[tuple[Exchange, dict[str, Any]]]] = {}
    for x in rows:
        for t in x.transfers:
            if t["tokens"] * 2 < x.prompt_tokens and x.turn == 2 and t["direction"] == "P->D":
                key_dir = "P->D (rest)"
            else:
                key_dir = t["direction"]
            groups.setdefault((x.phase, x.mode, x.turn, key_dir, x.variant), []).append((x, t))
    lines = []
    for (phase, mode, turn, direction, variant), items in sorted(
            groups.items(), key=lambda kv: (kv[0][0] != "fresh", kv[0][1], kv[0][2], kv[0][3],
                                            variants.index(kv[0][4]))):
        ts = [t for _, t in items]
        good = [t for t in ts if t["ok"]] or ts  # times of the transfers that moved the KV
        lines.append({
            "phase": phase, "mode": mode, "turn": turn, "direction": direction,
            "variant": variant, "n": len(ts), "op": ts[0]["op"],
            "method": ",".join(sorted({t["method"] for t in ts})),
            "ok": all(t["ok"] for t in ts),
            "mib": round(med([t["bytes"] / 2**20 for t in ts]), 1),
            "per_run_descriptors": int(med([t["per_run_descriptors"] for t in ts])),
            "run_blocks": round(med([t["run_blocks"] for t in ts]), 2),
            "posted_descriptors": int(med([t["posted_descriptors"] for t in ts])),
            "ms": round(med([t["ms"] for t in good]), 2),
            "worker_ms": round(med([t["worker_ms"] for t in good
                                    if t["worker_ms"] is not None]), 2),
            "ttft_ms": round(med([x.ttft_ms for x, _ in items]), 1),
            "exact": sum(1 for x, _ in items if x.reference is not None
                         and x.tokens == x.reference),
            "failed": sum(1 for t in ts if not t["ok"]),
        })
    base = {(ln["phase"], ln["mode"], ln["turn"], ln["direction"]): ln for ln in lines
            if ln["variant"] == "direct"}
    for ln in lines:
        b = base.get((ln["phase"], ln["mode"], ln["turn"], ln["direction"]))
        if b is not None and ln is not b:
            for k in ("ms", "worker_ms", "ttft_ms"):
                ln[f"{k}_gain"] = round(b[k] / ln[k], 2) if ln[k] else None
    return lines


def print_table(lines: list[dict[str, Any]]) -> None:
    head = (f"{'phase':<11}{'mode':<14}{'t':>2} {'dir':<12}{'variant':<8}{'method':<8}{'n':>3}"
            f"{'MiB':>8}{'run blk':>8}{'desc/run':>9}{'posted':>7}{'xfer ms':>9}{'thread ms':>10}"
            f"{'TTFT ms':>9}{'x xfer':>8}{'x TTFT':>8}{'exact':>6}{'failed':>7}")
    print(head)
    print("-" * len(head))
    for ln in lines:
        gain = ln.get("ms_gain")
        tgain = ln.get("ttft_ms_gain")
        print(f"{ln['phase']:<11}{ln['mode']:<14}{ln['turn']:>2} {ln['direction']:<12}"
              f"{ln['variant']:<8}{ln['method']:<8}{ln['n']:>3}{ln['mib']:>8.0f}"
              f"{ln['run_blocks']:>8.2f}{ln['per_run_descriptors']:>9}"
              f"{ln['posted_descriptors']:>7}{ln['ms']:>9.2f}{ln['worker_ms']:>10.2f}"
              f"{ln['ttft_ms']:>9.1f}{'' if gain is None else f'{gain:.2f}':>8}"
              f"{'' if tgain is None else f'{tgain:.2f}':>8}{ln['exact']:>3}/{ln['n']:<2}"
              f"{ln['failed']:>7}")


# ---- main ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--variants", nargs="+", default=["direct", "staged", "auto"],
                    choices=["direct", "staged", "auto", "ipc"])
    ap.add_argument("--modes", nargs="+", default=["pull", "push", "bidirectional"],
                    choices=["pull", "push", "bidirectional"])
    ap.add_argument("--tokens", type=int, default=16000, help="prompt tokens of each exchange")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="fragmented exchanges per mode")
    ap.add_argument("--no-fresh", action="store_true", help="skip the fresh-pool exchanges")
    ap.add_argument("--burst", type=float, default=1.3,
                    help="prompt tokens of each fragmenting burst, in KV pools")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--kv-gib", type=float, default=8.0, help="GPU: KV pool per server")
    ap.add_argument("--pool-prompts", type=float, default=4.0,
                    help="CPU: KV pool per server in prompts of --tokens")
    ap.add_argument("--lease-ttl", type=float, default=10.0,
                    help="seconds decode retains a conversation's KV (bidirectional)")
    ap.add_argument("--deadline", type=float, default=0.0,
                    help="seconds after start when no new exchange begins (0: none); the "
                         "report is still written")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--logs", type=Path, default=None)
    ap.add_argument("--no-plain", action="store_true",
                    help="no plain reference server (tokens compared across variants only)")
    args = ap.parse_args(argv)

    import torch

    started = time.monotonic()
    gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    args.dtype = "bfloat16" if gpu else "float32"
    block = 16 if gpu else 32
    logs = args.logs or Path(tempfile.mkdtemp(prefix="kvplane-xfer-pd-"))
    logs.mkdir(parents=True, exist_ok=True)
    db = (logs / "events.db").resolve()
    run = f"xfer-pd-{uuid.uuid4().hex[:8]}"
    t0 = time.monotonic()
    model = model_dir(args)
    print(f"model {model} ({time.monotonic() - t0:.0f} s); logs and events in {logs}",
          flush=True)
    per_token = args.layers * 2 * args.kv_heads * args.head_dim * (2 if gpu else 4)
    # (transfer_timeout stays below kv_lease_duration: a pull's pin asks for that long)
    cfg = {"kvplane_db": str(db), "kvplane_run": run, "decoder_kv_blocks_ttl": args.lease_ttl}
    common = {"gpu": gpu, "dtype": args.dtype, "block_size": block,
                  "max_model_len": args.tokens + 2 * args.max_tokens + 128 + 2 * block,
                  "kv_bytes": int(args.kv_gib * 2**30),
                  "num_blocks": int(args.pool_prompts * args.tokens / block) + 1,
                  "prefix_caching": True}
    # KVPLANE_STAGING_TRACE: a failed staged job's log line lists its steps (live/staging.py)
    env = {"KVPLANE_HANDLE_KEY": HANDLE_KEY, "KVPLANE_LOG_TRANSFERS": "1",
           "KVPLANE_STAGING_TRACE": "1",
           "VLLM_USE_FLASHINFER_SAMPLER": "0"}
    pairs: list[Pair] = []
    for v in args.variants:
        staging = "on" if (v == "auto" and not gpu) else v  # host memory: "auto" means off
        e = {**env, "KVPLANE_STAGING": staging}
        p = BenchServer(f"prefill-{v}", model, logs, connector=dict(cfg), env=dict(e), **common)
        d = BenchServer(f"decode-{v}", model, logs, connector=dict(cfg), env=dict(e), **common)
        router = live_pd.Router(p, d, db, run, logs, args.lease_ttl, HANDLE_KEY)
        pairs.append(Pair(v, p, d, router))
    plain = None if args.no_plain else BenchServer("plain", model, logs, env=dict(env), **common)
    every = [s for pr in pairs for s in (pr.prefill, pr.decode)] + ([plain] if plain else [])
    print(f"starting {len(every)} vLLM servers ({per_token} bytes of KV per token) ...",
          flush=True)
    t0 = time.monotonic()
    servers.start_all(every, timeout=600)
    pools = {s.name: s.pool_tokens() for s in every}
    print(f"  healthy after {time.monotonic() - t0:.0f} s; KV pools (tokens): {pools}",
          flush=True)
    rows: list[Exchange] = []
    skipped: list[str] = []
    refs: dict[tuple[int, ...], list[int]] = {}
    failures: list[str] = []

    def with_routers(mode: str, body: Any) -> None:
        with cf.ThreadPoolExecutor(len(pairs)) as pool:
            list(pool.map(lambda pr: pr.router.start(mode), pairs))
        try:
            body()
        finally:
            for pr in pairs:
                pr.router.stop()

    def one(pr: Pair, phase: str, mode: str, rep: int, seed: int, frag: bool) -> None:
        if args.deadline and time.monotonic() - started > args.deadline:
            skipped.append(f"{phase} {mode} {pr.variant} rep {rep}")
            return
        if frag:
            fragment(pr, pools, args, seed * 1000 + 17)
        try:
            got = exchange(pr, phase, mode, rep, live_pd.prompt(seed, args.tokens), args, pools,
                           seed)
        except Exception as exc:  # noqa: BLE001 - the others still run, the run fails
            failures.append(f"{phase} {mode} {pr.variant} rep {rep}: {exc!r}")
            print(f"  FAILED {failures[-1]}", flush=True)
            return
        rows.extend(got)
        print(f"  {phase} {mode} {pr.variant} rep {rep}: TTFT "
              + ", ".join(f"{x.ttft_ms:.0f} ms" for x in got), flush=True)

    try:
        if not args.no_fresh:
            for mode in ("pull", "push"):
                def fresh(mode: str = mode) -> None:
                    # handshakes and first uses, not counted (a short prompt: the pool keeps
                    # handing out ascending blocks for the counted one)
                    warm = live_pd.prompt(7 if mode == "pull" else 8, args.tokens // 4)
                    for pr in pairs:
                        live_pd.stream_one(pr.router.url, warm, args.max_tokens, None)
                    for pr in pairs:
                        one(pr, "fresh", mode, 0, 101 if mode == "pull" else 102, frag=False)
                with_routers(mode, fresh)
        for mode in args.modes:
            def fragmented(mode: str = mode) -> None:
                for rep in range(args.repeats):
                    for pr in pairs:
                        one(pr, "fragmented", mode, rep, 1000 * (1 + args.modes.index(mode))
                            + rep, frag=True)
            with_routers(mode, fragmented)
        time.sleep(1.5)  # the connectors' recorders write every 0.2 s
        from kvplane.store import open_store

        with open_store(str(db)) as store:
            evs = sorted(store.events(run), key=lambda e: e.at)
        tlogs = transfer_logs([s for pr in pairs for s in (pr.prefill, pr.decode)])
        for x in rows:
            x.transfers = transfers_of(evs, tlogs, x.xfer)
    finally:
        for pr in pairs:
            pr.router.stop()
    # the reference: the plain server's greedy tokens for each prompt (turn 2: its own history),
    # and again with the prompt in its prefix cache: where a P/D answer differs from the first
    # but equals the second, the difference is the arithmetic of computing the tail against a
    # stored cache (bf16 sums in another order), not the bytes the transfer moved
    cached: dict[tuple[int, ...], list[int]] = {}
    try:
        if plain is not None:
            for x in rows:
                key = tuple(x.prompt)
                if key not in refs:
                    refs[key] = servers.complete(plain.url, x.prompt, args.max_tokens).token_ids
                    cached[key] = servers.complete(plain.url, x.prompt,
                                                   args.max_tokens).token_ids
                x.reference, x.reference_cached = refs[key], cached[key]
    finally:
        servers.stop_all(every)
    lines = summarize(rows, args.variants)
    print()
    print_table(lines)
    same = _same_across_variants(rows)
    exact = sum(1 for x in rows if x.reference is not None and x.tokens == x.reference)
    exact_cached = sum(1 for x in rows if x.reference_cached is not None
                       and x.tokens == x.reference_cached)
    plain_agree = sum(1 for k in refs if k in cached and refs[k] == cached[k])
    print(f"\ntokens equal across variants: {same}; equal to the plain server: {exact}/"
          f"{len(rows)}{' (no plain server)' if plain is None else ''}; equal to its "
          f"prefix-cached rerun: {exact_cached}/{len(rows)}; the plain server agrees with "
          f"itself (first answer vs cached rerun) on {plain_agree}/{len(cached)} prompts; "
          f"failures: {failures or 'none'}; skipped at the deadline: {skipped or 'none'}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "device": torch.cuda.get_device_name(0) if gpu else "cpu",
            "vllm": _vllm_version(), "args": {k: str(v) for k, v in vars(args).items()},
            "kv_bytes_per_token": per_token, "pools_tokens": pools, "run": run,
            "summary": lines, "same_across_variants": same, "failures": failures, "skipped": skipped,
            "equal_to_plain": exact, "equal_to_plain_cached": exact_cached,
            "plain_self_agreement": [plain_agree, len(cached)],
            "exchanges": [x.record() for x in rows]}, indent=1))
        print(f"written {args.json}")
    if os.environ.get("KVPLANE_BENCH_LOGS_TGZ"):
        with tarfile.open(os.environ["KVPLANE_BENCH_LOGS_TGZ"], "w:gz") as tar:
            for f in sorted(logs.glob("*.log")):
                tar.add(f, arcname=f.name)
    return 0 if same and not failures else 1


def _same_across_variants(rows: list[Exchange]) -> bool:
    """Every variant's tokens for the same exchange (phase, mode, repeat, turn) are equal."""
    seen: dict[tuple[str, str, int, int], set[tuple[int, ...]]] = {}
    for x in rows:
        seen.setdefault((x.phase, x.mode, x.rep, x.turn), set()).add(tuple(x.tokens))
    return all(len(v) == 1 for v in seen.values())


def _vllm_version() -> str:
    try:
        import vllm

        return str(vllm.__version__)
    except ImportError:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
