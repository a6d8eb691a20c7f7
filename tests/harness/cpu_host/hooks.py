"""The stand-ins of every process of a CPU loop run (the test driver and each Ray worker), installed
lazily by ``site/sitecustomize.py``: the shared ones of :mod:`cpu_stand_ins` plus this harness's own.

This harness's own (docs/nemo-rl.md §7):

* the DTensor workers' actor environments, hard-coded to Automodel's uv venv, point at the running
  interpreter (:func:`_patch_registry`);
* NVML's device UUID, which names a worker's ZMQ refit socket, and its free memory, from which NeMo-RL
  v0.7.0 sizes the refit's staging buffers (:func:`_patch_nvml`);
* every actor method runs with the CUDA → CPU torch function mode on its thread
  (:func:`_patch_ray_actor_methods`);
* transformers' ``flash_attention_2`` (packing) → plain attention inside each packed sequence
  (:func:`_varlen_attention`).

And one recorder (no stand-in): every ``GranularPolicyLoss`` call inside a worker writes what
reached the loss and what the loss returned (:func:`_record_policy_loss`), for the test's float64
recomputation (``tests/harness/cpu_host/loss_check.py``); in an SPPO run (opt-in,
:data:`PPO_LOSSES_ENV`) also every ``SequenceValueLoss`` call of a value worker and every NeMo-RL
``ClippedPGLossFn`` call of a policy worker (:func:`_record_value_loss`, :func:`_record_clipped_pg_loss`;
recomputed by ``tests/harness/cpu_host/ppo_loss_check.py``); and a DTensor-v2 policy worker's parameter
gradients after its first global batch (:func:`_record_dtensor_gradients`; ``cpu_host/grad_check.py``).

Nothing here imports torch, Ray or NeMo-RL (an eager ``sitecustomize`` that imported NeMo-RL made
Ray's node start time out): each patch runs right after its module is first imported.
"""

from __future__ import annotations

import sys


def _patch_registry(module) -> None:
    """The DTensor workers' actor environments are hard-coded to Automodel's uv venv
    (``PY_EXECUTABLES.AUTOMODEL``), which ``NEMO_RL_PY_EXECUTABLES_SYSTEM=1`` does not cover:
    point them at the running interpreter like the entries the switch does cover."""
    from nemo_rl.distributed.virtual_cluster import PY_EXECUTABLES

    for fqn, env in list(module.ACTOR_ENVIRONMENT_REGISTRY.items()):
        if env in (PY_EXECUTABLES.AUTOMODEL, PY_EXECUTABLES.FSDP, PY_EXECUTABLES.VLLM, PY_EXECUTABLES.BASE):
            module.ACTOR_ENVIRONMENT_REGISTRY[fqn] = PY_EXECUTABLES.SYSTEM


# The free memory the NVML stand-in reports for every declared GPU. NeMo-RL v0.7.0 sizes its refit
# staging buffers from it (30 %, ``NRL_REFIT_BUFFER_MEMORY_RATIO``, split into two ping-pong
# buffers): 128 KiB gives ~19 KiB buffers, smaller than the tiny test models (~44 KiB in bf16), so
# every refit spans several buffers and acknowledgements, as a real model's does.
DEVICE_FREE_BYTES = 128 * 1024


def _patch_nvml(nvml) -> None:
    """NVML (no library without a GPU) answers the two device queries NeMo-RL makes of it, through
    NeMo-RL's own ``get_device_uuid`` / ``get_free_memory_bytes`` (their logical → physical index
    mapping by ``CUDA_VISIBLE_DEVICES`` included): the UUID names the socket a policy worker streams
    its refit through (``ipc:///tmp/<uuid>.sock``), one per physical index and per Ray head (the
    head's private HOME is in the name, so test runs side by side never share a socket); the free
    memory is :data:`DEVICE_FREE_BYTES`. Any other NVML call fails as it would without the library."""
    import os
    import types
    import zlib

    real = nvml.pynvml
    head = zlib.crc32(os.environ.get("HOME", "").encode())
    memory = types.SimpleNamespace(total=DEVICE_FREE_BYTES, free=DEVICE_FREE_BYTES, used=0)

    class StandIn(types.ModuleType):
        NVMLError = real.NVMLError

        @staticmethod
        def nvmlInit():
            return None

        @staticmethod
        def nvmlShutdown():
            return None

        @staticmethod
        def nvmlDeviceGetHandleByIndex(index):
            return int(index)

        @staticmethod
        def nvmlDeviceGetUUID(handle):
            return f"GPU-cpu-{head:08x}-{int(handle)}"

        @staticmethod
        def nvmlDeviceGetMemoryInfo(handle):
            return memory

        def __getattr__(self, name):
            return getattr(real, name)

    nvml.pynvml = StandIn("pynvml")


