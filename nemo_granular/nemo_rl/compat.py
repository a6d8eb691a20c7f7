"""Every NeMo-RL version difference the plugin knows, in one place: names, config keys, behaviours.

Supported NeMo-RL versions (:data:`VERSIONS`): the release **v0.7.0** (2026-07-29, the newest release;
release containers are built from releases) and **main at 7ea279ab** (2026-08-22, ``NEMO_RL_COMMIT``).
:func:`version` detects which one is importable, once per process, without importing NeMo-RL: it
reads ``nemo_rl/package_info.py`` (v0.7.0 says ``0.7.0``; main at 7ea279ab still says ``0.6.0``,
so main is told from a release by ``nemo_rl/algorithms/single_controller.py``, which main has and
v0.7.0 does not). A NeMo-RL older than v0.7.0 is refused in one line.

Nothing else in the package branches on the version: it asks this module.

* names — ``get(name)`` / ``module(short)``: every NeMo-RL name the plugin imports. :data:`LOCATIONS`
  holds the names that live in the same place in every supported version (and NeMo-RL 0.8's documented
  moves as later candidates); :data:`VERSIONED` those that moved, were renamed or are missing in one
  version (``None``: absent there; asking for it raises :class:`NotInThisVersion`, one line naming the
  version and the name).
* config keys — :data:`CONFIG_KEYS` and :func:`adapt_config`: a key one version declares and the other
  does not is dropped where it changes nothing and refused in one line where it would (a drop-in keeps
  NeMo-RL's meaning: v0.7.0 would silently ignore it).
* behaviours — :data:`BEHAVIOURS` and the functions next to them (:func:`conf`,
  :func:`shutdown_environments`, :func:`checkpoint_flush`, :func:`should_use_async_rollouts`,
  :func:`estimator_config`, :func:`require`).

:func:`render_version_table` writes the table of docs/nemo-rl.md from these three tables
(``tests/test_nemo_rl_compat.py`` keeps the page equal to it and checks every row against the
importable NeMo-RL).

    from nemo_granular.nemo_rl import compat
    BatchedDataDict = compat.get("BatchedDataDict")        # or compat.BatchedDataDict
    grpo = compat.module("grpo")                            # a whole module, by short name
    compat.version()                                        # NeMo-RL v0.7.0 (nemo_rl 0.7.0 at ...)

Known moves in NeMo-RL 0.8 (its API reference; not a supported version, the names are found when
they have moved): ``prepare_loss_input`` → ``nemo_rl.algorithms.loss.loss_input``;
``LogprobOutputSpec`` gains an optional ``token_mask`` (:func:`logprob_outputs` keeps it);
``Policy.__init__`` gains keywords (``GranularPolicy`` forwards every keyword unchanged).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

__all__ = [
    "V0_7",
    "MAIN",
    "VERSIONS",
    "TITLES",
    "NemoRLVersion",
    "NotInThisVersion",
    "UnsupportedNemoRL",
    "VersionRefusal",
    "version",
    "LOCATIONS",
    "VERSIONED",
    "MODULES",
    "CONFIG_KEYS",
    "BEHAVIOURS",
    "LOGPROB_OPTIONAL_KEYS",
    "get",
    "find",
    "module",
    "logprob_outputs",
    "conf",
    "adapt_config",
    "require",
    "shutdown_environments",
    "checkpoint_flush",
    "should_use_async_rollouts",
    "estimator_config",
    "fused_linear_logprobs",
    "verify_scores_need_own_call",
    "render_version_table",
]

V0_7, MAIN = "v0.7.0", "main"
VERSIONS = (V0_7, MAIN)
TITLES = {V0_7: "NeMo-RL v0.7.0", MAIN: "NeMo-RL main (7ea279ab)"}
MAIN_MARKER = "algorithms/single_controller.py"  # in main since after v0.7.0; not in v0.7.0


class UnsupportedNemoRL(ImportError):
    """The importable NeMo-RL is none of :data:`VERSIONS`."""


class NotInThisVersion(ImportError):
    """A NeMo-RL name the detected version does not have."""


class VersionRefusal(ValueError):
    """A config or feature the detected NeMo-RL version cannot run (one line, names both)."""


@dataclass(frozen=True)
class NemoRLVersion:
    key: str  # V0_7 or MAIN
    package_version: str  # nemo_rl/package_info.py, e.g. "0.7.0"
    root: str  # the nemo_rl package folder

    @property
    def title(self) -> str:
        return TITLES[self.key]

    def __str__(self) -> str:
        return f"{self.title} (nemo_rl {self.package_version} at {self.root})"


def _package_version(root: Path) -> tuple[int, ...]:
    consts: dict[str, Any] = {}
    for node in ast.parse((root / "package_info.py").read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            with contextlib.suppress(ValueError):
                consts[node.targets[0].id] = ast.literal_eval(node.value)
    return tuple(int(consts[k]) for k in ("MAJOR", "MINOR", "PATCH"))


def classify(root: str | Path) -> NemoRLVersion:
    """The supported version a ``nemo_rl`` package folder is (:class:`UnsupportedNemoRL` if none)."""
    root = Path(root)
    try:
        ver = _package_version(root)
    except (OSError, SyntaxError, KeyError, ValueError) as err:
        raise UnsupportedNemoRL(f"cannot read NeMo-RL's version from {root / 'package_info.py'} ({err})") from None
    text = ".".join(map(str, ver))
    if (root / MAIN_MARKER).is_file() or ver[:2] > (0, 7):
        return NemoRLVersion(MAIN, text, str(root))
    if ver[:2] == (0, 7):
        return NemoRLVersion(V0_7, text, str(root))
    raise UnsupportedNemoRL(
        f"NeMo-RL {text} at {root} is not supported: nemo-granular runs on {' and '.join(TITLES.values())}"
    )


@functools.cache
def version() -> NemoRLVersion:
    """The importable NeMo-RL's version, detected once (NeMo-RL itself is not imported)."""
    spec = importlib.util.find_spec("nemo_rl")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("NeMo-RL is not importable (no module 'nemo_rl')", name="nemo_rl")
    return classify(next(iter(spec.submodule_search_locations)))


