"""NeMo-RL's loss-protocol enums, imported lazily.

Inside a NeMo-RL environment the plugin uses NeMo-RL's own enum classes (the framework
compares ``loss_fn.input_type == LossInputType.LOGPROB``); without NeMo-RL, local enums
with the same names and values stand in, so the package imports with torch alone.
"""

from __future__ import annotations

import enum

try:  # pragma: no cover - exercised only where NeMo-RL is installed
    from nemo_rl.algorithms.loss.interfaces import LossInputType, LossType, MetricNormalizer
    HAVE_NEMO_RL = True
except Exception:  # noqa: BLE001 - any import failure means "not inside NeMo-RL"
    HAVE_NEMO_RL = False

    class LossType(enum.Enum):  # type: ignore[no-redef]
        TOKEN_LEVEL = "token_level"
        SEQUENCE_LEVEL = "sequence_level"

    class MetricNormalizer(enum.Enum):  # type: ignore[no-redef]
        TOKENS = "tokens"
        SEQUENCES = "sequences"
        NONE = "none"

    class LossInputType(enum.Enum):  # type: ignore[no-redef]
        LOGIT = "logit"
        LOGPROB = "logprob"
        DISTILLATION = "distillation"
        DISTILLATION_CROSS_TOKENIZER = "distillation_cross_tokenizer"
        DRAFT = "draft"

__all__ = ["LossType", "MetricNormalizer", "LossInputType", "HAVE_NEMO_RL"]
