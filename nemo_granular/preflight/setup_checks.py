"""NeMo-RL's ``setup()`` / train-loop start-up checks, before any Ray or GPU work.

Each function mirrors the assertions of one NeMo-RL function at commit 7ea279ab (main) and returns
findings instead of raising. On NeMo-RL v0.7.0 the same checks run with the config read through
``compat.conf`` (its sections are dicts there); the NeMo-RL check functions v0.7.0 lacks are not
called, and the inlined checks on keys v0.7.0 does not have see main's defaults, so they pass.
Where NeMo-RL has the check as a callable pure function of the
config, it is called (``_call``); where the check is inlined in ``setup()``, it is re-stated here
with the exact NeMo-RL ``file:function`` in the finding's source. ``tests/test_preflight_nemo_rl.py``
drives NeMo-RL's real ``setup()`` on each failing case and on every shipped config to prove the
two agree.

``master`` is NeMo-RL's own ``MasterConfig`` (pydantic, NeMo-RL's defaults filled in), as
``setup()`` receives it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .findings import Finding, error

__all__ = ["grpo_setup_checks", "ppo_setup_checks"]

GRPO = "nemo_rl/algorithms/grpo.py"
PPO = "nemo_rl/algorithms/ppo.py"


def _call(source: str, fn: Callable[[], Any]) -> list[Finding]:
    """Run one of NeMo-RL's own check functions; its AssertionError/ValueError/NotImplementedError is the finding."""
    try:
        fn()
    except (AssertionError, ValueError, NotImplementedError) as err:
        return [error(source, str(err).strip() or type(err).__name__)]
    return []


def _nemo_rl_check(grpo, name: str, *args, **kwargs) -> list[Finding]:
    """NeMo-RL's own check ``grpo.<name>(...)`` where the importable version has it (v0.7.0 lacks some:
    docs/nemo-rl.md, "NeMo-RL versions")."""
    fn = getattr(grpo, name, None)
    return [] if fn is None else _call(f"{GRPO}:{name}", lambda: fn(*args, **kwargs))


def _sampling_override_checks(gen: dict, nemo_gym: bool) -> list[Finding]:
    src = f"{GRPO}:setup"
    # a key the NeMo-RL version does not have (v0.7.0: compat.adapt_config dropped it) means "the same"
    overridden = any(gen.get(f"val_{k}", gen.get(k)) != gen.get(k) for k in ("temperature", "top_p", "top_k"))
    if not overridden:
        return []
    out = []
    if not (gen.get("backend") == "vllm" and nemo_gym):
        out.append(
            error(
                src,
                "policy.generation.val_temperature/val_top_p/val_top_k differ from temperature/top_p/"
                "top_k: only supported for vLLM NeMo-Gym rollouts",
            )
        )
    if gen.get("val_top_k"):
        out.append(
            error(
                src,
                "policy.generation.val_top_k is not supported (NeMo-Gym honours only val_temperature/"
                "val_top_p); leave it null",
            )
        )
    return out


def _fp8_generation_checks(src: str, master, policy: dict, gen: dict) -> list[Finding]:
    """The vLLM FP8 weight / KV-cache assertions ``setup()`` makes before starting vLLM."""
    from ..nemo_rl import compat

    if gen.get("backend") != "vllm":
        return []
    vllm = gen.get("vllm_cfg") or {}
    out = []
    if vllm.get("precision") == "fp8" and not master.loss_fn.use_importance_sampling_correction:
        out.append(
            error(
                src, "policy.generation.vllm_cfg.precision=fp8 needs loss_fn.use_importance_sampling_correction: true"
            )
        )
    if str(vllm.get("kv_cache_dtype", "auto")).startswith("fp8"):
        if vllm.get("precision") != "fp8":
            out.append(
                error(src, f"vllm_cfg.kv_cache_dtype={vllm.get('kv_cache_dtype')!r} needs vllm_cfg.precision=fp8")
            )
        if (policy.get("dtensor_cfg") or {}).get("enabled"):
            out.append(error(src, "an fp8 vLLM KV cache is not supported with the DTensor policy backend"))
        if compat.should_use_async_rollouts(master):
            out.append(error(src, "an fp8 vLLM KV cache is not supported with async rollouts"))
        if ((policy.get("megatron_cfg") or {}).get("pipeline_model_parallel_size", 1)) != 1:
            out.append(error(src, "an fp8 vLLM KV cache needs policy.megatron_cfg.pipeline_model_parallel_size=1"))
    return out


