"""``nemo-granular export``: checkpoints → Hugging Face model directories, verified by round trip.

Sources: the embedded trainer's step dirs (:mod:`.embedded`), NeMo-RL DTensor / torch distributed
checkpoints (:mod:`.dcp`), NeMo-RL Megatron checkpoints through Megatron-Bridge (:mod:`.megatron`)
and the SPPO critic (:mod:`.critic`). Output: sharded safetensors + index, config, tokenizer,
generation config and a model card, written atomically (:mod:`.writer`) and verified
(:mod:`.verify`). transformers is imported only when an export runs.
"""

from __future__ import annotations

__all__ = ["export_checkpoint"]


def export_checkpoint(*args, **kwargs):
    """See :func:`nemo_granular.export.cli.export_checkpoint`."""
    from .cli import export_checkpoint as _impl

    return _impl(*args, **kwargs)
