"""A tiny Llama model made at test time, for real vLLM servers on a CPU-only machine.

No hub access here, so the model is built from scratch: a Llama config (hidden 128, 2 layers,
4 heads, 2 KV heads, head_dim 32, the smallest head size vLLM's CPU attention takes), random
weights with a large init scale so that greedy output depends on the prompt (the default scale
gives " 1 1 1" for every prompt, which would hide a wrong KV transfer), saved as float32
safetensors, plus a byte-level BPE tokenizer trained on local text with a chat template.

`tiny_model_dir()` builds it once per machine under a cache folder keyed by the recipe version
(a few seconds), so every server of a test session loads the same files. `tiny_swa_model_dir()`
does the same for a Gemma 3 of the same size with a sliding-window layer (two KV cache groups).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

RECIPE = "kvplane-tiny-llama-v3"
VOCAB = 1024
SEED = 1234
INIT_STD = 0.25

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _corpus() -> list[str]:
    """Local text to train the tokenizer on: the Python standard library's own sources."""
    import json as _json  # any stdlib module tells where the library lives

    lib = Path(_json.__file__).resolve().parent.parent
    texts = []
    for p in sorted(lib.glob("*.py"))[:120]:
        try:
            texts.append(p.read_text(encoding="utf-8", errors="ignore"))
        except OSError:
            continue
    return texts


def _build(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    special = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=128, intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=1024, rms_norm_eps=1e-5, initializer_range=INIT_STD,
        tie_word_embeddings=False, bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id, torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():  # a larger scale everywhere: outputs must depend on the prompt
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, INIT_STD)
    model.save_pretrained(out, safe_serialization=True)
    (out / "kvplane_recipe.json").write_text(json.dumps({"recipe": RECIPE, "seed": SEED}))


def built(recipe: str, build: Callable[[Path], None],
          root: str | os.PathLike[str] | None = None) -> Path:
    """The folder of `recipe`, made by `build(folder)` on first use, once per machine (a file
    lock makes it safe to call from several processes at once; a half-built folder never
    shows)."""
    base = Path(root or os.environ.get("KVPLANE_TEST_CACHE",
                                       Path(tempfile.gettempdir()) / "kvplane-test-cache"))
    base.mkdir(parents=True, exist_ok=True)
    target = base / recipe
    with open(base / f"{recipe}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "kvplane_recipe.json").exists():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f"{recipe}-", dir=base))
        try:
            build(tmp)
            if target.exists():
                shutil.rmtree(target)
            tmp.rename(target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def tiny_model_dir(root: str | os.PathLike[str] | None = None) -> Path:
    """The Llama model folder, built on first use."""
    return built(RECIPE, _build, root)


# ---- a sliding-window model --------------------------------------------------------------------
#
# Two KV cache groups in vLLM's hybrid KV cache manager: a Gemma 3 (text) of the same size as the
# Llama above whose first layer attends to a sliding window of WINDOW tokens and whose second
# layer attends to everything. Same tokenizer, random weights with the same large init scale, so
# that greedy output depends on the prompt, and so on the window.

SWA_RECIPE = "kvplane-tiny-swa-gemma3-v1"
WINDOW = 64
SWA_SEED = 4321


def _build_swa(out: Path, tokenizer_dir: Path) -> None:
    import torch
    from transformers import AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.save_pretrained(out)
    torch.manual_seed(SWA_SEED)
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
    (out / "kvplane_recipe.json").write_text(json.dumps({"recipe": SWA_RECIPE,
                                                         "seed": SWA_SEED}))


def tiny_swa_model_dir(root: str | os.PathLike[str] | None = None) -> Path:
    """The sliding-window model folder (tokenizer from the Llama's), built on first use."""
    tokenizer_dir = tiny_model_dir(root)
    return built(SWA_RECIPE, lambda out: _build_swa(out, tokenizer_dir), root)


if __name__ == "__main__":
    print(tiny_model_dir())
    print(tiny_swa_model_dir())
