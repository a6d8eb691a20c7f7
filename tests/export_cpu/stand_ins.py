"""CPU answers for the GPU-only calls met when NeMo-RL / Megatron-Bridge / Automodel code builds and
saves tiny models here (test code only; the upstream sources are never edited).

Each stand-in names the call it answers and why the answer does not change what is checked: the
tensors written to the checkpoint and the layout they are written in.

* :func:`use_local_layer_spec` is the only one the *export* needs; the writers add
  :func:`install_megatron_writer` or :func:`install_automodel_writer`.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch

TE_STUB = Path(__file__).resolve().parents[1] / "host_shims" / "te_stub"


def import_megatron_with_te_placeholder() -> None:
    """megatron.core first (it keeps its Transformer-Engine-absent paths), then the inert TE
    placeholder Megatron-Bridge imports at module level (the ``megatron_workers`` fixture's order)."""
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.parallel_state  # noqa: F401
    import megatron.core.tensor_parallel  # noqa: F401

    if str(TE_STUB) not in sys.path:
        sys.path.append(str(TE_STUB))


def use_local_layer_spec(setattr_=setattr) -> None:
    """Megatron-Bridge's GPT provider always asks for the Transformer Engine layer spec
    (``gpt_provider.default_layer_spec`` → ``transformer_engine_layer_spec``); TE needs CUDA and is an
    inert placeholder here, so the same call returns Megatron's local spec (torch norms/linears,
    ``SequentialMLP`` experts). The checkpoint layout is the same for both: Megatron declares
    ``TEGroupedMLP``'s sharded state dict "interchangeable with SequentialMLP's" and the local spec maps
    ``input_layernorm`` onto TE's fused ``linear_qkv.layer_norm_weight`` key; ``run_config.yaml``
    still records ``default_layer_spec``, as a GPU run's does. ``setattr_`` lets a test pass
    ``monkeypatch.setattr`` so the change is undone after it."""
    from megatron.bridge.models import gpt_provider

    setattr_(gpt_provider, "transformer_engine_layer_spec", gpt_provider.local_layer_spec)


def _cpu_rng_tracker() -> None:
    """Megatron's CUDA RNG tracker (``tensor_parallel/random.py``: ``add`` reads
    ``torch.cuda.get_rng_state``) keeps CPU generator states instead; weights come from checkpoints,
    so no value drawn here reaches a saved tensor."""
    from megatron.core.tensor_parallel import random as mrandom

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)

    mrandom.CudaRNGStatesTracker.add = add
    mrandom.CudaRNGStatesTracker.fork = fork


class _NoStream:
    """``torch.cuda.Stream()`` placeholder (Megatron's alltoall dispatcher creates one for its D2H
    copies at construction; no forward pass runs in a writer)."""

    def __init__(self, *args, **kwargs):
        pass


def install_megatron_writer() -> None:
    """Everything a Megatron/Bridge build + ``save_checkpoint`` meets on CPU (after the TE placeholder)."""
    use_local_layer_spec()
    _cpu_rng_tracker()
    torch.cuda.Stream = _NoStream
    # checkpoint contents: Bridge's get_rng_state stores torch.cuda.get_rng_state() next to the CPU state
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    # dist-ckpt async preload synchronises the device before D2H copies; everything is on CPU already
    torch.cuda.synchronize = lambda *a, **k: None
    # dist-ckpt's failure flag tensor is created on torch.cuda.current_device() before a broadcast
    torch.cuda.current_device = lambda: torch.device("cpu")

    from megatron.bridge.models import model_provider
    from megatron.bridge.models import transformer_config as bridge_tc

    # Bridge's get_model creates parameters on the current CUDA device and calls .cuda() unless
    # use_cpu_initialization; create them on the CPU and restore the flag so run_config.yaml records
    # the configured value.
    real_get_model = model_provider.get_model

    def get_model(provider, *args, **kwargs):
        before = provider.use_cpu_initialization
        kwargs["use_cpu_initialization"] = True
        try:
            return real_get_model(provider, *args, **kwargs)
        finally:
            provider.use_cpu_initialization = before

    model_provider.get_model = get_model

    # The HF→Megatron import builds its provider from Bridge's model defaults (Qwen3-MoE:
    # moe_permute_fusion=True), not from NeMo-RL's config; the TE-only fusions are turned off at
    # finalize (MCore's __post_init__ refuses them without TE). They change kernels, not weights.
    real_finalize = bridge_tc.TransformerConfig.finalize

    def finalize(self):
        for flag in ("moe_permute_fusion", "apply_rope_fusion", "gradient_accumulation_fusion"):
            if getattr(self, flag, False):
                setattr(self, flag, False)
        return real_finalize(self)

    bridge_tc.TransformerConfig.finalize = finalize


def install_automodel_writer() -> None:
    """What Automodel's ``from_pretrained`` (FSDP2) + ``Checkpointer.save_model`` meet on CPU."""
    # from_pretrained builds torch.device("cuda", torch.cuda.current_device()) for its pipeline
    # settings (unused: no pipeline) and reads current_device() as the model's device
    torch.cuda.current_device = lambda: 0
    from nemo_automodel._transformers import auto_model

    # ... which apply_model_infrastructure then uses to materialise the meta-initialised model and
    # load the HF weights into it; on CPU the model lives on the CPU (FSDP2 shards over the gloo mesh)
    real_apply = auto_model.apply_model_infrastructure

    def apply_model_infrastructure(*args, **kwargs):
        kwargs["device"] = torch.device("cpu")
        return real_apply(*args, **kwargs)

    auto_model.apply_model_infrastructure = apply_model_infrastructure