def _patch_ray_actor_methods(function_manager) -> None:
    """torch keeps function modes per thread and Ray runs actor methods on a thread of its own, so
    the mode entered where torch was imported does not reach them: each method enters it on its
    thread first (once per thread)."""
    cls = function_manager.FunctionActorManager
    real = cls._make_actor_method_executor

    def make_executor(self, method_name, method):
        inner = real(self, method_name, method)

        def actor_method_executor(__ray_actor, *args, **kwargs):
            stand_ins = sys.modules.get("cpu_stand_ins.torch_cuda")  # loaded once torch is
            if stand_ins is not None:
                stand_ins.mode_on_this_thread()
            return inner(__ray_actor, *args, **kwargs)

        actor_method_executor.name, actor_method_executor.method = inner.name, inner.method
        return actor_method_executor

    cls._make_actor_method_executor = make_executor


def _record_policy_loss(losses) -> None:
    """Each ``GranularPolicyLoss.__call__`` in this process (a policy worker) also saves, under
    ``$NEMO_GRANULAR_CPU_HOST_FACTS.loss/``, the tensors that reached it (``next_token_logprobs``,
    the microbatch's keys, the global counts), the loss and metrics it returned, and its gradient
    w.r.t. ``next_token_logprobs`` (one extra autograd pass of the same object on a detached copy;
    the training step itself is untouched). The test driver moves the files to one folder per
    ``Policy.train`` call."""
    import os

    facts = os.environ.get("NEMO_GRANULAR_CPU_HOST_FACTS")
    if not facts:
        return
    cls = losses.GranularPolicyLoss
    real = cls.__call__
    keys = (
        "input_ids",
        "input_lengths",
        "token_mask",
        "sample_mask",
        "advantages",
        "prev_logprobs",
        "generation_logprobs",
        "reference_policy_logprobs",
        "prev_entropy",
        "granular_group_ids",
    )
    counter = [0]

    def __call__(self, next_token_logprobs, data, global_valid_seqs, global_valid_toks, **kwargs):
        import torch

        loss, metrics = real(self, next_token_logprobs, data, global_valid_seqs, global_valid_toks, **kwargs)
        with torch.enable_grad():
            leaf = next_token_logprobs.detach().clone().requires_grad_(True)
            again, _ = real(self, leaf, data, global_valid_seqs, global_valid_toks, **kwargs)
            (grad,) = torch.autograd.grad(again, leaf, allow_unused=True)
        from cpu_host.loss_check import config_of

        dist = torch.distributed
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        record = {
            "rank": rank,
            "call": counter[0],
            "next_token_logprobs": next_token_logprobs.detach().cpu().clone(),
            "data": {k: data[k].detach().cpu().clone() for k in keys if k in data and hasattr(data[k], "detach")},
            "global_valid_seqs": float(global_valid_seqs),
            "global_valid_toks": float(global_valid_toks),
            "loss": float(loss.detach()),
            "metrics": dict(metrics),
            "grad": (grad if grad is not None else torch.zeros_like(leaf)).detach().cpu(),
            "config": config_of(self),
        }
        _save_record(f"{facts}.loss", f"{os.getpid()}_{counter[0]:05d}", record)
        counter[0] += 1
        return loss, metrics

    cls.__call__ = __call__


