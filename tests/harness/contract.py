"""The NeMo-RL batch contract, as a checker both hosts are tested against.

NeMo-RL calls a policy loss as ``loss_fn(next_token_logprobs=[B, S-1], data=..., global_valid_seqs=,
global_valid_toks=)`` where every per-token data tensor is ``[B, S]`` indexed by token position
(used as ``[:, 1:]``), per-sample tensors are 1-D ``[B]``, and the global counts are those of
the whole optimizer step (``nemo_rl/models/*/data.py:process_global_batch``). A value loss
gets ``logits`` = right-shifted values ``[B, S]``. ``check_*`` raise ``AssertionError`` with
the violated rule; :class:`ContractRecorder` wraps a loss and checks every call. The policy batch's
keys, shapes and dtypes are ``nemo_granular.batch_schema.POLICY_BATCH``'s.
"""

from __future__ import annotations

import torch

from nemo_granular.batch_schema import GUARANTEED_KEYS, POLICY_BATCH

POLICY_KEYS = GUARANTEED_KEYS  # every policy-loss call carries them
VALUE_KEYS = ("token_mask", "sample_mask", "rewards")


def _common(data, B: int, S: int) -> None:
    for k, v in data.items():
        if not torch.is_tensor(v):
            continue
        assert v.shape[0] == B, f"data['{k}'] has {v.shape[0]} rows, expected {B}"
        if v.dim() > 1:
            assert v.shape[1] == S, f"data['{k}'] has width {v.shape[1]}, expected S={S} (NeMo-RL's hard shape rule)"
    sm = data["sample_mask"]
    assert sm.dim() == 1, f"data['sample_mask'] must be 1-D [B], got {tuple(sm.shape)}"
    tm = data["token_mask"]
    assert bool((tm[:, 0] == 0).all()), "token_mask[:, 0] must be 0 (column 0 is a prompt token)"


def check_policy_loss_call(next_token_logprobs, data, global_valid_seqs, global_valid_toks) -> None:
    assert next_token_logprobs.dim() == 2, "next_token_logprobs must be [B, S-1]"
    B, S = next_token_logprobs.shape[0], next_token_logprobs.shape[1] + 1
    for k in POLICY_KEYS:
        assert k in data, f"data['{k}'] missing"
    _common(data, B, S)
    for key in POLICY_BATCH:  # the declared shape of every schema key present
        if key.name in data and torch.is_tensor(data[key.name]):
            want = {"[B]": (B,), "[B, S]": (B, S), "[B, S-1]": (B, S - 1)}[key.shape]
            got = tuple(data[key.name].shape)
            assert got == want, f"data['{key.name}'] has shape {got}, the batch schema says {key.shape} = {want}"
    tm = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    assert torch.is_tensor(global_valid_toks) and global_valid_toks.dim() == 0, "global_valid_toks must be a scalar"
    assert torch.is_tensor(global_valid_seqs) and global_valid_seqs.dim() == 0, "global_valid_seqs must be a scalar"
    assert float(global_valid_toks) >= float(tm.sum()) - 1e-6, "global_valid_toks smaller than this call's tokens"
    assert float(global_valid_seqs) >= float(data["sample_mask"].sum()) - 1e-6, "global_valid_seqs too small"
    if "granular_group_ids" in data:
        ids = data["granular_group_ids"]
        assert ids.dtype == torch.int32, "granular_group_ids must be int32 (nemo_granular.batch_schema)"
        assert bool(((ids >= 0) == (data["token_mask"] > 0)).all()), (
            "granular_group_ids must be -1 exactly outside the response"
        )
    if "prev_entropy" in data:
        ent = data["prev_entropy"]
        assert ent.is_floating_point(), "prev_entropy must be floating point"
        assert bool((ent[data["token_mask"] > 0] >= -1e-5).all()), "prev_entropy must be >= 0 on response tokens"
    # generation logprobs sit at the sampled token's own column: zero on prompt and padding
    gen = data["generation_logprobs"]
    assert bool((gen[data["token_mask"] == 0] == 0).all()), "generation_logprobs must be 0 outside the response"


def check_value_loss_call(logits, data, global_valid_seqs, global_valid_toks) -> None:
    values = logits.squeeze(-1) if logits.dim() == 3 else logits
    assert values.dim() == 2, "value logits must be [B, S] or [B, S, 1]"
    for k in VALUE_KEYS:
        assert k in data, f"data['{k}'] missing"
    _common(data, values.shape[0], values.shape[1])
    r = data["rewards"]
    assert r.dim() == 1 and bool(((r == 0) | (r == 1)).all()), "rewards must be 1-D and binary for SPPO"


class ContractRecorder:
    """Wraps a loss object: checks every call against the contract and counts the calls."""

    def __init__(self, loss, checker):
        self.loss, self.checker, self.calls = loss, checker, 0

    def __getattr__(self, name):
        return getattr(self.loss, name)

    def __call__(self, *args, **kwargs):
        first = next(iter(k for k in ("next_token_logprobs", "logits") if k in kwargs))
        self.checker(kwargs[first], kwargs["data"], kwargs["global_valid_seqs"], kwargs["global_valid_toks"])
        self.calls += 1
        return self.loss(*args, **kwargs)
