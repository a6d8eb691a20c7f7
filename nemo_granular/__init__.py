"""nemo-granular: granular importance ratios (SSPO, ESPO, GSPO) and SPPO for NeMo-RL.

Imports with torch alone; NeMo-RL, Megatron, vLLM, Ray and transformers are optional and
imported lazily where they are used.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"
# the public names, imported on first use (PEP 562): `nemo-granular` sub-commands that refuse bad input
# (a missing config file, an unknown key) answer before torch is imported (seconds)
_EXPORTS = {
    "GranularPolicyLoss": ".losses",
    "SequenceValueLoss": ".losses",
    "build_advantage_estimator": ".advantages",
    "GranularConfig": ".config",
    "PolicyLossConfig": ".config",
    "PRESETS": ".config",
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
