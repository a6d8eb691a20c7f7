"""The independent side of the comparison: the same HF checkpoint run by transformers in float64.

``hf_logprobs_entropy`` gives NeMo-RL's conventions (token columns: column t holds log p(x_t | x_<t),
column 0 and padding 0; entropy of softmax(logits / T) in the same columns) so the worker's
``get_logprobs_with_entropy`` is compared value for value.

Qwen3-MoE routing (:func:`routing`): the experts of each token are chosen by a given rule — the
router's own top-k, a rollout engine's rule, or routes replayed from a rollout, as Megatron's
``RouterReplay`` replays them — and weighted by the softmax of the router logits over the chosen
experts (= HF's ``norm_topk_prob`` top-k weights), in float64.
"""

from __future__ import annotations

import contextlib

import torch

F64 = torch.float64


def load_hf(model_dir: str, dtype=F64):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation="eager", experts_implementation="eager"
    )  # grouped_mm has no float64
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


def next_token_logprobs(logits_: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits_[:, :-1].to(F64), -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def train_step(model, data: dict, loss_fn, *, frozen: set[str]):
    """Loss and gradients of the granular loss over the whole global batch (one call, global
    normalisers), by autograd through the HF model; ``frozen`` parameters get none."""
    ids, lengths = data["input_ids"], data["input_lengths"]
    d64 = {k: (v.to(F64) if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in data.items()}
    gvs = d64["sample_mask"].sum()
    gvt = (d64["token_mask"][:, 1:] * d64["sample_mask"][:, None]).sum()
    named = {n: p for n, p in model.named_parameters() if n not in frozen}
    loss, metrics = loss_fn(next_token_logprobs(logits(model, ids, lengths), ids), d64, gvs, gvt)
    grads = dict(zip(named, torch.autograd.grad(loss, list(named.values()))))
    norm = torch.sqrt(sum((g**2).sum() for g in grads.values()))
    return {"loss": loss.detach(), "metrics": metrics, "grads": grads, "grad_norm": norm}


def adamw_first_step(
    params: dict, grads: dict, grad_norm: float, *, clip: float, lr: float, weight_decay: float, eps: float
) -> dict:
    """The update Megatron's optimizer makes from ``grads`` on its first step: clip by the global
    norm (``clip / (norm + 1e-6)`` when above ``clip``), then AdamW with bias-corrected moments
    g and g²: Δθ = −lr·wd·θ (2-D weights only: no decay for norms) − lr·g/(|g| + eps)."""
    coeff = min(1.0, clip / (grad_norm + 1e-6))
    update = {}
    for n, g in grads.items():
        g = g.to(F64) * coeff
        decay = weight_decay * params[n].to(F64) if params[n].dim() > 1 else 0.0
        update[n] = -lr * decay - lr * g / (g.abs() + eps)
    return update


@contextlib.contextmanager
def routing(model, select):
    """Inside the block every Qwen3-MoE router of ``model`` routes the token rows ``[B*S, H]`` of
    layer ``i`` to ``select(i, router_logits [B*S, E]) -> expert ids [B*S, K]``."""
    routers = [layer.mlp.gate for layer in model.model.layers]

    def forward(i, router):
        def routed(hidden_states):
            logits_ = torch.nn.functional.linear(hidden_states.reshape(-1, router.hidden_dim), router.weight)
            idx = select(i, logits_.detach()).long()
            weights = torch.softmax(logits_.gather(1, idx), dim=-1)
            return logits_, weights.to(logits_.dtype), idx

        return routed

    for i, r in enumerate(routers):
        r.forward = forward(i, r)
    try:
        yield
    finally:
        for r in routers:
            del r.forward  # the class's forward again


def replay(routes: torch.Tensor):
    """``select`` for :func:`routing`: the expert ids of ``routes [B, S, L, K]`` (layer ``i``: ``[:, :, i]``)."""
    B, S, _, K = routes.shape
    return lambda i, _logits: routes[:, :, i].reshape(B * S, K)
