"""The attention a DTensor-v2 worker runs on CPU with sequence packing: transformers'
``flash_attention_2`` (flash-attn's varlen CUDA kernel) replaced by plain causal softmax attention
inside each packed sequence.

With packing, NeMo-RL's DTensor-v2 worker feeds the model one row ``[1, T]`` holding several
sequences (``pack_sequences``) with ``attention_mask=None``, ``position_ids`` restarting at 0 for
each sequence, and ``flash_attn_kwargs`` (``cu_seqlens_q``/``k`` from ``get_flash_attention_kwargs``).
transformers' flash-attention integration finds the sequences where ``position_ids`` restarts
(or from ``cu_seq_lens_q`` when given); so does this function. When NeMo-RL's ``flash_attn_kwargs``
reach it, the boundaries must agree with its ``cu_seqlens_q`` (a disagreement raises). Tokens
after the last sequence (``pack_sequences`` pads to ``min_seq_len`` with position 0) each attend
to themselves only, as in flash-attn. Test code only; plain math, no kernel.
"""

from __future__ import annotations

import torch

NAME = "flash_attention_2"


def _boundaries(position_ids: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """Sequence starts of the packed row (``[n+1]`` cumulative, ending at T)."""
    T = position_ids.shape[-1]
    if kwargs.get("cu_seq_lens_q") is not None:
        cu = kwargs["cu_seq_lens_q"].to(torch.long).cpu()
    else:
        starts = torch.nonzero(position_ids.reshape(-1).cpu() == 0).reshape(-1)
        cu = torch.cat([starts, torch.tensor([T])])
    fa = kwargs.get("flash_attn_kwargs")
    given = getattr(fa, "cu_seqlens_q", None) if not isinstance(fa, dict) else fa.get("cu_seqlens_q")
    if given is not None:
        given = given.to(torch.long).cpu()
        if not set(given.tolist()) <= set(cu.tolist()):
            raise AssertionError(
                f"packed attention: cu_seqlens_q {given.tolist()} is not a subset of the "
                f"boundaries {cu.tolist()} found in position_ids"
            )
    return cu


def varlen_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout: float = 0.0,
    scaling=None,
    sliding_window=None,
    softcap=None,
    **kwargs,
):
    """transformers' attention-interface signature: ``query`` ``[B, H, T, D]``, ``key``/``value``
    ``[B, Hkv, T, D]``; returns ``([B, T, H, D], None)``."""
    if attention_mask is not None or sliding_window is not None or softcap is not None or dropout:
        raise NotImplementedError("CPU varlen attention: only the packed, causal, mask-free case is stood in for")
    B, H, T, D = query.shape
    if B != 1:
        raise NotImplementedError("CPU varlen attention: packed input is one row")
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        raise ValueError("CPU varlen attention: packed input needs position_ids")
    cu = _boundaries(position_ids, kwargs)
    seg = torch.zeros(T, dtype=torch.long)
    for k in range(len(cu) - 1):
        seg[int(cu[k]) : int(cu[k + 1])] = k
    seg[int(cu[-1]) :] = torch.arange(T - int(cu[-1])) + len(cu)  # anything after: alone
    pos = torch.arange(T)
    allowed = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])
    rep = H // key.shape[1]
    k = key.repeat_interleave(rep, dim=1)
    v = value.repeat_interleave(rep, dim=1)
    scale = scaling if scaling is not None else D**-0.5
    scores = torch.matmul(query.float(), k.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v.float()).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


def install() -> None:
    """Register :func:`varlen_attention` as transformers' ``flash_attention_2`` (and no mask builder:
    flash-attn takes no mask) in this process, and let a model load with ``attn_implementation=
    "flash_attention_2"`` (transformers checks that the flash-attn package is installed)."""
    from transformers import AttentionInterface, PreTrainedModel
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface._global_mapping[NAME] = varlen_attention
    AttentionMaskInterface._global_mapping[NAME] = lambda *args, **kwargs: None
    from transformers import modeling_utils

    # transformers asks whether the flash-attn package is installed (else it fetches a hub kernel)
    modeling_utils.FLASH_ATTENTION_COMPATIBILITY_MATRIX[2]["general_availability_check"] = lambda: True
    real_preload = modeling_utils.lazy_import_flash_attention  # loads flash-attn's kernels up front
    modeling_utils.lazy_import_flash_attention = lambda impl, *a, **k: (
        None if impl == NAME else real_preload(impl, *a, **k)
    )
    real = PreTrainedModel._flash_attn_can_dispatch

    def can_dispatch(self, *args, flash_attn_version=2, **kwargs):
        return True if flash_attn_version == 2 else real(self, *args, flash_attn_version=flash_attn_version, **kwargs)

    PreTrainedModel._flash_attn_can_dispatch = can_dispatch
