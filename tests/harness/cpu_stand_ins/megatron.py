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
* Distributed optimizer without TE (torch's Adam): a resumed run's optimizer state
  (:func:`patch_distrib_optimizer`).
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
    "megatron.core.distributed",
    "megatron.core.inference.text_generation_controllers.text_generation_controller",
    "megatron.core.models.gpt.experimental_attention_variant_module_specs",
    "megatron.core.models.gpt",
    "megatron.core.optimizer",
    "megatron.core.parallel_state",
    "megatron.core.pipeline_parallel",
    "megatron.core.tensor_parallel",
    "megatron.core.transformer.moe.moe_layer",
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
    return sorted(
        name
        for name, mod in list(sys.modules.items())
        if name.startswith("megatron.core") and getattr(mod, "HAVE_TE", False) is True
    )


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


def patch_distrib_optimizer(distrib_optimizer) -> None:
    """Resuming a Megatron checkpoint without Transformer Engine. On a GPU the distributed optimizer
    wraps TE's ``FusedAdam``, which keeps ``step`` in its param groups; here it wraps torch's Adam
    (Megatron's fallback without TE or Apex, ``if not HAVE_APEX_OR_TE`` in ``distrib_optimizer.py``),
    and two lines of that fallback do not hold for a resumed run:

    * ``state_dict()`` (also the loading template ``MegatronPolicyWorkerImpl.__init__`` builds on a
      fresh optimizer) reads the ``step`` of every parameter's state, which torch's Adam creates
      only at its first step: ``assert len(steps) == 1`` stops the load. The state torch's Adam
      would create (step 0, zero moments) is created first; the load replaces all of it.
    * ``load_state_dict`` gives every parameter's state the SAME ``step`` tensor, which torch's
      Adam then increments in place once per parameter: after a resume the bias correction ran
      ahead (measured: step 38 instead of 6 after one resumed GRPO step of 2 optimizer steps over
      17 parameters). After the load each parameter gets its own ``step``, the checkpoint's (the
      param groups' ``step`` it saved).
    """
    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    import torch

    cls = distrib_optimizer.DistributedOptimizer
    real_state_dict, real_load = cls.state_dict, cls.load_state_dict

    @functools.wraps(real_state_dict)
    def state_dict(self):
        inner = self.optimizer
        if isinstance(inner, torch.optim.Adam) and not inner.state:
            for group in inner.param_groups:
                for p in group["params"]:
                    inner.state[p] = {
                        "step": torch.tensor(0.0),
                        "exp_avg": torch.zeros_like(p),
                        "exp_avg_sq": torch.zeros_like(p),
                    }
        return real_state_dict(self)

    @functools.wraps(real_load)
    def load_state_dict(self, state_dict):
        out = real_load(self, state_dict)
        (step,) = {float(g["step"]) for g in state_dict["optimizer"]["param_groups"]}  # the checkpoint's
        for state in self.optimizer.state.values():
            state["step"] = torch.tensor(step)
        return out

    cls.state_dict, cls.load_state_dict = state_dict, load_state_dict


def patch_torch_norm(torch_norm) -> None:
    """Sequence parallelism with Megatron's local layer spec: its ``WrappedTorchNorm`` refuses
    ``sequence_parallel`` (``torch_norm.py:50``), which only Transformer Engine's norms take on a GPU.
    What TE's norm does there: the same RMSNorm / LayerNorm on the local sequence shard, its weight
    marked ``sequence_parallel`` so that Megatron's ``finalize_model_grads`` all-reduces its gradient
    over the TP group (each rank saw a part of the tokens). Without sequence parallelism: unchanged."""
    cls = torch_norm.WrappedTorchNorm
    real_new = cls.__new__

    def __new__(klass, config, hidden_size, eps=1e-5, *args, **kwargs):
        if not getattr(config, "sequence_parallel", False):
            return real_new(klass, config, hidden_size, eps, *args, **kwargs)
        config.sequence_parallel = False  # only for the check in __new__; restored below
        try:
            norm = real_new(klass, config, hidden_size, eps, *args, **kwargs)
        finally:
            config.sequence_parallel = True
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm

    cls.__new__ = staticmethod(__new__)


BEFORE_IMPORT = {"megatron.bridge": lambda: import_core_then_te_placeholder()}
AFTER_IMPORT = {
    "megatron.core.optimizer.distrib_optimizer": patch_distrib_optimizer,
    "megatron.core.tensor_parallel.random": patch_rng_tracker,
    "megatron.core.transformer.torch_norm": patch_torch_norm,
    "megatron.core.transformer.moe.token_dispatcher": patch_token_dispatcher,
    "megatron.bridge.training.initialize": patch_bridge_initialize,
    "megatron.bridge.models.gpt_provider": lambda m: use_cpu_layer_spec(m),
    "megatron.bridge.models.conversion.auto_bridge": patch_auto_bridge,
    "nemo_rl.models.megatron.setup": patch_nemo_rl_setup,
}
