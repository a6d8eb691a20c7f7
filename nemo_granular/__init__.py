"""nemo-granular: granular importance ratios (SSPO, ESPO, GSPO) and SPPO for NeMo-RL.

Imports with torch alone; NeMo-RL, Megatron, vLLM, Ray and transformers are optional and
imported lazily where they are used.
"""

from .advantages import build_advantage_estimator
from .config import PRESETS, GranularConfig, PolicyLossConfig
from .losses import GranularPolicyLoss, SequenceValueLoss

__version__ = "0.1.0"
__all__ = ["GranularPolicyLoss", "SequenceValueLoss", "build_advantage_estimator", "GranularConfig",
           "PolicyLossConfig", "PRESETS", "__version__"]
