"""Test-side machinery for executing NeMo-RL's checkpoint writers on CPU and exporting the result.

* :mod:`.tiny_hf` — tiny Qwen3 / Qwen3-MoE Hugging Face checkpoints (the "source" of every test).
* :mod:`.megatron_writer` — a NeMo-RL Megatron checkpoint (``step_N/policy/weights/iter_0000000``)
  written by NeMo-RL's and Megatron-Bridge's own code over gloo ranks, at any TP/EP.
* :mod:`.automodel_writer` — a NeMo-RL DTensor-v2 checkpoint written by Automodel's ``Checkpointer``
  from an FSDP2-sharded model over gloo ranks.

The writers run as separate processes (``python tests/harness/export_cpu/<writer>.py``), one per rank,
with the shared CPU stand-ins of ``tests/harness/cpu_stand_ins``.
"""
