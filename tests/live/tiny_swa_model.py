"""A tiny model with a sliding-window layer and a full-attention layer, made at test time.

Two KV cache groups in vLLM's hybrid KV cache manager: a Gemma 3 (text) of the same size as
tiny_model.py's Llama (hidden 128, 4 heads, 2 KV heads, head_dim 32) whose first layer attends
to a sliding window of 64 tokens and whose second layer attends to everything. Same tokenizer
as tiny_model.py (copied from it), random weights with the same large init scale so that
greedy output depends on the prompt, and so on the window. Built once per machine.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

RECIPE = "kvplane-tiny-swa-gemma3-v1"
WINDOW = 64
SEED = 4321
INIT_STD = 0.25


def _tiny_model() -> object:
    name = "kvplane_live_tiny_model"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(
            "tiny_model.py"))
        assert spec is not None and spec.loader is not None
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[name]


def _build(out: Path, tokenizer_dir: Path) -> None:
    import torch
    from transformers import AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.save_pretrained(out)
    torch.manual_seed(SEED)
    config = Gemma3TextConfig(
        vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32,
        max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=True,
        sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id, torch_dtype="float32")
    model = Gemma3ForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, INIT_STD)
    model.save_pretrained(out)
    (out / "kvplane_recipe.json").write_text(json.dumps({"recipe": RECIPE, "seed": SEED}))


def tiny_swa_model_dir(root: str | os.PathLike[str] | None = None) -> Path:
    base = Path(root or os.environ.get("KVPLANE_TEST_CACHE",
                                       Path(tempfile.gettempdir()) / "kvplane-test-cache"))
    base.mkdir(parents=True, exist_ok=True)
    target = base / RECIPE
    tokenizer_dir = _tiny_model().tiny_model_dir(root)  # type: ignore[attr-defined]
    with open(base / f"{RECIPE}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "kvplane_recipe.json").exists():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f"{RECIPE}-", dir=base))
        try:
            _build(tmp, tokenizer_dir)
            if target.exists():
                shutil.rmtree(target)
            tmp.rename(target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


if __name__ == "__main__":
    print(tiny_swa_model_dir())