# ------------------------------------------------------------------------------------------ names ---

# name -> modules that define it in every supported version (later candidates: NeMo-RL 0.8's moves)
LOCATIONS: dict[str, tuple[str, ...]] = {
    # driver: entry scripts
    "MasterConfig": ("nemo_rl.algorithms.grpo",),
    "grpo_train": ("nemo_rl.algorithms.grpo",),
    "async_grpo_train": ("nemo_rl.algorithms.grpo",),
    "setup": ("nemo_rl.algorithms.grpo",),
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
    "TrainingSamplingParams": ("nemo_rl.algorithms.logits_sampling_utils",),
    "need_top_k_or_top_p_filtering": ("nemo_rl.algorithms.logits_sampling_utils",),
    "resolve_policy_worker_cls": ("nemo_rl.models.policy.utils",),
    "resolve_generation_worker_cls": ("nemo_rl.models.generation.vllm.utils",),
    "VllmConfig": ("nemo_rl.models.generation.vllm.config",),
    "get_actor_python_env": ("nemo_rl.distributed.ray_actor_environment_registry",),
    "DEFAULT_VENV_DIR": ("nemo_rl.utils.venvs",),
    "git_root": ("nemo_rl.utils.venvs",),
    "create_local_venv": ("nemo_rl.utils.venvs",),
    # loss protocol and the estimators' config (tests)
    "LossType": ("nemo_rl.algorithms.loss.interfaces",),
    "LossInputType": ("nemo_rl.algorithms.loss.interfaces",),
    "ClippedPGLossFn": ("nemo_rl.algorithms.loss.loss_functions",),
    "GRPOAdvantageEstimator": ("nemo_rl.algorithms.advantage_estimator",),
}