def _record_dtensor_gradients(worker_module) -> None:
    """The first ``scale_grads_and_clip_grad_norm`` call of a DTensor-v2 policy worker (after the first global
    batch's backward passes, before NeMo-RL scales, clips and steps) also saves every parameter's gradient,
    gathered whole (``DTensor.full_tensor``, a collective every rank makes), from rank 0, and from every rank
    how many loss calls reached that gradient: ``$NEMO_GRANULAR_CPU_HOST_FACTS.grads/<pid>.pt``. The test
    compares it with a float64 transformers backward (``cpu_host.grad_check``)."""
    import os

    facts = os.environ.get("NEMO_GRANULAR_CPU_HOST_FACTS")
    if not facts:
        return
    real = worker_module.scale_grads_and_clip_grad_norm
    done = [False]

    def scale_grads_and_clip_grad_norm(max_grad_norm, model_parts, *args, **kwargs):
        if not done[0]:
            done[0] = True
            import torch
            from torch.distributed.tensor import DTensor

            dist = torch.distributed
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            grads = {}
            for name, p in model_parts[0].named_parameters():
                g = p.grad
                if g is None:
                    continue
                g = g.full_tensor() if isinstance(g, DTensor) else g
                if rank == 0:
                    grads[name] = g.detach().double().cpu()
            # the loss calls that reached this gradient: this process's records of the current train call (the
            # driver moves them into their call's folder when the call returns; each is written before the loss
            # returns)
            import glob

            calls = len(glob.glob(os.path.join(f"{facts}.loss", f"{os.getpid()}_*.pt")))
            _save_record(
                f"{facts}.grads",
                str(os.getpid()),
                {
                    "rank": rank,
                    "loss_calls": calls,
                    "grads": grads,
                    "max_grad_norm": max_grad_norm,
                    "dp_group_size": kwargs.get("dp_group_size"),
                },
            )
        return real(max_grad_norm, model_parts, *args, **kwargs)

    worker_module.scale_grads_and_clip_grad_norm = scale_grads_and_clip_grad_norm


def _save_record(folder: str, name: str, record: dict) -> None:
    """``record`` → ``<folder>/<name>.pt``, written to a temporary name first (the test reads whole files only)."""
    import os

    import torch

    os.makedirs(folder, exist_ok=True)
    torch.save(record, os.path.join(folder, name + ".tmp"))
    os.replace(os.path.join(folder, name + ".tmp"), os.path.join(folder, name + ".pt"))


# Opt-in (set by ``cpu_host.launch sppo`` in the driver; NeMo-RL's worker groups copy the driver's
# environment into every worker): the PPO loop's two losses are recorded too.
PPO_LOSSES_ENV = "NEMO_GRANULAR_CPU_HOST_PPO_LOSSES"


def _save_ppo_loss_record(kind: str, counter: list, record: dict) -> None:
    """``record`` → ``$NEMO_GRANULAR_CPU_HOST_FACTS.ppo_loss/<kind>_<pid>_<n>.pt`` (a folder of its
    own: the GRPO loops' ``.loss`` records and their collection per ``Policy.train`` call are untouched)."""
    import os

    import torch

    dist = torch.distributed
    record["rank"] = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    record["call"], record["pid"] = counter[0], os.getpid()
    _save_record(
        f"{os.environ['NEMO_GRANULAR_CPU_HOST_FACTS']}.ppo_loss", f"{kind}_{os.getpid()}_{counter[0]:05d}", record
    )
    counter[0] += 1


def _ppo_losses_on() -> bool:
    import os

    return bool(os.environ.get("NEMO_GRANULAR_CPU_HOST_FACTS") and os.environ.get(PPO_LOSSES_ENV))


