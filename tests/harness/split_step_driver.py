#!/usr/bin/env python3
"""NeMo-RL's Megatron split-step metric rescale run on the granular loss, in a fresh process.

    python tests/harness/split_step_driver.py granular_first|nemo_rl_first

The order decides which is imported first: ``nemo_granular`` (its loss built before NeMo-RL's
loss module is loaded) or NeMo-RL's loss interfaces. Then the REAL
``MegatronPolicyWorkerImpl._split_step_state_init`` and ``_finish_train_step_body`` run on a
microbatch whose loss was called with the placeholder ``global_valid_* = 1``, as the streaming
step does; the worker rescales each metric by the denominator the loss advertises and compares
the kinds with ``is``. The rescaled metrics are printed as JSON next to the synchronous ones.

Test-only stand-ins (no GPU here): ``device="cuda"`` tensor factories run on the CPU (a torch
function mode), ``torch.cuda.synchronize``/``get_device_name`` answer on CPU, the model /
optimizer / scheduler are minimal objects, the model-parallel reductions are identities for one
rank, and the data-parallel group is a one-process gloo group.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.overrides import TorchFunctionMode

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "harness"))

CONFIG = {
    "token_level_loss": False,
    "reference_policy_kl_penalty": 0.05,
    "use_importance_sampling_correction": True,
    "truncated_importance_sampling_type": "tis",
    "truncated_importance_sampling_ratio": 1.05,
}


class CudaOnCpu(TorchFunctionMode):
    """``device="cuda"`` in a tensor factory means the CPU (test-only; the worker hard-codes cuda)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        dev = kwargs.get("device")
        if dev is not None and str(dev).startswith("cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def _build_loss():
    from nemo_granular.losses import GranularPolicyLoss

    return GranularPolicyLoss(CONFIG)


def _import_worker():
    import megatron.core.models.gpt  # megatron.core before the TE placeholder
    import megatron.core.parallel_state
    import megatron.core.tensor_parallel  # noqa: F401

    sys.path.append(str(ROOT / "tests" / "harness" / "host_shims" / "te_stub"))
    import nemo_automodel.shared.import_utils as iu

    iu.safe_import_te = lambda: (False, None)  # Automodel's TE-absent path (test only)
    from nemo_rl.models.policy.workers import megatron_policy_worker as mpw

    return mpw


def main(order: str) -> None:
    if order == "granular_first":
        loss_fn = _build_loss()
        assert "nemo_rl.algorithms.loss.interfaces" not in sys.modules
        mpw = _import_worker()
    elif order == "nemo_rl_first":
        import nemo_rl.algorithms.loss.interfaces  # noqa: F401

        mpw = _import_worker()
        loss_fn = _build_loss()
    else:
        raise SystemExit(f"unknown order {order!r}")
    from nemo_rl.algorithms.loss.interfaces import LossType

    from nemo_granular.nemo_rl import compat

    MetricNormalizer = compat.get("MetricNormalizer")  # main only: the test needs_nemo_rl("MetricNormalizer")

    import reference as R

    init = Path(tempfile.mkdtemp()) / "pg"
    torch.distributed.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    mpw.parallel_state.get_data_parallel_group = lambda *a, **k: None
    mpw.get_pg_collection = lambda model: SimpleNamespace(mp=None)
    mpw.logical_and_across_model_parallel_group = lambda x, mp_group=None: x
    mpw.reduce_max_stat_across_model_parallel_group = lambda x, mp_group=None: x
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.get_device_name = lambda *a, **k: "cpu"

    data, logp, gvs, gvt = R.make_batch(B=6, S=14, seed=3, gen_noise=0.03, noise=(1e-3, 0.05, 0.3))
    gvs_t, gvt_t, one = torch.tensor(gvs), torch.tensor(gvt), torch.tensor(1.0)
    sync_loss, sync_m = loss_fn(next_token_logprobs=logp, data=data, global_valid_seqs=gvs_t, global_valid_toks=gvt_t)
    raw_loss, raw_m = loss_fn(next_token_logprobs=logp, data=data, global_valid_seqs=one, global_valid_toks=one)

    fake = SimpleNamespace(
        cfg={
            "train_global_batch_size": 6,
            "train_micro_batch_size": 6,
            "megatron_cfg": {
                "distributed_data_parallel_config": {"overlap_grad_reduce": False},
                "empty_unused_memory_level": 0,
                "moe_per_layer_logging": False,
            },
        },
        model=SimpleNamespace(scale_gradients=lambda s: None),
        rank=1,
        dtype=torch.float32,
        optimizer=SimpleNamespace(step=lambda: (True, 1.0, 0), param_groups=[{}]),
        scheduler=SimpleNamespace(get_lr=lambda g: 1e-6, get_wd=lambda: 0.0, step=lambda increment: None),
        _log_gpu_mem=lambda tag: None,
        _restore_saved_mcore_hooks=lambda state: None,
    )
    worker = mpw.MegatronPolicyWorkerImpl
    with CudaOnCpu():
        state = worker._split_step_state_init(fake, loss_fn, None, None)
        state["local_valid_seqs"] += gvs
        state["local_valid_toks"] += gvt
        state["all_mb_metrics"].append(raw_m)
        state["mb_losses"].append(float(raw_loss))
        state["saved_finalize_model_grads_func"] = lambda models, num_tokens: None
        out = worker._finish_train_step_body(fake, state)
    torch.distributed.destroy_process_group()
    rescaled = {k: float(v[0]) for k, v in out["all_mb_metrics"].items() if k in raw_m}
    kinds = loss_fn.metric_normalizations
    print(
        json.dumps(
            {
                "order": order,
                "kinds_are_nemo_rl_members": all(type(v) is MetricNormalizer for v in kinds.values()),
                "loss_kind_is_sequences": kinds["loss"] is MetricNormalizer.SEQUENCES,
                "loss_type_is_sequence_level": loss_fn.loss_type is LossType.SEQUENCE_LEVEL,
                "global_loss": float(out["global_loss"].sum()),
                "sync_loss": float(sync_loss),
                "rescaled": rescaled,
                "sync": {k: float(v) for k, v in sync_m.items()},
            }
        )
    )


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main(sys.argv[1])
