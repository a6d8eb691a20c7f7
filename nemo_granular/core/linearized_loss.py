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
    """A scalar whose gradient with respect to ``logp`` is the given tensor times ``grad_sign``:
    ``value`` and ``grad_sign``·``grad`` = d value / d logp are computed by the caller without
    autograd (the loss is −J: it passes J's gradient and −1, and the sign is applied to the 0-d
    incoming gradient instead of in a pass over ``grad``)."""

    @staticmethod
    def forward(ctx, logp, value, grad, grad_sign: float = 1.0):
        ctx.save_for_backward(grad)
        ctx.logp_dtype = logp.dtype
        ctx.grad_sign = grad_sign
        return value.clone()

    @staticmethod
    def backward(ctx, grad_out):
        (grad,) = ctx.saved_tensors
        scale = grad_out if ctx.grad_sign == 1 else grad_out * ctx.grad_sign
        return (grad * scale).to(ctx.logp_dtype), None, None, None