def _force_on_policy_check(src: str, master, section: str) -> list[Finding]:
    from ..nemo_rl.compat import conf

    if not master.loss_fn.force_on_policy_ratio:
        return []
    rows = conf(master, f"{section}.num_prompts_per_step") * conf(master, f"{section}.num_generations_per_prompt")
    gbs = master.policy["train_global_batch_size"]
    if rows != gbs:
        return [
            error(
                src,
                f"loss_fn.force_on_policy_ratio needs policy.train_global_batch_size ({gbs}) == "
                f"num_prompts_per_step × num_generations_per_prompt ({rows})",
            )
        ]
    return []


def grpo_setup_checks(master) -> list[Finding]:
    """``nemo_rl/algorithms/grpo.py:setup`` (up to the clusters) and the config-only checks of the loop."""
    from ..nemo_rl import compat

    grpo = compat.module("grpo")
    TrainingSamplingParams = compat.get("TrainingSamplingParams")
    need_top_k_or_top_p_filtering = compat.get("need_top_k_or_top_p_filtering")
    should_use_nemo_gym = compat.get("should_use_nemo_gym")

    src = f"{GRPO}:setup"
    policy, loss = master.policy, master.loss_fn

    def g(key: str, default=None):  # grpo.<key>: a pydantic model on main, a dict on v0.7.0 (defaults: main's)
        return compat.conf(master, f"grpo.{key}", default)

    gen = policy.get("generation") or {}  # None is refused by NeMo-RL's MasterConfig already
    out: list[Finding] = []
    if gen.get("backend") == "dynamo" and g("async_grpo.in_flight_weight_updates", False):
        out.append(
            error(src, "grpo.async_grpo.in_flight_weight_updates must be false with policy.generation.backend=dynamo")
        )
    out += _nemo_rl_check(grpo, "_validate_multimodal_dedup_capability", master)
    nemo_gym: list[bool] = []
    out += _call(
        "nemo_rl/environments/nemo_gym.py:should_use_nemo_gym",
        lambda: nemo_gym.append(bool(should_use_nemo_gym(master))),
    )
    out += _sampling_override_checks(gen, bool(nemo_gym and nemo_gym[0]))
    val_gens = g("val_num_generations_per_prompt", 1)
    if val_gens < 1:
        out.append(error(src, "grpo.val_num_generations_per_prompt must be >= 1"))
    if g("stop_at_validation_metric") == "pass_k" and val_gens <= 1:
        out.append(error(src, "grpo.stop_at_validation_metric='pass_k' needs grpo.val_num_generations_per_prompt > 1"))
    dynamic, multiplier = g("use_dynamic_sampling", False), g("batch_multiplier", 1)
    if not dynamic and multiplier != 1:
        out.append(error(src, f"grpo.batch_multiplier={multiplier} needs grpo.use_dynamic_sampling: true"))
    if g("stop_at_validation_metric") is not None and g("stop_at_validation_threshold") is None:
        out.append(error(src, "grpo.stop_at_validation_threshold must be set when grpo.stop_at_validation_metric is"))
    data = master.data
    if data.get("use_multiple_dataloader"):
        prompts = g("num_prompts_per_step") * (multiplier if dynamic else 1)
        per_loader = data.get("num_prompts_per_dataloader") or 0
        per_loader = per_loader * (multiplier if dynamic else 1)
        if not per_loader or int(prompts) % int(per_loader):
            out.append(
                error(
                    src,
                    f"grpo.num_prompts_per_step ({int(prompts)}) must be a multiple of "
                    f"data.num_prompts_per_dataloader ({int(per_loader)})",
                )
            )
    meg = policy.get("megatron_cfg") or {}
    if meg.get("enabled") and meg.get("use_fused_linear_logprobs"):
        if policy["sequence_packing"]["enabled"]:
            out.append(
                error(
                    src,
                    "policy.megatron_cfg.use_fused_linear_logprobs is not supported with "
                    "policy.sequence_packing.enabled for GRPO",
                )
            )
        if need_top_k_or_top_p_filtering(TrainingSamplingParams(top_k=gen.get("top_k"), top_p=gen.get("top_p"))):
            out.append(
                error(
                    src,
                    "policy.megatron_cfg.use_fused_linear_logprobs does not support top-k/top-p "
                    "training-time filtering (policy.generation.top_k/top_p)",
                )
            )
    out += _force_on_policy_check(src, master, "grpo")
    if g("skip_reference_policy_logprobs_calculation", False) and loss.reference_policy_kl_penalty != 0:
        out.append(
            error(
                src,
                "grpo.skip_reference_policy_logprobs_calculation: true needs "
                f"loss_fn.reference_policy_kl_penalty == 0 (got {loss.reference_policy_kl_penalty})",
            )
        )
    out += _nemo_rl_check(grpo, "_validate_use_kl_in_reward_compat", master)
    out += _nemo_rl_check(
        grpo,
        "_raise_if_reward_penalties_enabled_without_nemo_gym",
        master,
        enable_nemo_gym=bool(nemo_gym and nemo_gym[0]),
    )
    out += _nemo_rl_check(grpo, "_resolve_message_level_advantage_penalties", master)
    out += _fp8_generation_checks(src, master, policy, gen)
    if gen.get("refit_transport") is not None and gen.get("backend") != "vllm":
        out.append(error(src, "policy.generation.refit_transport must be null unless policy.generation.backend=vllm"))
    return out


