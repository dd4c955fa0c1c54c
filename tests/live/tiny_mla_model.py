"""A tiny DeepSeek-V2-style model with MLA (multi-head latent attention), made at test time.

vLLM caches one latent per token and layer for MLA: kv_lora_rank + qk_rope_head_dim values,
the same on every TP rank. vLLM's CPU MLA kernel takes only the DeepSeek sizes (latent 512 +
rope 64 = 576, block size 16), so the latent is full size while the rest is tiny: hidden 128,
2 layers (both dense MLP: experts declared but first_k_dense_replace covers every layer), 4 heads, q without LoRA, qk_nope_head_dim 32,
v_head_dim 32. Same tokenizer as tiny_model.py, random weights with a large init scale so that
greedy output depends on the prompt. Built once per machine.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

RECIPE = "kvplane-tiny-mla-deepseek2-v1"
SEED = 2468
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
    from transformers import AutoTokenizer, DeepseekV2Config, DeepseekV2ForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.save_pretrained(out)
    torch.manual_seed(SEED)
    config = DeepseekV2Config(
        vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, moe_intermediate_size=64,
        first_k_dense_replace=2, moe_layer_freq=1, max_position_embeddings=1024,
        rms_norm_eps=1e-5, tie_word_embeddings=False, rope_scaling=None,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id, torch_dtype="float32")
    model = DeepseekV2ForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, INIT_STD)
    model.save_pretrained(out)
    (out / "kvplane_recipe.json").write_text(json.dumps({"recipe": RECIPE, "seed": SEED}))


def tiny_mla_model_dir(root: str | os.PathLike[str] | None = None) -> Path:
    """The MLA model folder (tokenizer from tiny_model.py's Llama), built on first use."""
    tiny = _tiny_model()
    tokenizer_dir = tiny.tiny_model_dir(root)  # type: ignore[attr-defined]
    return tiny.built(RECIPE, lambda out: _build(out, tokenizer_dir), root)  # type: ignore[attr-defined,no-any-return]


if __name__ == "__main__":
    print(tiny_mla_model_dir())
