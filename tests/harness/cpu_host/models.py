"""Tiny local models, tokenizer and math data for NeMo-RL's loops on CPU (no downloads).

The tokenizer has one token per character of a small alphabet (digits 0–2, a few letters,
``\\n\\n`` as one token so SSPO's delimiter table finds it). A random model then writes a digit
about every third token, so NeMo-RL's math verifier (it extracts the last number of a response)
finds a correct answer in about a third of the responses and none at all in a few: every
group has reward variance (non-zero GRPO advantages) and ESPO sees some failed verifications.
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ["<pad>", "<eos>", "<bos>"]
CHARS = list("012+= ?abcwhtis:\n")
VOCAB_PAD = 32
# one chat turn per message; the generation prompt opens the assistant turn
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


def write_word_level_model(save_dir: Path, words: list[str], vocab_size: int) -> Path:
    """A model folder for the launcher tests that load configs and tokenizers but no weights: a
    whitespace word-level tokenizer over ``words`` after 4 special tokens (with a chat template) and a
    1-layer Qwen2 config."""
    import tokenizers
    import transformers

    vocab = {w: i for i, w in enumerate(["<pad>", "<unk>", "<s>", "</s>"] + words)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    fast.save_pretrained(str(save_dir))
    transformers.Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    ).save_pretrained(str(save_dir))
    return save_dir


def build_tokenizer(save_dir: Path):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + ["\n\n"] + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\n\n|[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="?",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(save_dir))
    return fast


# output-layer scale of a "peaked" model: a random tiny model is nearly uniform (its π_old entropy
# spans ~0.01 nats), one with this scale spans ~1.5 nats across tokens (~0.001 to ~1.5)
PEAKED = 60.0


def write_model(
    save_dir: Path,
    *,
    moe: bool = False,
    hidden: int = 32,
    layers: int = 2,
    seed: int = 0,
    classifier: bool = False,
    kv_heads: int = 1,
    logit_scale: float = 1.0,
) -> Path:
    """A randomly initialised Qwen3 / Qwen3-MoE (or a 1-label Qwen3 sequence classifier) + tokenizer;
    ``logit_scale`` multiplies the output layer (a peaked model: low-entropy and high-entropy tokens)."""
    import torch
    from transformers import (
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3ForSequenceClassification,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    save_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(save_dir)
    heads = 2
    common = dict(
        vocab_size=VOCAB_PAD,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    if moe:
        conf = Qwen3MoeConfig(
            **common,
            intermediate_size=2 * hidden,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=hidden,
            decoder_sparse_step=1,
            norm_topk_prob=True,
            output_router_logits=False,
        )
        model = Qwen3MoeForCausalLM(conf)
    elif classifier:
        model = Qwen3ForSequenceClassification(Qwen3Config(**common, intermediate_size=2 * hidden, num_labels=1))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common, intermediate_size=2 * hidden))
    if logit_scale != 1.0:
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(logit_scale)
    model.save_pretrained(str(save_dir), safe_serialization=True)
    return save_dir


def write_math_data(path: Path, n: int = 16) -> Path:
    """Addition problems whose answers are 0, 1 or 2 (``problem`` / ``answer`` columns)."""
    pairs = [(a, b) for a in range(3) for b in range(3) if a + b <= 2]
    rows = [{"problem": f"{a}+{b}=", "answer": str(a + b)} for a, b in (pairs * n)[:n]]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
