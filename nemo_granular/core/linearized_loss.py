"""The policy loss as autograd sees it: a scalar whose gradient with respect to the logprobs is given.

The clipped objective is linear in the per-token surrogate, so its gradient with respect to the
logprobs is written in closed form (:mod:`nemo_granular.core.objective`) and handed to autograd
here: one saved tensor and one backward multiply instead of a ~20-node graph (every autograd node
adds a backward pass; measured in docs/benchmarks.md, "Policy loss hot path").
"""

from __future__ import annotations

import torch

__all__ = ["LinearizedLoss"]


class LinearizedLoss(torch.autograd.Function):
    """A scalar whose gradient with respect to ``logp`` is the given tensor: ``value`` and
    ``grad`` = d value / d logp are computed by the caller without autograd."""

    @staticmethod
    def forward(ctx, logp, value, grad):
        ctx.save_for_backward(grad)
        ctx.logp_dtype = logp.dtype
        return value.clone()

    @staticmethod
    def backward(ctx, grad_out):
        (grad,) = ctx.saved_tensors
        return (grad * grad_out).to(ctx.logp_dtype), None, None
