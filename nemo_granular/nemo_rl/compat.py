"""Every NeMo-RL name the plugin imports, in one place, with the locations of the releases we know.

The plugin is written against NeMo-RL 7ea279ab (``NEMO_RL_COMMIT``) and relies on internal names.
Each name below lists where it lives: the pinned commit first, then where NeMo-RL 0.8 documents it.
Nothing is imported until a name is used (``import nemo_granular`` stays light):

    from nemo_granular.nemo_rl import compat
    BatchedDataDict = compat.get("BatchedDataDict")        # or compat.BatchedDataDict
    grpo = compat.module("grpo")                            # a whole module, by short name

Known moves and additions in NeMo-RL 0.8 (its API reference):

* ``prepare_loss_input`` moved from ``nemo_rl.algorithms.loss.utils`` to
  ``nemo_rl.algorithms.loss.loss_input``;
* ``LogprobOutputSpec`` gained an optional ``token_mask`` (present with top-k / top-p filtering):
  ``Policy.get_logprobs`` returns it and the driver must write it back into the training batch, so
  :func:`logprob_outputs` keeps it next to the log-probs;
* ``Policy.__init__`` gained ``is_refit_destination`` and ``reserved_http_server_ports`` (after
  ``skip_weight_load``): ``GranularPolicy`` forwards every keyword ``setup`` passes unchanged.

A name found nowhere raises one ``ImportError`` naming every location tried.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["LOCATIONS", "MODULES", "LOGPROB_OPTIONAL_KEYS", "get", "module", "logprob_outputs"]

# name -> modules that define it, pinned commit (7ea279ab) first
LOCATIONS: dict[str, tuple[str, ...]] = {
    # driver: entry scripts
    "MasterConfig": ("nemo_rl.algorithms.grpo",),
    "grpo_train": ("nemo_rl.algorithms.grpo",),
    "async_grpo_train": ("nemo_rl.algorithms.grpo",),
    "setup": ("nemo_rl.algorithms.grpo",),
    "shutdown_environments": ("nemo_rl.algorithms.grpo",),
    "get_tokenizer": ("nemo_rl.algorithms.utils",),
    "setup_response_data": ("nemo_rl.data.utils",),
    "init_ray": ("nemo_rl.distributed.virtual_cluster",),
    "PY_EXECUTABLES": ("nemo_rl.distributed.virtual_cluster",),
    "configure_generation_config": ("nemo_rl.models.generation",),
    "get_next_experiment_dir": ("nemo_rl.utils.logger",),
    "load_config": ("nemo_rl.utils.config",),
    "parse_hydra_overrides": ("nemo_rl.utils.config",),
    "register_omegaconf_resolvers": ("nemo_rl.utils.config",),
    "OverridesError": ("nemo_rl.utils.config",),
    # driver: policy, data, registries
    "Policy": ("nemo_rl.models.policy.lm_policy",),
    "BatchedDataDict": ("nemo_rl.distributed.batched_data_dict",),
    "ACTOR_ENVIRONMENT_REGISTRY": ("nemo_rl.distributed.ray_actor_environment_registry",),
    "MCORE_EXECUTABLE": ("nemo_rl.distributed.ray_actor_environment_registry",),
    "get_runtime_env_for_policy_worker": ("nemo_rl.models.policy.utils",),
    # environments
    "EnvironmentReturn": ("nemo_rl.environments.interfaces",),
    "BaseMathEnvironment": ("nemo_rl.environments.math_environment",),
    "HFVerifyWorker": ("nemo_rl.environments.math_environment",),
    "EnglishMultichoiceVerifyWorker": ("nemo_rl.environments.math_environment",),
    "MultilingualMultichoiceVerifyWorker": ("nemo_rl.environments.math_environment",),
    "ENV_REGISTRY": ("nemo_rl.environments.utils",),
    "register_env": ("nemo_rl.environments.utils",),
    "chunk_list_to_workers": ("nemo_rl.environments.utils",),
    # workers
    "broadcast_tensors_from_last_stage": ("nemo_rl.models.megatron.pipeline_parallel",),
    # losses (0.8: loss_input)
    "prepare_loss_input": ("nemo_rl.algorithms.loss.utils", "nemo_rl.algorithms.loss.loss_input"),
    # preflight: NeMo-RL's own config-level checks and worker / venv resolution
    "extract_necessary_env_names": ("nemo_rl.data.datasets.utils",),
    "should_use_async_rollouts": ("nemo_rl.models.generation.interfaces",),
    "TrainingSamplingParams": ("nemo_rl.algorithms.logits_sampling_utils",),
    "need_top_k_or_top_p_filtering": ("nemo_rl.algorithms.logits_sampling_utils",),
    "should_use_nemo_gym": ("nemo_rl.environments.nemo_gym",),
    "resolve_policy_worker_cls": ("nemo_rl.models.policy.utils",),
    "resolve_generation_worker_cls": ("nemo_rl.models.generation.vllm.utils",),
    "VllmConfig": ("nemo_rl.models.generation.vllm.config",),
    "get_actor_python_env": ("nemo_rl.distributed.ray_actor_environment_registry",),
    "DEFAULT_VENV_DIR": ("nemo_rl.utils.venvs",),
    "git_root": ("nemo_rl.utils.venvs",),
    "create_local_venv": ("nemo_rl.utils.venvs",),
}

# short name -> module (the modules whose globals the plugin rebinds or whose classes it extends)
MODULES: dict[str, str] = {
    "grpo": "nemo_rl.algorithms.grpo",
    "grpo_sync": "nemo_rl.algorithms.grpo_sync",
    "ppo": "nemo_rl.algorithms.ppo",
    "automodel_train": "nemo_rl.models.automodel.train",
    "megatron_train": "nemo_rl.models.megatron.train",
    "dtensor_policy_worker_v2": "nemo_rl.models.policy.workers.dtensor_policy_worker_v2",
    "megatron_policy_worker": "nemo_rl.models.policy.workers.megatron_policy_worker",
}

# LogprobOutputSpec keys besides "logprobs" that a Policy may return and grpo_train must keep (0.8)
LOGPROB_OPTIONAL_KEYS = ("token_mask",)


def module(short: str):
    """The NeMo-RL module registered under ``short`` in :data:`MODULES` (or a full dotted name)."""
    return importlib.import_module(MODULES.get(short, short))


def get(name: str) -> Any:
    """``name`` from the first of its :data:`LOCATIONS` that defines it (looked up at each call, so
    a test or deployment that rebinds the attribute in NeMo-RL's module is seen)."""
    places = LOCATIONS.get(name)
    if places is None:
        raise KeyError(f"nemo_granular.nemo_rl.compat: {name!r} is not a registered NeMo-RL name")
    tried = []
    for place in places:
        try:
            mod = importlib.import_module(place)
        except ImportError as err:
            if err.name is not None and not place.startswith(err.name):
                raise            # the module exists but one of ITS imports is missing: say so
            tried.append(place)
            continue
        if hasattr(mod, name):
            return getattr(mod, name)
        tried.append(place)
    raise ImportError(f"NeMo-RL has no {name!r} in {', '.join(tried)} (written against NeMo-RL 7ea279ab and "
                      f"the 0.8 locations)", name=places[0])


def logprob_outputs(out) -> dict:
    """What ``Policy.get_logprobs`` hands back to the loop: ``logprobs`` and, when the workers
    returned it (NeMo-RL 0.8 with top-k / top-p), ``token_mask``."""
    keep = {"logprobs": out["logprobs"]}
    for key in LOGPROB_OPTIONAL_KEYS:
        if key in out:
            keep[key] = out[key]
    return keep


def __getattr__(name: str) -> Any:
    if name in LOCATIONS:
        return get(name)
    raise AttributeError(name)
