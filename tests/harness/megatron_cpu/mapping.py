"""Megatron (local spec) parameters of every rank → HF Qwen3 / Qwen3-MoE names, written here from the
layouts (not Megatron-Bridge's mapping, which is what the weight check tests).

Rank side: :func:`local_pieces` names each local tensor by its GLOBAL layer / expert index and
keeps only the flat range this rank's distributed optimizer owns (the whole tensor without one), so
data-parallel ranks contribute disjoint parts. Parent side: :func:`assemble` joins the owned ranges,
concatenates tensor-parallel shards and splits fused tensors into the HF ones:

* ``linear_qkv`` rows are ``[q (heads per group × d), k (d), v (d)]`` per query group, groups split
  over TP; ``linear_fc1`` rows are ``[gate; up]`` per TP shard; row-parallel ``linear_proj`` /
  ``linear_fc2`` split columns; embedding / output layer split the vocabulary rows.
* MoE (``SequentialMLP`` local experts): expert ``e`` lives on EP rank ``e // (E / EP)``.
"""

from __future__ import annotations

import re
from collections import defaultdict

import torch


def _owned_ranges(optimizer) -> dict | None:
    """param → (start, end) of its flattened elements this rank's distributed optimizer owns (a
    parameter it owns nothing of is absent); None without a distributed optimizer (all owned)."""
    opts = getattr(optimizer, "chained_optimizers", [optimizer])
    if not any(hasattr(opt, "gbuf_ranges") for opt in opts):
        return None
    out = {}
    for opt in opts:
        for per_dtype in getattr(opt, "gbuf_ranges", []):
            for buckets in per_dtype.values():
                for bucket in buckets:
                    for param, ranges in bucket["param_map"].items():
                        out[param] = (ranges["param"].start, ranges["param"].end)
    return out


def _global_name(name: str, layer_offsets: dict, expert_offset: int) -> str:
    name = name.removeprefix("module.").removeprefix("module.")
    m = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
    if m:
        name = f"decoder.layers.{layer_offsets[int(m.group(1))]}.{m.group(2)}"
    m = re.match(r"(.*mlp\.experts\.local_experts\.)(\d+)(\..*)", name)
    if m:
        name = f"{m.group(1)}{int(m.group(2)) + expert_offset}{m.group(3)}"
    return name


def local_pieces(model, optimizer, tensors: dict[str, torch.Tensor] | None = None) -> dict:
    """This rank's owned flat pieces of ``tensors`` (default: the parameters), by global name.

    ``tensors`` maps the model's parameter names to a tensor of the parameter's shape (e.g. its
    ``main_grad``). Returns ``{global_name: (tp_rank, shape, start, flat_piece)}``.
    """
    from megatron.core import parallel_state as ps

    params = dict(model.named_parameters())
    owned = _owned_ranges(optimizer)
    decoder = model.module.module.decoder if hasattr(model.module, "module") else model.module.decoder
    offsets = {i: layer.layer_number - 1 for i, layer in enumerate(decoder.layers)}
    cfg = decoder.config
    experts_here = (cfg.num_moe_experts or 0) // ps.get_expert_model_parallel_world_size()
    expert_offset = ps.get_expert_model_parallel_rank() * experts_here
    out = {}
    for name, p in params.items():
        value = (tensors or {}).get(name, p) if tensors is not None else p
        if value is None:
            continue
        start, end = (0, p.numel()) if owned is None or not p.requires_grad else owned.get(p, (0, 0))
        is_expert = ".experts." in name
        tp = ps.get_expert_tensor_parallel_rank() if is_expert else ps.get_tensor_model_parallel_rank()
        out[_global_name(name, offsets, expert_offset)] = (
            tp,
            tuple(p.shape),
            start,
            value.detach().reshape(-1)[start:end].double().clone(),
        )
    return out


def _join(per_rank: list[dict]) -> dict:
    """{(global_name, tp): full tensor} from the owned pieces of all ranks."""
    parts = defaultdict(list)
    shapes = {}
    for pieces in per_rank:
        for name, (tp, shape, start, flat) in pieces.items():
            parts[(name, tp)].append((start, flat))
            shapes[(name, tp)] = shape
    full = {}
    for key, items in parts.items():
        flat = torch.full((int(torch.tensor(shapes[key]).prod()),), float("nan"), dtype=torch.float64)
        for start, piece in items:
            flat[start : start + piece.numel()] = piece
        assert not torch.isnan(flat).any(), f"{key}: parts of the tensor are owned by no rank"
        full[key] = flat.view(shapes[key])
    return full


