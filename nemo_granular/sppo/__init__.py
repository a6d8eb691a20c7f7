"""SPPO (sequence-level PPO, docs/algorithms/math.md §6–§7) on NeMo-RL's PPO loop.

* :mod:`.critic` — pure, torch-only prompt de-duplication / short-batch / scatter functions
  and :class:`~.critic.PromptOnlyValue`, the wrapper around NeMo-RL's ``Value`` that makes
  the critic forward only the unique prompts of a batch.
* :mod:`.diagnostics` — critic calibration metrics (BCE, accuracy, Brier, Pearson/Spearman
  of σ(V) against the empirical pass rate, SPPO Figure 7).
* :mod:`.validate` — the ``sppo:`` config section, binary-reward / N / KL checks, and the
  same-tokenizer check for a smaller decoupled critic.
* :mod:`.install` — reversible installation of the ``sppo`` advantage estimator into
  ``nemo_rl.algorithms.ppo._create_advantage_estimator``.

Everything here imports with torch alone; NeMo-RL / transformers are imported lazily.
"""

from .critic import (
    PromptOnlyValue,
    build_value_query_batch,
    build_value_train_batch,
    gather_prompt_values,
    prompt_value_columns,
    scatter_prompt_values,
    unique_prompt_index,
    unique_prompts,
)
from .diagnostics import critic_diagnostics

__all__ = [
    "PromptOnlyValue",
    "build_value_query_batch",
    "build_value_train_batch",
    "gather_prompt_values",
    "prompt_value_columns",
    "scatter_prompt_values",
    "unique_prompt_index",
    "unique_prompts",
    "critic_diagnostics",
]
