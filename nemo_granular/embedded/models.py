"""Real transformers parts built from small configs: tokenizer, Qwen3 / Qwen3-MoE policy, critic.

The tokenizer is created with the ``tokenizers`` library and saved in standard Hugging Face
format: one token per character, plus a single ``"\\n\\n"`` token (as real BPE vocabularies
have), so SSPO's delimiter table finds the blank line in one token.
"""

from __future__ import annotations

from pathlib import Path

import torch

CHARS = list("0123456789+-=*/:. ?QA\nabcdefghijklmnopqrstuvwxyz")  # 52 tokens with specials: vocab 64
SPECIALS = ["<pad>", "<eos>", "<bos>"]


def build_tokenizer(save_dir: str | Path | None = None):
    """Character tokenizer (+ ``"\\n\\n"``), vocabulary padded to a multiple of 64."""
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
    fast.padding_side = "left"
    if save_dir is not None:
        fast.save_pretrained(str(save_dir))
    return fast


def padded_vocab(tokenizer, multiple: int = 64) -> int:
    n = len(tokenizer)
    return ((n + multiple - 1) // multiple) * multiple


def build_policy(cfg, tokenizer):
    """A randomly initialised Qwen3 (dense) or Qwen3-MoE causal LM, or a local HF model dir."""
    if cfg.path:
        return load_pretrained_policy(cfg.path)
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(
        vocab_size=padded_vocab(tokenizer),
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.hidden_size // cfg.num_heads,
        max_position_embeddings=cfg.max_positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    if cfg.moe:
        conf = Qwen3MoeConfig(
            **common,
            intermediate_size=cfg.intermediate_size,
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.experts_per_token,
            moe_intermediate_size=cfg.expert_size,
            decoder_sparse_step=1,
            norm_topk_prob=True,
            output_router_logits=False,
        )
        return Qwen3MoeForCausalLM(conf)
    return Qwen3ForCausalLM(Qwen3Config(**common, intermediate_size=cfg.intermediate_size))


def load_pretrained_policy(path: str):
    from transformers import AutoModelForCausalLM

    p = Path(path)
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"model.path: {path} is not a Hugging Face model directory (no config.json)")
    return AutoModelForCausalLM.from_pretrained(str(p), dtype=torch.float32)


def tokenizer_dir(model_dir: str | None) -> str | None:
    """Where the tokenizer of a model dir lives: in it, or in a sibling ``tokenizer/`` (our checkpoints)."""
    if not model_dir:
        return None
    p = Path(model_dir)
    if not p.is_dir():
        raise FileNotFoundError(f"model directory not found: {model_dir}")
    if (p / "tokenizer_config.json").is_file() or (p / "tokenizer.json").is_file():
        return str(p)
    if (p.parent / "tokenizer").is_dir():
        return str(p.parent / "tokenizer")
    raise FileNotFoundError(f"no tokenizer files in {model_dir} (nor in {p.parent / 'tokenizer'})")


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"model.path: no such directory {path}")
    tok = AutoTokenizer.from_pretrained(str(p))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def build_critic(cfg, policy, tokenizer):
    """SPPO critic: a causal LM with a scalar head (``Qwen3ForSequenceClassification``, 1 label).

    transformers pools the head at the last non-pad token, so feeding the prompt alone gives
    the logit v of V(s_p) = σ(v) at the last prompt token. With ``cfg.hidden_size`` unset the
    critic has the policy's (dense) architecture and starts from the policy's backbone weights,
    as in the paper; a smaller ``hidden_size`` gives a small decoupled critic (random init)
    sharing the tokenizer.
    """
    from transformers import AutoModelForSequenceClassification, Qwen3Config, Qwen3ForSequenceClassification

    if cfg.path:
        p = Path(cfg.path)
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"critic.path: {cfg.path} is not a Hugging Face model directory")
        return AutoModelForSequenceClassification.from_pretrained(str(p), num_labels=1, dtype=torch.float32)
    pc = policy.config
    same = cfg.hidden_size is None and cfg.num_layers is None and pc.model_type == "qwen3"
    hidden = cfg.hidden_size or pc.hidden_size
    heads = pc.num_attention_heads if hidden == pc.hidden_size else max(1, hidden // 16)
    kv = pc.num_key_value_heads if hidden == pc.hidden_size else heads
    conf = Qwen3Config(
        vocab_size=pc.vocab_size,
        hidden_size=hidden,
        num_hidden_layers=cfg.num_layers or pc.num_hidden_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=hidden // heads,
        intermediate_size=getattr(pc, "intermediate_size", 4 * hidden) if hidden == pc.hidden_size else 4 * hidden,
        max_position_embeddings=pc.max_position_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        num_labels=1,
    )
    critic = Qwen3ForSequenceClassification(conf)
    if same:
        critic.model.load_state_dict(policy.model.state_dict())
    return critic
