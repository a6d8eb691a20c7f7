"""NeMo-RL integration of the granular GRPO-family losses (SSPO, ESPO, GSPO).

Modules (NeMo-RL is imported only inside functions, or by the worker-extension modules that
only NeMo-RL's workers import):

- :mod:`.estimators` — ``install()`` / ``uninstall()`` / ``installed()`` and the generic
  ``patch_estimator_factory(module, names_to_factory)``: our advantage estimators in
  NeMo-RL's ``_create_advantage_estimator``.
- :mod:`.workers` — pure entropy post-processing + extension class names;
  :mod:`.megatron_worker` / :mod:`.dtensor_worker` — the worker extensions
  (``get_logprobs_with_entropy``).
- :mod:`.policy` — driver-side ``GranularPolicy`` (via ``setup(policy_factory=...)``) and the
  group-id computation on the driver batch.
- :mod:`.fallback` — entropy from the current logits (LOGIT-input wrapper loss) + the
  rollout-split warning.
- :mod:`.environments` — ESPO's verification-failure flag (``espo_math`` environment).

Written against NeMo-RL commit 7ea279ab (see docs/nemo-rl.md).
"""

NEMO_RL_COMMIT = "7ea279abfbeb698b092856d0dab61e7cf39bc909"

from .estimators import install, installed, patch_estimator_factory, uninstall  # noqa: E402

__all__ = ["NEMO_RL_COMMIT", "install", "uninstall", "installed", "patch_estimator_factory"]
