"""The SPPO critic as a Hugging Face sequence classifier, and V(prompt).

SPPO (docs/algorithms/math.md §7): the critic is a causal LM body with a scalar head; only the prompt matters, and
``V(s_p) = σ(v)`` where ``v`` is the head's logit at the **last prompt token** — an estimate of
``P(reward = 1 | prompt)``. Exported as ``*ForSequenceClassification`` with ``num_labels=1``,
which pools at the last non-pad token, so feeding the prompt alone reproduces the trained
read-out exactly. The meaning is written to ``config.sppo_value`` (:data:`SPPO_VALUE`) and the
model card.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["SPPO_VALUE", "check_critic_config", "annotate_critic_config", "prompt_values"]

SPPO_VALUE = {
    "activation": "sigmoid",
    "meaning": "P(reward=1 | prompt)",
    "read_position": "last prompt token",
    "input": "prompt only (no response tokens)",
    "algorithm": "sppo",
}


def check_critic_config(config, origin: str) -> None:
    """The critic must be a one-logit sequence classifier with a pad token (the HF pooling needs it)."""
    arch = (getattr(config, "architectures", None) or [""])[0]
    if not arch.endswith("ForSequenceClassification"):
        raise ValueError(f"{origin}: critic architecture is {arch or 'unset'!r}, expected *ForSequenceClassification")
    if int(getattr(config, "num_labels", 0)) != 1:
        raise ValueError(f"{origin}: critic num_labels={config.num_labels}, expected 1 (scalar value head)")


def annotate_critic_config(config) -> None:
    config.num_labels = 1
    config.sppo_value = dict(SPPO_VALUE)


@torch.no_grad()
def prompt_values(model, prompts_ids: Sequence[torch.Tensor]) -> torch.Tensor:
    """Head logits ``v`` (shape ``[n]``) of each prompt, one unpadded forward per prompt, so the
    read position is exactly the last prompt token. ``V = sigmoid(v)``."""
    return torch.stack([model(input_ids=ids.view(1, -1)).logits.float().reshape(-1)[0] for ids in prompts_ids])
