"""Megatron-LM / Megatron-Bridge / NeMo-RL's Megatron set-up on CPU (test code only; docs/nemo-rl.md §7).

* Transformer Engine is absent: megatron.core is imported first (every module keeps its TE-absent
  path), then the inert placeholder package Megatron-Bridge imports at module level goes on
  ``sys.path`` (:func:`import_core_then_te_placeholder`; :func:`te_takers` checks the first half).
* Megatron's CUDA RNG tracker swaps the CPU generator's state (the CUDA RNG of
  :mod:`.torch_cuda` is the CPU generator).
* Layer spec: Bridge's GPT provider always picks Transformer Engine's
  (``gpt_provider.default_layer_spec``); it gets Megatron's local spec with a CPU core attention
  (:mod:`.attention`).
* MoE all-to-all: the split sizes go to the host as numpy, as from a GPU.
* Bridge: ``initialize_megatron`` runs with its own ``allow_no_cuda=True`` (NeMo-RL's call site);
  the dataset index helpers (``compile_helpers``, a ``make`` of a C++ extension RL never uses) are
  not built; the HF → Megatron import's provider asks for no TE fused permutation.

Each ``patch_*`` receives its freshly imported module (:data:`AFTER_IMPORT`, used by :mod:`.lazy`).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

TE_PLACEHOLDER = Path(__file__).resolve().parents[1] / "host_shims" / "te_stub"
CORE_MODULES = (
    "megatron.core.distributed", "megatron.core.inference.text_generation_controllers.text_generation_controller",
    "megatron.core.models.gpt.experimental_attention_variant_module_specs", "megatron.core.models.gpt",
    "megatron.core.optimizer", "megatron.core.parallel_state", "megatron.core.pipeline_parallel",
    "megatron.core.tensor_parallel", "megatron.core.transformer.moe.moe_layer",
)


def import_core_then_te_placeholder() -> None:
    """megatron.core first, without the placeholder on the path (a spawned process inherits its
    parent's ``sys.path``, placeholder included), then the placeholder."""
    import importlib

    sys.path[:] = [p for p in sys.path if Path(p).resolve() != TE_PLACEHOLDER]
    for name in CORE_MODULES:
        importlib.import_module(name)
    if str(TE_PLACEHOLDER) not in sys.path:
        sys.path.append(str(TE_PLACEHOLDER))


def te_takers() -> list[str]:
    """megatron.core modules that took their Transformer Engine path (``HAVE_TE`` true): must be none."""
    return sorted(name for name, mod in list(sys.modules.items())
                  if name.startswith("megatron.core") and getattr(mod, "HAVE_TE", False) is True)


def patch_rng_tracker(mrandom) -> None:
    """Megatron's tracker swaps the CUDA generator state in and out around model-parallel regions."""
    import torch

    gen = torch.default_generator
    mrandom._get_cuda_rng_state = lambda *a, clone=False, **k: gen.get_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: gen.set_state(state)


def patch_token_dispatcher(token_dispatcher) -> None:
    """The MoE all-to-all dispatcher moves its split sizes to the host (numpy) only if they are on
    the device (``is_cuda``); on CPU they would stay tensors, which ``all_to_all_single`` rejects."""
    import torch

    def device_to_host(tensor, as_numpy=False, record_stream=False):
        if not torch.is_tensor(tensor):
            return tensor
        host = tensor.clone()
        return host.numpy() if as_numpy else host

    token_dispatcher.maybe_move_tensor_to_cpu = device_to_host


def patch_bridge_initialize(binit) -> None:
    binit.compile_helpers = lambda *a, **k: None


def use_cpu_layer_spec(gpt_provider=None, setattr_=setattr) -> None:
    """Bridge's TE layer spec → Megatron's local spec with :class:`.attention.CpuCoreAttention`.
    The checkpoint layout is the same (Megatron declares ``TEGroupedMLP``'s sharded state dict
    interchangeable with ``SequentialMLP``'s and maps ``input_layernorm`` onto TE's fused
    ``linear_qkv.layer_norm_weight``); ``run_config.yaml`` still records ``default_layer_spec``.
    ``setattr_`` lets a test pass ``monkeypatch.setattr`` so the change is undone after it."""
    if gpt_provider is None:
        from megatron.bridge.models import gpt_provider
    from .attention import cpu_layer_spec

    setattr_(gpt_provider, "transformer_engine_layer_spec", cpu_layer_spec)


def patch_auto_bridge(auto_bridge) -> None:
    """The HF -> Megatron import builds the provider a model bridge configures (Qwen3-MoE asks for
    TE's fused permutation) and applies only the parallel sizes of NeMo-RL's megatron_cfg, so
    its ``moe_permute_fusion: false`` never reaches the import; the training provider gets it."""
    cls = auto_bridge.AutoBridge
    real = cls.to_megatron_provider

    @functools.wraps(real)
    def to_megatron_provider(self, *a, **k):
        provider = real(self, *a, **k)
        provider.moe_permute_fusion = False
        return provider

    cls.to_megatron_provider = to_megatron_provider


def patch_nemo_rl_setup(nsetup) -> None:
    """Bridge's ``initialize_megatron`` asserts ``torch.cuda.is_available()`` unless its own
    ``allow_no_cuda=True``."""
    nsetup.initialize_megatron = functools.partial(nsetup.initialize_megatron, allow_no_cuda=True)


BEFORE_IMPORT = {"megatron.bridge": lambda: import_core_then_te_placeholder()}
AFTER_IMPORT = {
    "megatron.core.tensor_parallel.random": patch_rng_tracker,
    "megatron.core.transformer.moe.token_dispatcher": patch_token_dispatcher,
    "megatron.bridge.training.initialize": patch_bridge_initialize,
    "megatron.bridge.models.gpt_provider": lambda m: use_cpu_layer_spec(m),
    "megatron.bridge.models.conversion.auto_bridge": patch_auto_bridge,
    "nemo_rl.models.megatron.setup": patch_nemo_rl_setup,
}
