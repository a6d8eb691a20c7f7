"""The independent side of the comparison: the same HF checkpoint run by transformers in float64.

``hf_logprobs_entropy`` gives NeMo-RL's conventions (token columns: column t holds log p(x_t | x_<t),
column 0 and padding 0; entropy of softmax(logits / T) in the same columns) so the worker's
``get_logprobs_with_entropy`` is compared value for value.
"""

from __future__ import annotations

import torch

F64 = torch.float64


def load_hf(model_dir: str, dtype=F64):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager")
    return model.eval()


def token_columns(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """[B, S-1] next-token values → [B, S] token columns, zero at column 0 and past each length."""
    B, S1 = x.shape
    out = torch.zeros(B, S1 + 1, dtype=x.dtype)
    out[:, 1:] = x
    return out * (torch.arange(S1 + 1)[None, :] < lengths[:, None])


def logits(model, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    mask = (torch.arange(input_ids.shape[1])[None, :] < lengths[:, None]).long()
    return model(input_ids=input_ids, attention_mask=mask).logits


def logprobs_entropy(logits_: torch.Tensor, input_ids, lengths, temperature: float = 1.0):
    """Token-column log-probs and entropy of softmax(logits / T) (NeMo-RL's convention)."""
    z = logits_[:, :-1].to(F64) / temperature
    logp = torch.log_softmax(z, -1)
    lp = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return token_columns(lp, lengths), token_columns(ent, lengths)
