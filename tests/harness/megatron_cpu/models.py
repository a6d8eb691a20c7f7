"""Tiny HF checkpoints for the Megatron-worker tests: Qwen3, Qwen3-MoE and Qwen2 written by transformers.

Every weight (norm scales included) is drawn at random so a weight that Megatron-Bridge failed
to load, or loaded into the wrong place, changes the log-probs; the tokenizer is a word-level
one over the model's vocabulary so Megatron-Bridge's ``HuggingFaceTokenizer`` loads it offline.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 256  # a multiple of 128 * TP for TP <= 2: Megatron pads nothing, so shapes match HF
DELIMITER = 3


def tokenizer(path: Path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, "<eos>": 2, "\n\n": DELIMITER}  # SSPO's segment delimiter
    vocab.update({f"w{i}": i for i in range(4, VOCAB)})
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>")
    fast.save_pretrained(str(path))
    return fast


def config(moe: bool, layers: int, family: str = "qwen3"):
    from transformers import Qwen2Config, Qwen3Config, Qwen3MoeConfig

    if family == "qwen2":  # Qwen2.5's architecture: QKV bias, no QK norm
        return Qwen2Config(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            rope_theta=10000.0,
            rms_norm_eps=1e-6,
            pad_token_id=0,
            eos_token_id=2,
            bos_token_id=None,
            tie_word_embeddings=False,
        )
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        pad_token_id=0,
        eos_token_id=2,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    if moe:
        return Qwen3MoeConfig(
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            router_aux_loss_coef=0.0,
            output_router_logits=False,
            **common,
        )
    return Qwen3Config(intermediate_size=96, **common)


def write(path: Path, *, moe: bool = False, layers: int = 2, seed: int = 0, family: str = "qwen3") -> Path:
    """A Qwen3(-MoE) or Qwen2 checkpoint (safetensors, float32) plus tokenizer in ``path``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config(moe, layers, family), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)  # not the all-ones init: an unloaded norm must show
            else:
                p.normal_(0, 0.15)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    tokenizer(path)
    return path