def _replica(name: str, shards: dict) -> torch.Tensor:
    """A tensor every tensor-parallel rank holds whole (norms, router): the replicas must agree."""
    first = shards[min(shards)]
    for tp, t in shards.items():
        torch.testing.assert_close(t, first, rtol=0, atol=1e-12, msg=f"{name}: TP rank {tp} differs from rank 0")
    return first


def assemble(per_rank: list[dict], hf_config) -> dict[str, torch.Tensor]:
    """HF-named full float64 tensors from every rank's :func:`local_pieces`."""
    full = _join(per_rank)
    by_name = defaultdict(dict)
    for (name, tp), t in full.items():
        by_name[name][tp] = t

    def cat(name, dim):
        shards = by_name[name]
        return torch.cat([shards[i] for i in sorted(shards)], dim=dim)

    H, d = hf_config.hidden_size, hf_config.head_dim
    nq, nkv = hf_config.num_attention_heads, hf_config.num_key_value_heads
    out = {}
    for name in by_name:
        m = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
        if name == "embedding.word_embeddings.weight":
            out["model.embed_tokens.weight"] = cat(name, 0)
        elif name == "output_layer.weight":
            out["lm_head.weight"] = cat(name, 0)
        elif name == "decoder.final_layernorm.weight":
            out["model.norm.weight"] = _replica(name, by_name[name])
        elif m:
            i, rest = m.group(1), m.group(2)
            hf = f"model.layers.{i}."
            if rest == "input_layernorm.weight":
                out[hf + "input_layernorm.weight"] = _replica(name, by_name[name])
            elif rest == "pre_mlp_layernorm.weight":
                out[hf + "post_attention_layernorm.weight"] = _replica(name, by_name[name])
            elif rest in ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"):
                out[hf + f"self_attn.{rest.split('.')[1][0]}_norm.weight"] = _replica(name, by_name[name])
            elif rest == "self_attention.linear_proj.weight":
                out[hf + "self_attn.o_proj.weight"] = cat(name, 1)
            elif rest == "self_attention.linear_qkv.weight":
                qkv = cat(name, 0).view(nkv, (nq // nkv + 2) * d, H)
                q, k, v = qkv.split([nq // nkv * d, d, d], dim=1)
                out[hf + "self_attn.q_proj.weight"] = q.reshape(nq * d, H)
                out[hf + "self_attn.k_proj.weight"] = k.reshape(nkv * d, H)
                out[hf + "self_attn.v_proj.weight"] = v.reshape(nkv * d, H)
            elif rest == "mlp.linear_fc1.weight":
                halves = [by_name[name][t].chunk(2, 0) for t in sorted(by_name[name])]
                out[hf + "mlp.gate_proj.weight"] = torch.cat([g for g, _ in halves], 0)
                out[hf + "mlp.up_proj.weight"] = torch.cat([u for _, u in halves], 0)
            elif rest == "mlp.linear_fc2.weight":
                out[hf + "mlp.down_proj.weight"] = cat(name, 1)
            elif rest == "mlp.router.weight":
                out[hf + "mlp.gate.weight"] = _replica(name, by_name[name])
            elif rest.startswith("mlp.experts.local_experts."):
                pass  # stacked below
            else:
                raise KeyError(f"no HF name for Megatron parameter {name}")
        else:
            raise KeyError(f"no HF name for Megatron parameter {name}")
    experts = defaultdict(dict)
    for name in by_name:
        m = re.match(r"decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight", name)
        if m:
            experts[(int(m.group(1)), m.group(3))][int(m.group(2))] = by_name[name][0]
    for (i, which), per_expert in experts.items():
        stacked = torch.stack([per_expert[e] for e in sorted(per_expert)])
        out[f"model.layers.{i}.mlp.experts.{'gate_up_proj' if which == 'linear_fc1' else 'down_proj'}"] = stacked
    return out
