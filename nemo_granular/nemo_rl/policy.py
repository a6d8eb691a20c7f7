"""Driver side: a NeMo-RL ``Policy`` that keeps the π_old entropy and feeds the granular loss.

``grpo_train`` keeps only ``policy.get_logprobs(...)["logprobs"]`` and later calls
``policy.train(train_data, loss_fn)`` on the same rows in the same order. ``GranularPolicy``
(built through ``setup(..., policy_factory=make_policy_factory(...))``):

- ``get_logprobs`` calls the worker extension's ``get_logprobs_with_entropy`` (same sharding,
  same un-reordering as NeMo-RL's ``Policy.get_logprobs``), stashes the entropy together
  with the ``input_ids`` it belongs to, and returns the logprobs;
- ``train`` adds ``prev_entropy`` ``[B, S]`` and ``granular_group_ids`` ``[B, S]`` (int32, −1
  outside the response) to the batch (:func:`add_granular_keys`) and calls ``Policy.train``.
  When no matching entropy was stashed (``force_on_policy_ratio`` skips ``get_logprobs``),
  it runs one extra forward-only pass first — the weights are still π_old at that point.
  Under ``espo.alpha: auto`` it also sets ESPO's α on the first rollout and keeps it in the
  checkpoint (:mod:`nemo_granular.nemo_rl.run_state`; ``save_checkpoint``).

The pure pieces (group ids on the driver batch, the config checks) are plain functions
tested without NeMo-RL; the ``Policy`` subclass is defined on first use inside NeMo-RL.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch

from ..config import parse_policy_loss_config
from ..core.groups import GROUP_IDS_DTYPE, entropy_group_ids, segment_group_ids
from ..core.offpolicy import batch_mismatch_extrema
from ..loss_spec import GranularSpec
from .estimators import config_get
from .run_state import checkpoint_dir_of, espo_alpha_for_step, load_run_state, save_run_state
from .workers import DTENSOR_V2_EXTENSION_FQN, ENTROPY_METHOD, MEGATRON_EXTENSION_FQN

__all__ = [
    "compute_granular_group_ids",
    "add_granular_keys",
    "extension_fqn_for",
    "stock_venv_python",
    "register_worker_extensions",
    "make_policy_factory",
    "granular_policy_class",
]

_SHARD_AXES = ["context_parallel", "tensor_parallel", "pipeline_parallel"]


def compute_granular_group_ids(
    granular: GranularSpec,
    input_ids: torch.Tensor,
    token_mask: torch.Tensor,
    prev_entropy: torch.Tensor | None = None,
    delimiter_table: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """``granular_group_ids`` ``[B, S]`` for the driver batch, or ``None`` when the loss needs none.

    segment (SSPO): cut after every response token whose text contains a delimiter (vocabulary
    lookup table built once from the tokenizer). entropy_group (ESPO): per row, the tokens
    with the top ``entropy_top_fraction`` π_old entropy vs the rest. token / sequence: the
    loss needs no ids. Ids are per-row local 0..G−1, −1 outside ``token_mask``; the column
    convention is NeMo-RL's (token i in column i), like ``prev_entropy``.
    """
    mask = token_mask.bool()
    if granular.granularity == "segment":
        if delimiter_table is None:
            raise ValueError("granular.granularity 'segment' needs the tokenizer's delimiter table")
        return segment_group_ids(input_ids, mask, delimiter_table).to(GROUP_IDS_DTYPE)
    if granular.granularity == "entropy_group":
        if prev_entropy is None:
            raise ValueError("granular.granularity 'entropy_group' needs the π_old entropy")
        ent = prev_entropy.float()
        return entropy_group_ids(ent, mask & torch.isfinite(ent), granular.entropy_cut_points, GROUP_IDS_DTYPE)
    return None


def add_granular_keys(data, loss_cfg, entropy: torch.Tensor | None, delimiter_table: torch.Tensor | None = None):
    """Put ``prev_entropy`` / ``granular_group_ids`` into ``data`` (a ``BatchedDataDict`` or dict)
    next to NeMo-RL's keys. Every added tensor has ``input_ids``' shape (NeMo-RL's hard shape rule).
    ``loss_cfg``: the ``loss_fn`` mapping, or its resolved spec (``parse_policy_loss_config``; used as is)."""
    granular = parse_policy_loss_config(loss_cfg).granular
    shape = tuple(data["input_ids"].shape)
    if entropy is not None:
        if tuple(entropy.shape) != shape:
            raise ValueError(f"prev_entropy has shape {tuple(entropy.shape)} but input_ids has {shape}")
        data["prev_entropy"] = entropy.float()
    elif granular.needs_entropy:
        raise ValueError(f"granular.algorithm {granular.algorithm!r} needs the π_old entropy but none was computed")
    ids = compute_granular_group_ids(granular, data["input_ids"], data["token_mask"], entropy, delimiter_table)
    if ids is not None:
        data["granular_group_ids"] = ids
    return data


def extension_fqn_for(policy_cfg: Mapping) -> str:
    """The worker-extension class for the enabled backend (Megatron or DTensor v2)."""
    if bool((policy_cfg.get("megatron_cfg") or {}).get("enabled", False)):
        return MEGATRON_EXTENSION_FQN
    dt = policy_cfg.get("dtensor_cfg") or {}
    if bool(dt.get("enabled", False)) and bool(dt.get("_v2", False)):
        return DTENSOR_V2_EXTENSION_FQN
    raise ValueError(
        "policy: the π_old entropy extension supports policy.megatron_cfg.enabled=true or "
        "policy.dtensor_cfg.{enabled: true, _v2: true} (not the DTensor v1 worker)"
    )


# each extension runs in the Python environment NeMo-RL registers for the worker it extends
EXTENDED_WORKER_FQN = {
    MEGATRON_EXTENSION_FQN: "nemo_rl.models.policy.workers.megatron_policy_worker.MegatronPolicyWorker",
    DTENSOR_V2_EXTENSION_FQN: "nemo_rl.models.policy.workers.dtensor_policy_worker_v2.DTensorPolicyWorkerV2",
}


def stock_venv_python(stock_fqn: str, venv_dir: str) -> str | None:
    """``<venv_dir>/<stock_fqn>/bin/python`` when that venv is built (NeMo-RL's image prefetches the
    stock workers' venvs under its ``NEMO_RL_VENV_DIR``; ``_env_builder`` uses the same test), else None."""
    import os

    python = os.path.join(venv_dir, stock_fqn, "bin", "python")
    return python if os.path.exists(python) else None


def register_worker_extensions() -> None:  # pragma: no cover - needs NeMo-RL
    """Register both extension fqns in NeMo-RL's actor-environment registry (driver, before ``setup``),
    in the Python environment of the stock worker each one extends: the stock worker's built venv
    (``NEMO_RL_VENV_DIR/<stock class>/bin/python``, a plain interpreter path NeMo-RL uses as is)
    when it exists, else the executable NeMo-RL's registry holds for the stock worker (Megatron:
    ``MCORE_EXECUTABLE``, DTensor v2: ``PY_EXECUTABLES.AUTOMODEL`` at 7ea279ab), so a deployment that
    points the stock worker elsewhere moves the extension with it. A ``uv run`` executable under the
    extension's own class name would make NeMo-RL build one more venv of the same extra on every
    node, in every new container (no image ships it; offline nodes fail in ``setup()``)."""
    import os

    from . import compat

    ACTOR_ENVIRONMENT_REGISTRY = compat.get("ACTOR_ENVIRONMENT_REGISTRY")
    MCORE_EXECUTABLE = compat.get("MCORE_EXECUTABLE")
    PY_EXECUTABLES = compat.get("PY_EXECUTABLES")
    venv_dir = os.path.normpath(os.environ.get("NEMO_RL_VENV_DIR", compat.get("DEFAULT_VENV_DIR")))
    fallback = {MEGATRON_EXTENSION_FQN: MCORE_EXECUTABLE, DTENSOR_V2_EXTENSION_FQN: PY_EXECUTABLES.AUTOMODEL}
    for ext, stock in EXTENDED_WORKER_FQN.items():
        executable = ACTOR_ENVIRONMENT_REGISTRY.get(stock, fallback[ext])
        if executable.startswith("uv"):
            executable = stock_venv_python(stock, venv_dir) or executable
        ACTOR_ENVIRONMENT_REGISTRY.setdefault(ext, executable)


_CLASS: dict[str, type] = {}


def granular_policy_class():  # pragma: no cover - needs NeMo-RL
    """``GranularPolicy(nemo_rl.models.policy.lm_policy.Policy)``, defined on first call."""
    if "cls" in _CLASS:
        return _CLASS["cls"]
    from contextlib import nullcontext

    from . import compat

    BatchedDataDict, Policy = compat.get("BatchedDataDict"), compat.get("Policy")

    class GranularPolicy(Policy):
        def __init__(self, *args, granular_loss_cfg=None, delimiter_table=None, **kwargs):
            super().__init__(*args, **kwargs)
            self._granular_loss = parse_policy_loss_config(granular_loss_cfg)  # once: the spec every step reads
            self._delimiter_table = delimiter_table
            self._stash: tuple[torch.Tensor, torch.Tensor] | None = None
            # what NeMo-RL's checkpoint does not hold (ESPO's auto α): read back on resume
            weights = kwargs.get("weights_path")
            self._run_state = load_run_state(checkpoint_dir_of(weights)) if weights else {}

        def _logprobs_and_entropy(self, data, timer=None):
            with timer.time("get_logprobs/shard_data") if timer else nullcontext():
                sharded, unsorted = self._shard_for_logprob(data)
            futures = self.worker_group.run_all_workers_sharded_data(
                ENTROPY_METHOD,
                data=sharded,
                in_sharded_axes=["data_parallel"],
                replicate_on_axes=_SHARD_AXES,
                output_is_replicated=_SHARD_AXES,
            )
            out = BatchedDataDict.from_batches(self.worker_group.get_all_worker_results(futures))
            if unsorted is not None:
                out.reorder_data(unsorted)
            return out

        def get_logprobs(self, data, timer=None):
            out = self._logprobs_and_entropy(data, timer)
            self._stash = (data["input_ids"], out["entropy"])
            # logprobs, plus NeMo-RL 0.8's token_mask when the workers return one (top-k / top-p)
            return BatchedDataDict(compat.logprob_outputs(out))

        def _entropy_for(self, data, timer=None):
            if self._stash is not None:
                ids, ent = self._stash
                if ids is data["input_ids"] or (
                    ids.shape == data["input_ids"].shape and torch.equal(ids, data["input_ids"])
                ):
                    return ent
            # no matching π_old pass (e.g. force_on_policy_ratio skipped get_logprobs): weights are
            # still π_old before training, so one forward-only pass gives the exact entropy
            self.prepare_for_lp_inference()
            ent = self._logprobs_and_entropy(data, timer)["entropy"]
            self.prepare_for_training()
            return ent

        def train(self, data, loss_fn, eval_mode=False, gbs=None, mbs=None, timer=None, check_dim_skip_keys=None):
            entropy = self._entropy_for(data, timer)
            add_granular_keys(data, self._granular_loss, entropy, self._delimiter_table)
            alpha = espo_alpha_for_step(loss_fn, data, self._run_state)
            self._stash = None
            results = super().train(
                data,
                loss_fn,
                eval_mode=eval_mode,
                gbs=gbs,
                mbs=mbs,
                timer=timer,
                check_dim_skip_keys=check_dim_skip_keys,
            )
            if alpha is not None:  # grpo_train logs all_mb_metrics as train/<name>
                results.setdefault("all_mb_metrics", {})["espo_alpha"] = [alpha]
            # whole-batch mismatch maxima and entropy split: one value each (grpo_train sums the list);
            # diagnostics: at metrics_level minimal only with the correction on, as the loss's own
            cfg = self._granular_loss
            g = cfg.granular
            if cfg.metrics_level == "full" or cfg.use_importance_sampling_correction:
                results.setdefault("all_mb_metrics", {}).update(
                    {k: [v] for k, v in batch_mismatch_extrema(data, g.granularity, g.entropy_cut_points[0]).items()}
                )
            return results

        def save_checkpoint(self, weights_path, *args, **kwargs):
            super().save_checkpoint(weights_path, *args, **kwargs)
            if self._run_state:
                save_run_state(checkpoint_dir_of(weights_path), self._run_state)

    _CLASS["cls"] = GranularPolicy
    return GranularPolicy


def make_policy_factory(master_config: Any, delimiter_table: torch.Tensor | None = None):  # pragma: no cover
    """``policy_factory`` for ``nemo_rl.algorithms.grpo.setup``: a ``GranularPolicy`` on the
    worker extension of the configured backend."""
    policy_cfg = config_get(master_config, "policy")
    loss_cfg = config_get(master_config, "loss_fn")
    fqn = extension_fqn_for(policy_cfg)
    register_worker_extensions()
    cls = granular_policy_class()

    def factory(**kwargs):
        if "worker_extension_cls_fqn" in kwargs and kwargs["worker_extension_cls_fqn"] not in (None, fqn):
            warnings.warn(
                f"policy_factory: replacing worker_extension_cls_fqn={kwargs['worker_extension_cls_fqn']} by {fqn}",
                stacklevel=2,
            )
        kwargs["worker_extension_cls_fqn"] = fqn
        return cls(granular_loss_cfg=loss_cfg, delimiter_table=delimiter_table, **kwargs)

    return factory
