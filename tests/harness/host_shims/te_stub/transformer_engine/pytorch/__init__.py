"""``transformer_engine.pytorch`` placeholder: the same inert attributes as the package (see there)."""

from transformer_engine import __getattr__  # noqa: F401  (PEP 562: module attribute fallback)
