"""Advantage estimators with NeMo-RL's duck-typed interface (docs/algorithms/math.md §6).

``estimator.compute_advantage(prompt_ids, rewards, mask, **kwargs)`` as NeMo-RL's GRPO and
PPO loops call it (``nemo_rl/algorithms/advantage_estimator.py``); constructors take
``(estimator_config, loss_config)`` like NeMo-RL's. GRPO/ESPO return ``[B, S]``; SPPO returns
``(advantages, returns)`` like NeMo-RL's PPO estimators.
"""

from __future__ import annotations

import torch

from .config import AdvantageConfig, parse_advantage_config
from .core.advantages import espo_advantages, first_response_index, grpo_advantages, prompt_group_index, sppo_advantages

__all__ = ["GRPOEstimator", "ESPOEstimator", "SPPOEstimator", "ESTIMATORS", "build_advantage_estimator"]


def _broadcast(per_response: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return per_response.to(mask.device, torch.float32).unsqueeze(-1) * mask.float()


class GRPOEstimator:
    """GRPO: A_i = (R_i − mean_G R)/(std_G R + ε) per prompt group (leave-one-out / no-std options)."""

    def __init__(self, estimator_config=None, loss_config=None):
        self.cfg: AdvantageConfig = parse_advantage_config(estimator_config)
        self.last_metrics: dict = {}

    def _options(self):
        return dict(
            leave_one_out=self.cfg.use_leave_one_out_baseline,
            normalize_std=self.cfg.normalize_rewards,
            eps=self.cfg.epsilon,
        )

    def compute_advantage(self, prompt_ids, rewards, mask, **kwargs):
        adv = grpo_advantages(rewards.float(), prompt_group_index(prompt_ids.to(rewards.device)), **self._options())
        return _broadcast(adv, mask)


class ESPOEstimator(GRPOEstimator):
    """ESPO §3.5: failed verifications get A = 0 and leave the prompt's mean and std.

    The per-response flag comes as ``verification_failed=`` (bool ``[B]``) or inside
    ``repeated_batch[cfg.verification_failed_key]`` (the rollout batch NeMo-RL passes).
    """

    def compute_advantage(self, prompt_ids, rewards, mask, verification_failed=None, repeated_batch=None, **kwargs):
        key = self.cfg.verification_failed_key
        if verification_failed is None and repeated_batch is not None and key in repeated_batch:
            verification_failed = repeated_batch[key]
        if verification_failed is None:
            raise KeyError(
                f"ESPO advantage needs the per-response '{key}' flag (verification_failed= or repeated_batch['{key}'])"
            )
        failed = torch.as_tensor(verification_failed, device=rewards.device).bool().reshape(-1)
        if failed.shape[0] != rewards.shape[0]:
            raise ValueError(f"'{key}' has {failed.shape[0]} entries but rewards has {rewards.shape[0]}")
        adv = espo_advantages(
            rewards.float(), prompt_group_index(prompt_ids.to(rewards.device)), failed, **self._options()
        )
        self.last_metrics = {"verification_failed_frac": failed.float().mean().item()}
        return _broadcast(adv, mask)


class SPPOEstimator:
    """SPPO eq. 1: A_i = R_i − σ(v_i), returns = R_i, both broadcast over ``mask``.

    ``values`` is NeMo-RL's right-shifted ``[B, S]`` critic output (the logit of V(s_p) sits
    at the first response column) or a ``[B]`` tensor of logits.
    """

    def __init__(self, estimator_config=None, loss_config=None):
        self.cfg = parse_advantage_config(estimator_config)
        self.last_metrics: dict = {}

    def compute_advantage(self, prompt_ids, rewards, mask, values=None, **kwargs):
        if values is None:
            raise KeyError("SPPO advantage needs values= (the critic's logits)")
        r = rewards.float().reshape(-1)
        if ((r != 0) & (r != 1)).any():
            raise ValueError("SPPO needs binary rewards in {0, 1}: disable reward scaling/shaping")
        v = values.to(mask.device).float()
        if v.dim() == 2:
            v = v.gather(-1, first_response_index(mask)[:, None]).squeeze(-1)
        adv = sppo_advantages(r.to(v.device), v)
        rows = mask.bool().any(-1)  # rows without a response (sample_mask 0) carry no value
        self.last_metrics = {"critic_value_mean": torch.sigmoid(v)[rows].mean().item() if rows.any() else 0.0}
        return _broadcast(adv, mask), _broadcast(r, mask)


ESTIMATORS = {"grpo": GRPOEstimator, "espo": ESPOEstimator, "sppo": SPPOEstimator}


def build_advantage_estimator(config, loss_config=None):
    """Estimator object for ``config['name']`` (grpo | espo | sppo)."""
    cfg = parse_advantage_config(config)
    return ESTIMATORS[cfg.name](cfg, loss_config)
