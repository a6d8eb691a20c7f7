"""Tiny Qwen3 / Qwen3-MoE checkpoints written by transformers (weights ~N(0, 0.2), fp32)."""

from __future__ import annotations

import string
from pathlib import Path

import torch

PROMPTS = ["The capital of France is", "12 * 7 =", "def f(x):\n    return"]

# a training-time ``policy.hf_config_overrides``: YaRN with every field NeMo-RL's Megatron setup
# requires (models/megatron/setup.py), factor 4 over the tiny models' 32 original positions
YARN_OVERRIDES = {
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 4.0,
        "rope_theta": 10000.0,
        "original_max_position_embeddings": 32,
        "truncate": True,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 0.0,
    }
}


def make_tokenizer(path: Path):
    """Character-level WordLevel tokenizer (103 ids) wrapped in PreTrainedTokenizerFast."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, "[EOS]": 2}
    for c in string.printable:
        vocab.setdefault(c, len(vocab))
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]")
    fast.save_pretrained(str(path))
    return fast


def tiny_config(moe: bool = False, tie: bool = False, **kw):
    """Qwen3(-MoE) with hidden 32, 2 layers, 4 heads / 2 KV heads (TP2 divides both), vocab 112;
    MoE: 4 experts, top-2, normalised top-k (the Qwen3-30B-A3B routing). ``kw`` overrides a field."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=112,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        pad_token_id=0,
        eos_token_id=2,
        tie_word_embeddings=tie,
    )
    common.update(kw)
    if moe:
        return Qwen3MoeConfig(
            intermediate_size=64,
            moe_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            **common,
        )
    return Qwen3Config(intermediate_size=64, **common)


def make_hf_model(path: Path, *, moe: bool, seed: int):
    """``save_pretrained`` dir (fp32 weights + char tokenizer) at ``path``; returns the model."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(moe), dtype=torch.float32)
    with torch.no_grad():  # larger weights than the default init so logits are far from zero
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    model.eval().save_pretrained(str(path))
    make_tokenizer(path)
    return model


def assert_same_weights(source, exported) -> None:
    """The two models hold the same tensors under the same names, bit for bit."""
    src_sd, exp_sd = source.state_dict(), exported.state_dict()
    assert set(src_sd) == set(exp_sd)
    for k in src_sd:
        assert torch.equal(src_sd[k], exp_sd[k]), k


@torch.no_grad()
def max_logit_diff(a, b, tokenizer, prompts=PROMPTS) -> float:
    """max |logits_a - logits_b| over the prompts (one unpadded forward each, fp32)."""
    diffs = []
    for p in prompts:
        ids = torch.tensor([tokenizer(p)["input_ids"]])
        diffs.append(float((a(input_ids=ids).logits.float() - b(input_ids=ids).logits.float()).abs().max()))
    return max(diffs)


# what the answering model's chat template appends for the assistant (a space: not a character of the answer)
ANSWER_PROMPT = "Answer: "


def make_answering_model(path: Path, answer: str, *, moe: bool = True, scale: float = 10.0):
    """A tiny Qwen3(-MoE) that answers every prompt with ``answer`` then EOS, greedily and with a
    margin that makes sampling at T<=1 give the same text: a bigram model. Attention and MLP
    outputs are zero (``o_proj``, every ``down_proj``), so the last hidden state is the current
    token's embedding; the characters of ``answer`` (each at most once) get orthogonal embeddings
    and every other token shares one more direction; ``lm_head`` maps that direction to the first
    character, each character to the next, the last to EOS. Saved with the character tokenizer and
    a chat template ending in :data:`ANSWER_PROMPT`; max positions 32768 (room for an eval's
    max_model_len). Returns the model."""
    from tokenizers import decoders
    from transformers import AutoModelForCausalLM

    tok = make_tokenizer(path)
    tok.backend_tokenizer.decoder = decoders.Fuse()  # decode: the characters, not space-separated
    tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}" + ANSWER_PROMPT + "{% endif %}"
    )
    tok.save_pretrained(str(path))
    chain = [tok.convert_tokens_to_ids(c) for c in answer]
    assert len(set(chain)) == len(chain) and tok.unk_token_id not in chain, answer
    cfg = tiny_config(moe, max_position_embeddings=32768)
    assert len(chain) + 1 <= cfg.hidden_size
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    basis = torch.eye(cfg.hidden_size)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                p.zero_()
            elif p.dim() > 1:
                p.normal_(0, 0.2)
        emb = model.get_input_embeddings().weight
        emb.copy_(basis[0].expand_as(emb))  # every other token: direction 0
        head = model.get_output_embeddings().weight
        head.zero_()
        head[chain[0]] = scale * basis[0]  # anything else -> the first character
        for i, t in enumerate(chain):
            emb[t] = basis[i + 1]
            head[chain[i + 1] if i + 1 < len(chain) else tok.eos_token_id] = scale * basis[i + 1]
    model.eval().save_pretrained(str(path))
    return model