def ppo_setup_checks(master) -> list[Finding]:
    """``nemo_rl/algorithms/ppo.py:setup`` (up to the clusters, plus the generation-backend asserts) and
    ``ppo_train``'s reference-logprob check."""
    from ..nemo_rl.compat import conf

    src = f"{PPO}:setup"
    policy, value, loss = master.policy, master.value, master.loss_fn

    def p(key: str, default=None):  # ppo.<key>: a pydantic model on main, a dict on v0.7.0 (defaults: main's)
        return conf(master, f"ppo.{key}", default)

    gen = policy.get("generation") or {}  # None is refused by NeMo-RL's MasterConfig already
    out: list[Finding] = []
    if gen.get("backend") == "vllm" and gen.get("refit_transport") is not None:
        out.append(
            error(
                src,
                f"policy.generation.refit_transport={gen.get('refit_transport')!r} is not supported by "
                f"PPO; set it to null",
            )
        )
    meg = policy.get("megatron_cfg") or {}
    ckpt = master.checkpointing
    if (
        meg.get("enabled")
        and p("policy_training_start_step", 0) > 0
        and ckpt.get("enabled")
        and ckpt.get("save_optimizer")
        and (meg.get("checkpoint") or {}).get("ckpt_assume_constant_structure")
    ):
        out.append(
            error(
                src,
                "policy.megatron_cfg.checkpoint.ckpt_assume_constant_structure is incompatible with "
                "critic warm-up (ppo.policy_training_start_step > 0) and optimizer checkpointing",
            )
        )
    vmeg, vdt = value.get("megatron_cfg") or {}, value.get("dtensor_cfg") or {}
    if vmeg.get("enabled"):
        if vmeg.get("context_parallel_size", 1) > 1 and not value["sequence_packing"]["enabled"]:
            out.append(error(src, "value.megatron_cfg.context_parallel_size > 1 needs value.sequence_packing.enabled"))
    elif not vdt.get("enabled"):
        out.append(error(src, "exactly one of value.megatron_cfg.enabled / value.dtensor_cfg.enabled must be true"))
    else:
        if value["sequence_packing"]["enabled"] is not False:
            out.append(error(src, "value.sequence_packing.enabled must be false for the DTensor value model"))
        if vdt.get("context_parallel_size", 1) != 1:
            out.append(error(src, "value.dtensor_cfg.context_parallel_size must be 1 for the DTensor value model"))
        if value["dynamic_batching"]["enabled"] is not False:
            out.append(error(src, "value.dynamic_batching.enabled must be false for the DTensor value model"))
    if not p("use_dynamic_sampling", False) and p("batch_multiplier", 1) != 1:
        out.append(error(src, f"ppo.batch_multiplier={p('batch_multiplier')} needs ppo.use_dynamic_sampling: true"))
    out += _force_on_policy_check(src, master, "ppo")
    backend = gen.get("backend")
    if backend not in ("vllm", "sglang"):
        out.append(error(src, f"PPO needs policy.generation.backend vllm or sglang (got {backend!r})"))
    out += _fp8_generation_checks(src, master, policy, gen)
    if p("skip_reference_policy_logprobs_calculation", False) and loss.reference_policy_kl_penalty != 0:
        out.append(
            error(
                f"{PPO}:ppo_train",
                "ppo.skip_reference_policy_logprobs_calculation: true needs "
                f"loss_fn.reference_policy_kl_penalty == 0 "
                f"(got {loss.reference_policy_kl_penalty})",
            )
        )
    return out