# name -> {version: "module" or "module:attribute" (renamed), or None (absent in that version)}
VERSIONED: dict[str, dict[str, str | None]] = {
    "shutdown_environments": {V0_7: None, MAIN: "nemo_rl.algorithms.grpo"},
    "async_ppo_train": {V0_7: None, MAIN: "nemo_rl.algorithms.ppo"},
    "should_use_nemo_gym": {
        V0_7: "nemo_rl.algorithms.grpo:_should_use_nemo_gym",
        MAIN: "nemo_rl.environments.nemo_gym",
    },
    "should_use_async_rollouts": {
        V0_7: "nemo_rl.algorithms.grpo:_should_use_async_rollouts",
        MAIN: "nemo_rl.models.generation.interfaces",
    },
    "AdvEstimatorConfig": {V0_7: "nemo_rl.algorithms.grpo", MAIN: "nemo_rl.algorithms.advantage_estimator"},
    "MetricNormalizer": {V0_7: None, MAIN: "nemo_rl.algorithms.loss.interfaces"},
    "warn_on_unsupported_dataset_config_keys": {V0_7: None, MAIN: "nemo_rl.data.datasets.utils"},
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


def _place(spec: str) -> tuple[str, str | None]:
    mod, _, attr = spec.partition(":")
    return mod, attr or None


def get(name: str) -> Any:
    """``name`` as the detected NeMo-RL version defines it (looked up at each call, so a test or
    deployment that rebinds the attribute in NeMo-RL's module is seen)."""
    if name in VERSIONED:
        ver = version()
        spec = VERSIONED[name][ver.key]
        if spec is None:
            where = {k: v for k, v in VERSIONED[name].items() if v}
            raise NotInThisVersion(
                f"{ver.title} has no {name} (" + "; ".join(f"{TITLES[k]}: {v}" for k, v in where.items()) + ")",
                name=name,
            )
        mod, attr = _place(spec)
        return getattr(importlib.import_module(mod), attr or name)
    places = LOCATIONS.get(name)
    if places is None:
        raise KeyError(f"nemo_granular.nemo_rl.compat: {name!r} is not a registered NeMo-RL name")
    tried = []
    for place in places:
        try:
            mod = importlib.import_module(place)
        except ImportError as err:
            if err.name is not None and not place.startswith(err.name):
                raise  # the module exists but one of ITS imports is missing: say so
            tried.append(place)
            continue
        if hasattr(mod, name):
            return getattr(mod, name)
        tried.append(place)
    raise ImportError(
        f"NeMo-RL has no {name!r} in {', '.join(tried)} (supported: "
        f"{', '.join(TITLES.values())}; and the 0.8 locations)",
        name=places[0],
    )


def find(name: str) -> Any:
    """:func:`get`, or ``None`` where the detected version does not have ``name`` (:data:`VERSIONED`)."""
    try:
        return get(name)
    except NotInThisVersion:
        return None


def logprob_outputs(out) -> dict:
    """What ``Policy.get_logprobs`` hands back to the loop: ``logprobs`` and, when the workers
    returned it (NeMo-RL 0.8 with top-k / top-p), ``token_mask``."""
    keep = {"logprobs": out["logprobs"]}
    for key in LOGPROB_OPTIONAL_KEYS:
        if key in out:
            keep[key] = out[key]
    return keep


# ------------------------------------------------------------------------------------ config keys ---

_UNSET = object()


def conf(obj: Any, dotted: str, default: Any = _UNSET) -> Any:
    """``obj.a.b`` / ``obj["a"]["b"]`` for ``dotted = "a.b"``, whatever each level is: NeMo-RL's
    config sections are pydantic models on main and TypedDicts (plain dicts) on v0.7.0. A missing
    level gives ``default`` (a ``KeyError`` naming the key without one)."""
    cur = obj
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        if isinstance(cur, Mapping):
            found = part in cur
            nxt = cur.get(part)
        else:
            extra = getattr(cur, "model_extra", None) or {}
            found = part in extra or (part in getattr(type(cur), "model_fields", {}) or hasattr(cur, part))
            nxt = extra[part] if part in extra else getattr(cur, part, None)
        if not found or (nxt is None and i < len(parts) - 1):
            if default is _UNSET:
                raise KeyError(dotted)
            return default
        cur = nxt
    return cur


@dataclass(frozen=True)
class ConfigKey:
    """A config key one supported version declares and another does not."""

    versions: tuple[str, ...]  # the versions that declare it
    neutral: Callable[[dict, Any], bool]  # (whole config, value) -> the value means what its absence means
    absent_means: str  # what a version without the key does instead
    note: str = ""


def _same_as(sibling: str) -> Callable[[dict, Any], bool]:
    return lambda cfg, value: value == conf(cfg, sibling, None)


CONFIG_KEYS: dict[str, ConfigKey] = {
    "policy.generation.val_temperature": ConfigKey(
        (MAIN,),
        _same_as("policy.generation.temperature"),
        "validation samples at policy.generation.temperature",
        "main's example configs set it to `${.temperature}`",
    ),
    "policy.generation.val_top_p": ConfigKey(
        (MAIN,), _same_as("policy.generation.top_p"), "validation samples at policy.generation.top_p"
    ),
    "policy.generation.val_top_k": ConfigKey(
        (MAIN,), _same_as("policy.generation.top_k"), "validation samples at policy.generation.top_k"
    ),
    "ppo.async_ppo": ConfigKey(
        (MAIN,),
        lambda cfg, value: not conf(value or {}, "enabled", False),
        "PPO runs synchronously (no async_ppo_train)",
    ),
    "grpo.adv_estimator.reward_weights": ConfigKey(
        (MAIN,), lambda cfg, value: value is None, "GDPO weighs every reward component 1"
    ),
}


def adapt_config(cfg: dict) -> list[str]:
    """Make a resolved config (a plain dict, before NeMo-RL's ``MasterConfig``) fit the detected
    version: a key of :data:`CONFIG_KEYS` that this version does not declare is removed when its
    value changes nothing (returns one line per removal) and refused otherwise
    (:class:`VersionRefusal`, one line naming the key, the version and what that version does)."""
    ver = version()
    notes = []
    for dotted, key in CONFIG_KEYS.items():
        if ver.key in key.versions:
            continue
        parent_path, _, leaf = dotted.rpartition(".")
        parent = conf(cfg, parent_path, None)
        if not isinstance(parent, dict) or leaf not in parent:
            continue
        value = parent[leaf]
        if not key.neutral(cfg, value):
            raise VersionRefusal(
                f"{dotted}: {value!r} needs {' or '.join(TITLES[v] for v in key.versions)}; "
                f"{ver.title} does not have this key ({key.absent_means})"
            )
        del parent[leaf]
        notes.append(
            f"{dotted}: removed ({ver.title} does not have it; {key.absent_means}, which is what {value!r} asks for)"
        )
    return notes


# ------------------------------------------------------------------------------------- behaviours ---

FEATURES: dict[str, dict[str, str | None]] = {
    # feature -> {version: None (available) or what is missing}
    "async_ppo": {V0_7: "async PPO (nemo_rl.algorithms.ppo.async_ppo_train, ppo.async_ppo)", MAIN: None},
    # preflight's set-up checks restate main's setup(); on v0.7.0 they run where its keys exist, but
    # check-by-check agreement with NeMo-RL is established against main only
    "preflight_setup_parity": {
        V0_7: "set-up checks that preflight mirrors check by check (preflight restates "
        "main's setup(); v0.7.0's own setup() accepts every shipped config)",
        MAIN: None,
    },
    # grpo_train indexes metrics["token_mult_prob_error"] / ["gen_kl_error"] after every step on both
    # versions; the loss drops them at metrics_level: minimal (NeMo-RL's next loss, pull request 3751)
    "grpo_minimal_loss_metrics": {
        V0_7: "grpo_train that runs without the loss's token_mult_prob_error / gen_kl_error metrics "
        "(it reads them every step: KeyError)",
        MAIN: "grpo_train that runs without the loss's token_mult_prob_error / gen_kl_error metrics "
        "(it reads them every step: KeyError)",
    },
}


def require(feature: str, where: str = "") -> None:
    """Refuse ``feature`` in one line (:class:`VersionRefusal`) when the detected version lacks it."""
    ver = version()
    missing = FEATURES[feature][ver.key]
    if missing is not None:
        have = (
            " or ".join(TITLES[k] for k, v in FEATURES[feature].items() if v is None)
            or "a NeMo-RL newer than the supported versions"
        )
        raise VersionRefusal(f"{where + ': ' if where else ''}{ver.title} has no {missing}; it needs {have}")


def shutdown_environments(task_to_env: Mapping, val_task_to_env: Mapping | None) -> None:
    """End the environment actors after training: NeMo-RL's ``shutdown_environments`` on main; on
    v0.7.0 nothing, as its ``examples/run_grpo.py`` (the actors end with the Ray job)."""
    if VERSIONED["shutdown_environments"][version().key] is None:
        return
    get("shutdown_environments")(task_to_env, val_task_to_env)


def checkpoint_flush(checkpointer):
    """``with checkpoint_flush(checkpointer): train(...)``: main's ``CheckpointManager`` is a context
    manager that waits for its background saves on exit; v0.7.0's saves in the foreground and is not
    one (a null context)."""
    if hasattr(type(checkpointer), "__enter__"):
        return checkpointer
    return contextlib.nullcontext(checkpointer)


def should_use_async_rollouts(master_config) -> bool:
    """NeMo-RL's "does this generation backend roll out asynchronously": main takes the
    ``policy.generation`` section, v0.7.0 (private ``_should_use_async_rollouts``) the whole config."""
    fn = get("should_use_async_rollouts")
    return bool(fn(master_config) if version().key == V0_7 else fn(master_config.policy["generation"]))


# Megatron's fused linear + logprob kernel: the post-processor's flag and the config key, per version
FUSED_LOGPROBS_ATTR = {V0_7: "use_linear_ce_fusion", MAIN: "use_fused_linear_logprobs"}
FUSED_LOGPROBS_KEY = {
    V0_7: "policy.megatron_cfg.use_linear_ce_fusion_loss",
    MAIN: "policy.megatron_cfg.use_fused_linear_logprobs",
}


def fused_linear_logprobs(post_processor) -> bool:
    """Whether NeMo-RL's Megatron ``LogprobsPostProcessor`` runs the fused kernel (it returns logprobs,
    not logits); the flag is ``use_linear_ce_fusion`` on v0.7.0, ``use_fused_linear_logprobs`` on main."""
    return bool(getattr(post_processor, FUSED_LOGPROBS_ATTR[version().key]))


# keys of grpo.adv_estimator that NeMo-RL reads with [...] (KeyError when missing), per version
ESTIMATOR_REQUIRED: dict[str, tuple[str, ...]] = {
    V0_7: ("name", "normalize_rewards", "use_leave_one_out_baseline"),
    MAIN: (),
}
# what NeMo-RL uses when the whole grpo.adv_estimator section is absent
ESTIMATOR_WITHOUT_SECTION: dict[str, str] = {
    V0_7: "grpo: normalize_rewards from grpo.normalize_rewards (true), use_leave_one_out_baseline from "
    "grpo.use_leave_one_out_baseline (false)",
    MAIN: "AdvEstimatorConfig's defaults: name grpo, normalize_rewards true, use_leave_one_out_baseline true",
}


def estimator_config(master_config, section: str = "grpo") -> dict:
    """``<section>.adv_estimator`` as the detected NeMo-RL's ``_create_advantage_estimator`` sees it, as a
    dict: on v0.7.0 a missing required ``grpo`` key is NeMo-RL's ``KeyError`` and a missing ``grpo``
    section falls back to the ``grpo`` section's top-level keys; on main the model's defaults fill
    the gaps."""
    try:
        ver = version().key
    except ImportError:  # no NeMo-RL in this process (a unit test of the estimator alone): main's rules
        ver = MAIN
    est = conf(master_config, f"{section}.adv_estimator", None)
    if est is None:
        if ver == V0_7 and section == "grpo":
            sec = conf(master_config, section)
            return {
                "name": "grpo",
                "normalize_rewards": conf(sec, "normalize_rewards", True),
                "use_leave_one_out_baseline": conf(sec, "use_leave_one_out_baseline", False),
                "minus_baseline": True,
            }
        return {}
    est = dict(est) if isinstance(est, Mapping) else est.model_dump()
    for key in ESTIMATOR_REQUIRED[ver] if section == "grpo" else ():
        if key not in est:
            raise KeyError(f"{section}.adv_estimator.{key} (required by {TITLES[ver]})")
    return est


def verify_scores_need_own_call() -> bool:
    """Whether the math verifiers' ``verify(..., return_extracted_answer=True)`` can return more scores
    than responses, so that the scores must come from a second call without answers. v0.7.0's
    ``HFVerifyWorker.verify`` appends a score, then, when the answer extraction fails, a second 0.0 in its
    ``except`` (its answers stay one per response); main's picks the answer without raising."""
    return version().key == V0_7


@dataclass(frozen=True)
class Behaviour:
    what: str
    per_version: dict[str, str]
    handled_by: str  # the compat function (or module) that holds it


BEHAVIOURS: tuple[Behaviour, ...] = (
    Behaviour(
        "config sections (`master.grpo`, `master.ppo`)",
        {V0_7: "TypedDicts: plain dicts", MAIN: "pydantic models (attribute access)"},
        "conf",
    ),
    Behaviour(
        "environments after training",
        {
            V0_7: "left to the Ray job's end (no `shutdown_environments`)",
            MAIN: "`shutdown_environments(task_to_env, val_task_to_env)`",
        },
        "shutdown_environments",
    ),
    Behaviour(
        "`CheckpointManager` as a context manager",
        {V0_7: "no (saves in the foreground)", MAIN: "yes: waits for background saves on exit"},
        "checkpoint_flush",
    ),
    Behaviour(
        "async-rollout test",
        {
            V0_7: "`grpo._should_use_async_rollouts(master_config)`",
            MAIN: "`should_use_async_rollouts(policy.generation)`",
        },
        "should_use_async_rollouts",
    ),
    Behaviour(
        "`grpo.adv_estimator` keys",
        {
            V0_7: "`name`, `normalize_rewards`, `use_leave_one_out_baseline` required (`KeyError`); no "
            "section: " + ESTIMATOR_WITHOUT_SECTION[V0_7].split(": ", 1)[1],
            MAIN: "defaults name grpo, normalize_rewards true, use_leave_one_out_baseline true",
        },
        "estimator_config",
    ),
    Behaviour(
        "Megatron's fused linear + logprob kernel (the worker extension refuses it: no logits)",
        {
            V0_7: f"`{FUSED_LOGPROBS_KEY[V0_7]}`, post-processor flag `{FUSED_LOGPROBS_ATTR[V0_7]}`",
            MAIN: f"`{FUSED_LOGPROBS_KEY[MAIN]}`, post-processor flag `{FUSED_LOGPROBS_ATTR[MAIN]}`",
        },
        "fused_linear_logprobs",
    ),
    Behaviour(
        "async PPO (`ppo.async_ppo.enabled: true`)",
        {V0_7: "absent: refused in one line", MAIN: "`async_ppo_train`"},
        "require",
    ),
    Behaviour(
        "`loss_fn.metrics_level: minimal` under `run_grpo`",
        {
            V0_7: "refused in one line (`grpo_train` reads `token_mult_prob_error`)",
            MAIN: "refused in one line (`grpo_train` reads `token_mult_prob_error`)",
        },
        "require",
    ),
    Behaviour(
        "preflight's restated `setup()` checks",
        {
            V0_7: "main's, on the keys v0.7.0 has (agreement with v0.7.0's `setup()` tested on the shipped "
            "configs only)",
            MAIN: "each checked against NeMo-RL's own code",
        },
        "require",
    ),
    Behaviour(
        "math verifier `verify(..., return_extracted_answer=True)` (ESPO's environment)",
        {
            V0_7: "an answer extraction that fails after scoring adds a second score: scores from a second "
            "call without answers",
            MAIN: "one score and one answer per response",
        },
        "verify_scores_need_own_call",
    ),
    Behaviour(
        "split-step metric rescale (`MetricNormalizer`)",
        {
            V0_7: "absent: the losses' local enum stands in (`nemo_granular.protocol`)",
            MAIN: "per metric, by the loss's `metric_normalizations`",
        },
        "nemo_granular.protocol",
    ),
)


def render_version_table() -> str:
    """The version table of docs/nemo-rl.md, from :data:`VERSIONED`, :data:`CONFIG_KEYS` and
    :data:`BEHAVIOURS`."""
    pipe = "\\|"

    def cell(text: str) -> str:
        return text.replace("|", pipe)

    rows = [f"| kind | what | {' | '.join(TITLES[v] for v in VERSIONS)} |", "|---|---|---|---|"]
    for name, places in VERSIONED.items():
        cells = []
        for v in VERSIONS:
            spec = places[v]
            if spec is None:
                cells.append("absent")
            else:
                mod, attr = _place(spec)
                cells.append(f"`{mod}.{attr or name}`")
        rows.append(f"| name | `{name}` | {' | '.join(cells)} |")
    for dotted, key in CONFIG_KEYS.items():
        cells = [
            ("declared" + (f" ({key.note})" if key.note else ""))
            if v in key.versions
            else f"absent: {key.absent_means}; dropped when it means the same, else refused"
            for v in VERSIONS
        ]
        rows.append(f"| config key | `{dotted}` | {' | '.join(cell(c) for c in cells)} |")
    for b in BEHAVIOURS:
        rows.append(f"| behaviour | {cell(b.what)} | {' | '.join(cell(b.per_version[v]) for v in VERSIONS)} |")
    return "\n".join(rows)


def __getattr__(name: str) -> Any:
    if name in LOCATIONS or name in VERSIONED:
        return get(name)
    raise AttributeError(name)
