"""The attention the Megatron worker runs on CPU: Megatron's local GPT layer spec with a core
attention that also takes what only Transformer Engine's attention takes on a GPU (packed THD
sequences and context parallelism). Installed by :mod:`cpu_stand_ins.megatron` in place of
Megatron-Bridge's Transformer Engine spec.
"""

from __future__ import annotations

import torch


def cpu_layer_spec(config):
    """Megatron's own local (non-Transformer-Engine) GPT layer spec for the provider's config, with
    :class:`CpuCoreAttention` as the core attention (what TE's ``DotProductAttention`` does there)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts,
        moe_grouped_gemm=config.moe_grouped_gemm,
        qk_layernorm=config.qk_layernorm,
        normalization=config.normalization,
    )
    spec.submodules.self_attention.submodules.core_attention = CpuCoreAttention
    return spec


class CpuCoreAttention(torch.nn.Module):
    """Stand-in for Transformer Engine's core attention, which the GPU path uses for what Megatron's
    local ``DotProductAttention`` refuses: packed sequences (THD) and context parallelism.

    Unpacked batches without CP go to Megatron's own ``DotProductAttention``. Packed batches: causal
    softmax attention (float32 softmax) inside each ``cu_seqlens_q_padded`` segment; with CP each
    rank holds chunks ``r`` and ``2·CP−1−r`` of every segment (NeMo-RL's zig-zag layout), so keys and
    values are all-gathered over the CP group (autograd: the gradient is summed back) and masked by
    their global positions. Plain math, no kernel: the tests compare the result with HF.
    """

    def __init__(
        self,
        config,
        layer_number,
        attn_mask_type,
        attention_type,
        attention_dropout=None,
        softmax_scale=None,
        cp_comm_type=None,
        pg_collection=None,
    ):
        super().__init__()
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        assert not config.apply_query_key_layer_scaling and config.softmax_type == "vanilla"
        self.cp_group = pg_collection.cp
        self.scale = softmax_scale if softmax_scale is not None else config.kv_channels**-0.5
        self.local = None
        if config.context_parallel_size == 1:
            self.local = DotProductAttention(
                config,
                layer_number,
                attn_mask_type,
                attention_type,
                attention_dropout,
                softmax_scale,
                cp_comm_type,
                pg_collection,
            )

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        assert attention_bias is None
        if packed_seq_params is None:
            assert self.local is not None, "context parallelism needs packed sequences"
            return self.local(query, key, value, attention_mask, attn_mask_type=attn_mask_type)
        cu = packed_seq_params.cu_seqlens_q_padded
        cu = (packed_seq_params.cu_seqlens_q if cu is None else cu).long().cpu()
        cp = self.cp_group.size()
        q_pos, q_seq = _zigzag_positions(cu, cp, self.cp_group.rank())
        if cp > 1:
            key = _GatherCat.apply(key, self.cp_group)
            value = _GatherCat.apply(value, self.cp_group)
            k_pos, k_seq = (torch.cat(t) for t in zip(*(_zigzag_positions(cu, cp, r) for r in range(cp))))
        else:
            k_pos, k_seq = q_pos, q_seq
        rep = query.shape[1] // key.shape[1]  # grouped-query attention: query head h reads key group h // rep
        k = key.float().repeat_interleave(rep, dim=1)
        v = value.float().repeat_interleave(rep, dim=1)
        scores = torch.einsum("qhd,khd->hqk", query.float(), k) * self.scale
        allowed = (q_seq[:, None] == k_seq[None, :]) & (k_pos[None, :] <= q_pos[:, None])
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        out = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
        return out.reshape(out.shape[0], -1)


class _GatherCat(torch.autograd.Function):
    """All-gather along dim 0 over ``group``; backward: every rank's gradient for this rank's rows,
    summed (an all-reduce, then this rank's slice: gloo has no reduce-scatter, and torch's own
    ``distributed.nn`` fallback passes a group rank where ``scatter`` wants a global one)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.rows = group, x.shape[0]
        parts = [torch.empty_like(x) for _ in range(group.size())]
        torch.distributed.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        r = ctx.group.rank()
        return grad[r * ctx.rows : (r + 1) * ctx.rows], None


def _zigzag_positions(cu: torch.Tensor, cp: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(global flat position, segment index) of every token CP rank ``rank`` holds, in its order:
    chunks ``rank`` and ``2·cp−1−rank`` of each segment of ``cu`` (one chunk of ``cp == 1``)."""
    lens = cu[1:] - cu[:-1]
    local = lens // cp
    seq = torch.repeat_interleave(torch.arange(len(lens)), local)
    t = torch.arange(int(local.sum())) - torch.repeat_interleave(torch.cumsum(local, 0) - local, local)
    if cp == 1:
        return cu[seq] + t, seq
    c = (lens // (2 * cp))[seq]
    first = t < c
    chunk = torch.where(first, torch.full_like(t, rank), torch.full_like(t, 2 * cp - 1 - rank))
    return cu[seq] + chunk * c + torch.where(first, t, t - c), seq
