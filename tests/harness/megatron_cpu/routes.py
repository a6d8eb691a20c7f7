"""Router-replay routes for the Megatron-worker tests, in the form NeMo-RL receives them from a rollout.

With ``policy.router_replay`` (R3) NeMo-RL replays, in every Megatron forward of π_old and of the
training step, the experts the rollout engine chose for each token. The "engine" here is the same
checkpoint run by transformers in float64 with one rule changed: on a fixed third of the token rows
of each layer it takes the router's 1st and 3rd choice instead of its top 2 (a bfloat16 engine
disagrees with the trainer on near-ties; here the disagreement is fixed, so that a worker that
routed with its own router could not match). The routes are recorded as vLLM returns them — the
prompt tokens' and the generated tokens' but the last one's, ``[tokens, layers, K]`` — and aligned
by NeMo-RL's own ``pad_and_align_routed_expert_indices``, as its vLLM worker does, into the
``routed_experts [B, S, layers, K]`` tensor (int8 for 4 experts) that rides the policy's batches.
"""

from __future__ import annotations

import types

import torch

EVERY = 3  # one token row in EVERY (per layer, offset by the layer) takes the 1st + 3rd choice


def rollout_routes(hf, ids: torch.Tensor, lengths: torch.Tensor, prompt_lengths: torch.Tensor) -> torch.Tensor:
    from nemo_rl.models.generation.interfaces import get_num_routed_experts, resolve_routed_experts_dtype
    from nemo_rl.models.generation.vllm.utils import pad_and_align_routed_expert_indices

    from megatron_cpu import reference

    B, S = ids.shape
    K = hf.config.num_experts_per_tok
    rows = torch.arange(B * S)
    chosen: dict[int, torch.Tensor] = {}

    def engine(i, router_logits):
        ranked = router_logits.topk(K + 1, dim=-1).indices
        pick = ranked[:, :K].clone()
        other = (rows + i) % EVERY == 0
        pick[other, K - 1] = ranked[other, K]
        chosen[i] = pick
        return pick

    with torch.no_grad(), reference.routing(hf, engine):
        reference.logits(hf, ids, lengths)
    per_token = torch.stack([chosen[i] for i in sorted(chosen)], dim=1).view(B, S, len(chosen), K)
    dtype = resolve_routed_experts_dtype(get_num_routed_experts(hf.config))
    aligned = []
    for b in range(B):
        n, p = int(lengths[b]), int(prompt_lengths[b])
        request = types.SimpleNamespace(prompt_routed_experts=per_token[b, :p].numpy(), num_cached_tokens=0)
        completion = types.SimpleNamespace(routed_experts=per_token[b, p : n - 1].numpy())
        aligned.append(
            pad_and_align_routed_expert_indices(
                request,
                completion,
                valid_length=n,
                padded_length=S,
                device=torch.device("cpu"),
                require_complete_routed_experts=True,
                allow_missing_routed_experts_fallback=False,
                routed_experts_dtype=dtype,
            )
        )
    return torch.stack(aligned)