def _record_value_loss(losses) -> None:
    """Each ``SequenceValueLoss.__call__`` in this process (a value worker) also saves the critic
    output that reached it (``logits``: NeMo-RL's right-shifted values), the batch's ``token_mask``,
    ``sample_mask`` and ``rewards``, the global counts, and the loss and metrics it returned. Only the
    forward is recorded (no extra autograd pass)."""
    if not _ppo_losses_on():
        return
    cls = losses.SequenceValueLoss
    real = cls.__call__
    keys = ("token_mask", "sample_mask", "rewards", "input_lengths")
    counter = [0]

    def __call__(self, logits, data, global_valid_seqs, global_valid_toks, **kwargs):
        loss, metrics = real(self, logits, data, global_valid_seqs, global_valid_toks, **kwargs)
        _save_ppo_loss_record(
            "value",
            counter,
            {
                "logits": logits.detach().cpu().clone(),
                "data": {k: data[k].detach().cpu().clone() for k in keys if k in data and hasattr(data[k], "detach")},
                "global_valid_seqs": float(global_valid_seqs),
                "global_valid_toks": float(global_valid_toks),
                "loss": float(loss.detach()),
                "metrics": dict(metrics),
            },
        )
        return loss, metrics

    cls.__call__ = __call__


def _record_losses(losses) -> None:
    _record_policy_loss(losses)
    _record_value_loss(losses)


def _record_clipped_pg_loss(loss_functions) -> None:
    """Each call of NeMo-RL's own ``ClippedPGLossFn`` (SPPO's policy loss) in this process saves the
    next-token log-probs and the microbatch tensors it read, the global counts, its configuration,
    and the loss and metrics it returned (forward only)."""
    if not _ppo_losses_on():
        return
    cls = loss_functions.ClippedPGLossFn
    real = cls.__call__
    keys = ("token_mask", "sample_mask", "advantages", "prev_logprobs", "generation_logprobs", "rewards")
    counter = [0]

    def __call__(self, next_token_logprobs, data, global_valid_seqs, global_valid_toks, *args, **kwargs):
        loss, metrics = real(self, next_token_logprobs, data, global_valid_seqs, global_valid_toks, *args, **kwargs)
        _save_ppo_loss_record(
            "policy",
            counter,
            {
                "next_token_logprobs": next_token_logprobs.detach().cpu().clone(),
                "data": {k: data[k].detach().cpu().clone() for k in keys if k in data and hasattr(data[k], "detach")},
                "global_valid_seqs": float(global_valid_seqs),
                "global_valid_toks": float(global_valid_toks),
                "loss": float(loss.detach()),
                "metrics": dict(metrics),
                "config": {
                    k: getattr(self, k, None)
                    for k in (
                        "ratio_clip_min",
                        "ratio_clip_max",
                        "ratio_clip_c",
                        "reference_policy_kl_penalty",
                        "disable_ppo_ratio",
                        "force_on_policy_ratio",
                        "use_importance_sampling_correction",
                        "sequence_level_importance_ratios",
                        "use_cispo",
                        "positive_example_nll_weight",
                        "truncated_importance_sampling_ratio",
                    )
                }
                | {"loss_type": str(getattr(self, "loss_type", ""))},
            },
        )
        return loss, metrics

    cls.__call__ = __call__


def _varlen_attention(_module) -> None:
    """Sequence packing makes the DTensor-v2 worker load its model with ``flash_attention_2``
    (flash-attn, CUDA only): transformers' entry for it becomes plain attention inside each packed
    sequence (``cpu_stand_ins.hf_varlen_attention``), once NeMo-RL's Automodel set-up is imported."""
    from cpu_stand_ins import hf_varlen_attention

    hf_varlen_attention.install()


AFTER_IMPORT = {
    "nemo_granular.losses": _record_losses,
    "nemo_rl.algorithms.loss.loss_functions": _record_clipped_pg_loss,
    "nemo_rl.models.automodel.setup": _varlen_attention,
    "nemo_rl.models.policy.workers.dtensor_policy_worker_v2": _record_dtensor_gradients,
    "ray._private.function_manager": _patch_ray_actor_methods,
    "nemo_rl.distributed.ray_actor_environment_registry": _patch_registry,
    "nemo_rl.utils.nvml": _patch_nvml,
}


def install() -> None:
    import cpu_stand_ins

    cpu_stand_ins.install(AFTER_IMPORT)
