"""``nemo-granular preflight`` against NeMo-RL's own behaviour, config by config.

World: NeMo-RL (``nemo_rl_src``; the Megatron validators also ``megatron_workers``), both versions: on
v0.7.0 the shipped configs and the pre-fix case run against v0.7.0's own ``setup()``; the check-by-check
cases and the drift guards are main's (``needs_nemo_rl("preflight_setup_parity")``).

* Every shipped config (``examples/configs/*.yaml``, ``examples/configs/nemo_rl/*.yaml``) passes
  preflight with no error, AND NeMo-RL's real start-up accepts it: ``MasterConfig``, ``setup()``
  up to the policy/critic workers, ``VllmGeneration.__init__``, ``Policy.__init__``,
  ``Value.__init__`` (tests/harness/nemo_rl_setup_driver.py lists the Ray/GPU edges it stands in for), and
  the Megatron worker's config validators.
* Each check has a failing config: an override of a shipped config that preflight reports with the
  NeMo-RL ``file:function`` it mirrors, and that NeMo-RL's real code rejects with its own message
  at that place — or, for the checks that sit where no CPU drive reaches (inside ``ppo_train``,
  Megatron's process groups, Automodel's distributed set-up), whose guarded expression is still in
  NeMo-RL's / Megatron's source (drift guard).
* The pre-fix Megatron configs (``defer_fp32_logits`` inherited as false with a logprob chunk):
  tests/harness/preflight_fixtures/espo_qwen3_30b_a3b_before_defer_fix.yaml reproduces them; preflight
  catches it and NeMo-RL's real ``_validate_chunking_config`` raises — while ``setup()`` accepts
  it, which is why the first GPU run would have died at worker init.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from nemo_rl_setup_driver import drive_megatron_validators, drive_setup

pytestmark = pytest.mark.v070

ROOT = Path(__file__).resolve().parents[1]
CFG = ROOT / "examples" / "configs"
SHIPPED = sorted(p.relative_to(CFG).as_posix() for p in [*CFG.glob("*.yaml"), *(CFG / "nemo_rl").glob("*.yaml")])
FIXTURE = ROOT / "tests" / "harness" / "preflight_fixtures" / "espo_qwen3_30b_a3b_before_defer_fix.yaml"
GRPO_BASE = "sspo_qwen2.5_math_1.5b.yaml"  # Megatron, 1 node x 8 GPUs, TP 1, packing
MOE_BASE = "espo_qwen3_30b_a3b_megatron.yaml"  # Megatron, 8 x 8, TP 4 PP 2 CP 2 EP 8
PPO_BASE = "sppo_r1_distill_qwen_1.5b.yaml"  # DTensor v2 policy and critic
RUNTIMES: dict[str, float] = {}


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")


def preflight(name: str | Path, overrides=(), driver="auto"):
    from nemo_granular.preflight.run import run_preflight

    return run_preflight(
        CFG / name if isinstance(name, str) else name, list(overrides), driver=driver, check_venvs=False
    )


def errors(res) -> list:
    return [f for f in res.findings if f.level == "error"]


def resolved(name, overrides=()):
    from nemo_granular.nemo_rl.configs import load_resolved

    return load_resolved(CFG / name if isinstance(name, str) else name, list(overrides))


# ------------------------------------------------------------------------ shipped configs ---


@pytest.mark.nemo_rl
@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_config_passes_preflight_and_nemo_rl_accepts_it(
    name, nemo_rl_src, megatron_workers, tmp_path, monkeypatch
):
    t0 = time.perf_counter()
    res = preflight(name)
    RUNTIMES[name] = time.perf_counter() - t0
    assert not errors(res), [f.line() for f in errors(res)]
    assert res.plan["layout"]["train_world"] >= 1 and res.plan["policy_parallel"]["dp"] >= 1
    cfg = res.resolved
    assert drive_setup(cfg, res.driver, tmp_path, monkeypatch) == "reached"
    for section in ("policy", "value"):
        if ((cfg.get(section) or {}).get("megatron_cfg") or {}).get("enabled"):
            assert drive_megatron_validators(cfg[section]) == "accepted"


@pytest.mark.nemo_rl
def test_preflight_names_the_nemo_rl_version_it_checked_against(nemo_rl_src, capsys):
    """The plan's second line is the detected NeMo-RL version (both worlds); on v0.7.0 a key that version
    lacks, with a value that would change what it does, is refused in one line naming both versions."""
    from nemo_granular.nemo_rl import compat
    from nemo_granular.preflight.cli import main

    cfg = str(CFG / "grpo_r1_distill_qwen_1.5b.yaml")
    assert main([cfg, "--no-venv-check"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == f"  nemo-rl   checked against {compat.version()}"
    rc = main(
        [
            cfg,
            "policy.generation.val_temperature=0.9"
            if compat.version().key == compat.MAIN
            else "++policy.generation.val_temperature=0.9",
            "--no-venv-check",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    if compat.version().key == compat.V0_7:
        assert rc == 2 and err[-1] == (
            "nemo-granular preflight: error: policy.generation.val_temperature: 0.9 needs "
            "NeMo-RL main (7ea279ab); NeMo-RL v0.7.0 does not have this key (validation "
            "samples at policy.generation.temperature)"
        )
    else:  # main has the key; NeMo-RL's setup() allows a different value only with NeMo-Gym
        assert rc == 1 and any("val_temperature" in line for line in err)


def test_report_preflight_runtime_per_config():
    """Not an assertion on time: prints the per-config preflight runtime measured above (the drive and
    NeMo-RL's import are not included)."""
    if RUNTIMES:
        print("\npreflight seconds per config: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(RUNTIMES.items())))
    assert all(v >= 0 for v in RUNTIMES.values())


# --------------------------------------------------------------- the pre-fix defer_fp32 case ---


@pytest.mark.nemo_rl
def test_pre_fix_megatron_config_is_caught_by_preflight_and_rejected_by_nemo_rl(
    nemo_rl_src, megatron_workers, tmp_path, monkeypatch
):
    res = preflight(FIXTURE, driver="grpo")
    srcs = [f.source for f in errors(res)]
    assert srcs == ["nemo_rl/models/megatron/setup.py:_validate_chunking_config"], [f.line() for f in res.findings]
    cfg = res.resolved
    assert cfg["policy"]["logprob_chunk_size"] == 2048 and cfg["policy"]["megatron_cfg"]["defer_fp32_logits"] is False
    # NeMo-RL's setup() does not see it; the worker's set-up does
    assert drive_setup(cfg, "grpo", tmp_path, monkeypatch) == "reached"
    assert drive_megatron_validators(cfg["policy"]) == "defer_fp32_logits must be True if logprob_chunk_size is set"
    # and the shipped file, fixed, passes both
    fixed = resolved(MOE_BASE)
    assert fixed["policy"]["megatron_cfg"]["defer_fp32_logits"] is True
    assert drive_megatron_validators(fixed["policy"]) == "accepted"


# --------------------------------------------------------------------- one failing case each ---
# (id, base config, overrides, preflight source, NeMo-RL stage, fragment of NeMo-RL's own message)
GRPO = "nemo_rl/algorithms/grpo.py:setup"
PPO = "nemo_rl/algorithms/ppo.py:setup"
LM = "nemo_rl/models/policy/lm_policy.py:Policy.__init__"
VLLM = "nemo_rl/models/generation/vllm/vllm_generation.py:VllmGeneration.__init__"
MS = "nemo_rl/models/megatron/setup.py"
CASES = [
    (
        "val-generations",
        GRPO_BASE,
        ["grpo.val_num_generations_per_prompt=0"],
        GRPO,
        "setup",
        "val_num_generations_per_prompt must be >= 1",
    ),
    (
        "batch-multiplier",
        GRPO_BASE,
        ["grpo.batch_multiplier=2.0"],
        GRPO,
        "setup",
        "batch_multiplier>1 can only be used if use_dynamic_sampling=True",
    ),
    (
        "pass-k",
        GRPO_BASE,
        ["grpo.stop_at_validation_metric=pass_k", "grpo.stop_at_validation_threshold=0.5"],
        GRPO,
        "setup",
        "requires grpo.val_num_generations_per_prompt > 1",
    ),
    (
        "stop-threshold",
        GRPO_BASE,
        ["grpo.stop_at_validation_metric=accuracy"],
        GRPO,
        "setup",
        "stop_at_validation_threshold must be set",
    ),
    (
        "fused-linear-packing",
        GRPO_BASE,
        ["policy.megatron_cfg.use_fused_linear_logprobs=true"],
        GRPO,
        "setup",
        "Linear CE fusion loss is not supported with sequence packing",
    ),
    (
        "skip-reference-with-kl",
        GRPO_BASE,
        ["loss_fn.reference_policy_kl_penalty=0.01"],
        GRPO,
        "setup",
        "skip_reference_policy_logprobs_calculation=True requires",
    ),
    (
        "force-on-policy-batch",
        GRPO_BASE,
        ["loss_fn.force_on_policy_ratio=true", "+nemo_granular.allow_ratio_always_one=true"],
        GRPO,
        "setup",
        "force_on_policy_ratio requires train_global_batch_size",
    ),
    (
        "val-sampling",
        GRPO_BASE,
        ["policy.generation.val_temperature=0.5"],
        GRPO,
        "setup",
        "only supported for vLLM NeMo-Gym rollouts",
    ),
    (
        "fp8-kv-cache",
        GRPO_BASE,
        ["policy.generation.vllm_cfg.kv_cache_dtype=fp8"],
        GRPO,
        "setup",
        "requires precision='fp8'",
    ),
    (
        "non-colocated-one-node",
        GRPO_BASE,
        ["policy.generation.colocated.enabled=false"],
        GRPO,
        "setup",
        "must be explicitly set to a value > 0",
    ),
    (
        "world-not-divisible",
        GRPO_BASE,
        ["policy.megatron_cfg.tensor_model_parallel_size=3"],
        LM,
        "setup",
        "must be divisible by PP * CP * TP",
    ),
    (
        "tp4-batch-variance",
        GRPO_BASE,
        [
            "policy.megatron_cfg.tensor_model_parallel_size=4",
            "policy.make_sequence_length_divisible_by=4",
            "policy.logprob_batch_size=1",
        ],
        LM,
        "setup",
        "known batch-variant accuracy issue",
    ),
    (
        "dynamic-batching-pp",
        GRPO_BASE,
        [
            "policy.megatron_cfg.pipeline_model_parallel_size=2",
            "policy.dynamic_batching.enabled=true",
            "policy.sequence_packing.enabled=false",
        ],
        LM,
        "setup",
        "only supported for single pipeline parallel stage",
    ),
    (
        "vllm-tp",
        GRPO_BASE,
        ["policy.generation.vllm_cfg.tensor_parallel_size=3"],
        VLLM,
        "setup",
        "World size must be a multiple of model parallel size",
    ),
    (
        "vllm-ep",
        GRPO_BASE,
        ["policy.generation.vllm_cfg.tensor_parallel_size=2", "policy.generation.vllm_cfg.expert_parallel_size=3"],
        VLLM,
        "setup",
        "EP must be a multiple of TP",
    ),
    (
        "vllm-pp-sync",
        GRPO_BASE,
        ["policy.generation.vllm_cfg.pipeline_parallel_size=2"],
        VLLM,
        "setup",
        "async_engine must be set to True",
    ),
    ("vllm-top-p", GRPO_BASE, ["policy.generation.top_p=1.5"], VLLM, "setup", "top_p valid values"),
    (
        "cp-without-packing",
        GRPO_BASE,
        ["policy.megatron_cfg.context_parallel_size=2", "policy.sequence_packing.enabled=false"],
        f"{MS}:_apply_parallelism_config",
        "megatron",
        "Sequence Packing must be enabled to use Context Parallelism",
    ),
    (
        "optimizer-offload",
        GRPO_BASE,
        [
            "policy.megatron_cfg.optimizer.optimizer_cpu_offload=true",
            "policy.megatron_cfg.optimizer.optimizer_offload_fraction=0.0",
        ],
        f"{MS}:_validate_optimizer_config",
        "megatron",
        "requires 0 < optimizer_offload_fraction <= 1",
    ),
    (
        "schema-literal",
        GRPO_BASE,
        ["policy.megatron_cfg.recompute_granularity=layers"],
        "nemo_rl/algorithms/grpo.py:MasterConfig",
        "setup",
        "recompute_granularity",
    ),
    (
        "attention-backend",
        GRPO_BASE,
        ["+policy.megatron_cfg.attention_backend=sdpa"],
        f"{MS}:_apply_performance_config",
        "megatron",
        "Invalid attention backend",
    ),
    (
        "router-replay-vpp",
        MOE_BASE,
        ["+policy.megatron_cfg.virtual_pipeline_model_parallel_size=2"],
        "nemo_rl/models/megatron/router_replay.py:validate_router_replay_config",
        "megatron",
        "does not support virtual pipeline parallelism",
    ),
    (
        "chunk-without-defer",
        GRPO_BASE,
        ["policy.megatron_cfg.defer_fp32_logits=false"],
        f"{MS}:_validate_chunking_config",
        "megatron",
        "defer_fp32_logits must be True",
    ),
    (
        "rows-vs-global-batch",
        GRPO_BASE,
        ["policy.train_global_batch_size=96"],
        "nemo_rl/distributed/batched_data_dict.py:BatchedDataDict.shard_by_batch_size",
        "shard",
        "is not a multiple of batch_size",
    ),
    (
        "unknown-estimator",
        GRPO_BASE,
        ["grpo.adv_estimator.name=gae"],
        "nemo_rl/algorithms/grpo.py:_create_advantage_estimator",
        "estimator",
        "Invalid adv_estimator name",
    ),
    (
        "schema",
        GRPO_BASE,
        ["grpo.num_prompts_per_step=many"],
        "nemo_rl/algorithms/grpo.py:MasterConfig",
        "setup",
        "num_prompts_per_step",
    ),
    (
        "ppo-batch-multiplier",
        PPO_BASE,
        ["ppo.batch_multiplier=2.0"],
        PPO,
        "setup",
        "batch_multiplier>1 can only be used",
    ),
    (
        "ppo-value-packing",
        PPO_BASE,
        ["value.sequence_packing.enabled=true"],
        PPO,
        "setup",
        "Sequence packing is currently not supported for the DTensor PPO value model",
    ),
    (
        "value-v1",
        PPO_BASE,
        ["value.dtensor_cfg._v2=false"],
        "nemo_rl/models/value/lm_value.py:Value.__init__",
        "setup",
        "DTensor value models require value.dtensor_cfg._v2=true",
    ),
    (
        "ppo-world",
        PPO_BASE,
        ["policy.dtensor_cfg.tensor_parallel_size=3"],
        LM,
        "setup",
        "must be divisible by PP * CP * TP",
    ),
    (
        "nemo-gym-sync",
        GRPO_BASE,
        ["+env.should_use_nemo_gym=true"],
        "nemo_rl/environments/nemo_gym.py:should_use_nemo_gym",
        "setup",
        "you must use a generation backend with `async_engine: true`",
    ),
    (
        "multiple-dataloaders",
        GRPO_BASE,
        ["data.use_multiple_dataloader=true", "+data.num_prompts_per_dataloader=48"],
        GRPO,
        "setup",
        "Expected num_prompts_per_step to be a multiple of num_prompts_per_dataloader",
    ),
    (
        "fused-linear-top-k",
        GRPO_BASE,
        [
            "policy.megatron_cfg.use_fused_linear_logprobs=true",
            "policy.sequence_packing.enabled=false",
            "policy.generation.top_k=50",
        ],
        GRPO,
        "setup",
        "not supported with top-k/top-p training-time filtering",
    ),
    (
        "reward-penalties",
        GRPO_BASE,
        ["reward_penalties.penalize_empty_final_answer=true"],
        "nemo_rl/algorithms/grpo.py:_raise_if_reward_penalties_enabled_without_nemo_gym",
        "setup",
        "reward_penalties require the NeMo-Gym path",
    ),
    (
        "message-penalties",
        GRPO_BASE,
        ["+grpo.invalid_tool_call_advantage=-1.0"],
        "nemo_rl/algorithms/grpo.py:_resolve_message_level_advantage_penalties",
        "call:_resolve_message_level_advantage_penalties",
        "require the NeMo-Gym path",
    ),
    (
        "kl-in-reward-forced-ratio",
        GRPO_BASE,
        [
            "loss_fn.use_kl_in_reward=true",
            "loss_fn.reference_policy_kl_penalty=0.01",
            "grpo.skip_reference_policy_logprobs_calculation=false",
            "loss_fn.force_on_policy_ratio=true",
            "+nemo_granular.allow_ratio_always_one=true",
            "policy.train_global_batch_size=1024",
        ],
        "nemo_rl/algorithms/grpo.py:_validate_use_kl_in_reward_compat",
        "setup",
        "requires real prev_logprobs",
    ),
    (
        "fp8-needs-importance-sampling",
        GRPO_BASE,
        ["policy.generation.vllm_cfg.precision=fp8"],
        GRPO,
        "setup",
        "Importance sampling must be enabled for vLLM FP8 generation",
    ),
    (
        "non-colocated-multi-node",
        MOE_BASE,
        ["policy.generation.colocated.enabled=false"],
        "nemo_rl/algorithms/grpo.py:setup",
        "setup",
        "'>' not supported between instances of 'NoneType' and 'int'",
    ),  # NeMo-RL's own crash
    (
        "both-backends",
        GRPO_BASE,
        ["policy.dtensor_cfg.enabled=true"],
        LM,
        "setup",
        "Configure either Megatron (policy.megatron_cfg.enabled=true) or DTensor",
    ),
    (
        "dtensor-v1-replicate",
        "nemo_rl/sspo_math_1B.yaml",
        [
            "policy.dtensor_cfg._v2=false",
            "+policy.dtensor_cfg.dp_replicate_size=2",
            "nemo_granular.entropy_source=current_logits",
        ],
        LM,
        "setup",
        "dp_replicate_size > 1 requires policy.dtensor_cfg._v2: true",
    ),
    (
        "vllm-dp-async",
        GRPO_BASE,
        [
            "policy.generation.vllm_cfg.async_engine=true",
            "policy.generation.vllm_cfg.tensor_parallel_size=2",
            "policy.generation.vllm_cfg.expert_parallel_size=4",
        ],
        VLLM,
        "setup",
        "vLLM async_engine has some issues when using DP inside vLLM",
    ),
    ("vllm-top-k", GRPO_BASE, ["policy.generation.top_k=0"], VLLM, "setup", "top_k valid values"),
    (
        "activation-offload",
        GRPO_BASE,
        ["policy.megatron_cfg.fine_grained_activation_offloading=true"],
        f"{MS}:_apply_performance_config",
        "megatron",
        "offload_modules must be a non-empty list",
    ),
    (
        "cpu-optimizer-overlap",
        GRPO_BASE,
        ["policy.megatron_cfg.optimizer.overlap_cpu_optimizer_d2h_h2d=true"],
        f"{MS}:_validate_optimizer_config",
        "megatron",
        "overlap_cpu_optimizer_d2h_h2d=True requires",
    ),
    (
        "cp-fused-linear",
        MOE_BASE,
        ["policy.megatron_cfg.use_fused_linear_logprobs=true"],
        f"{MS}:_apply_parallelism_config",
        "megatron",
        "Context Parallelism is not supported with linear CE fusion",
    ),
    (
        "global-batch-vs-dp",
        GRPO_BASE,
        ["policy.train_global_batch_size=4"],
        "nemo_rl/distributed/batched_data_dict.py:BatchedDataDict.shard_by_batch_size",
        "shard",
        "is not a multiple of shards",
    ),
    (
        "micro-batch",
        GRPO_BASE,
        ["policy.sequence_packing.enabled=false", "policy.train_micro_batch_size=3", "policy.logprob_batch_size=3"],
        "nemo_rl/distributed/batched_data_dict.py:BatchedDataDict.make_microbatch_iterator",
        "micro",
        "is not a multiple of the provided microbatch size",
    ),
    (
        "ppo-refit-transport",
        PPO_BASE,
        ["+policy.generation.refit_transport=nccl_reshard"],
        PPO,
        "setup",
        "is not yet supported by PPO",
    ),
    (
        "ppo-no-value-backend",
        PPO_BASE,
        ["value.dtensor_cfg.enabled=false"],
        PPO,
        "setup",
        "Exactly one of value.megatron_cfg.enabled or value.dtensor_cfg.enabled",
    ),
    (
        "ppo-value-cp",
        PPO_BASE,
        ["value.dtensor_cfg.context_parallel_size=2"],
        PPO,
        "setup",
        "Context parallelism (CP>1) is currently not supported for the DTensor PPO value model",
    ),
    (
        "ppo-value-dynamic-batching",
        PPO_BASE,
        ["value.dynamic_batching.enabled=true"],
        PPO,
        "setup",
        "Dynamic batching currently has some issue for the DTensor PPO value model",
    ),
    (
        "value-world",
        PPO_BASE,
        ["value.dtensor_cfg.tensor_parallel_size=3"],
        "nemo_rl/models/value/lm_value.py:Value.__init__",
        "setup",
        "must be divisible by PP * CP * TP",
    ),
    (
        "dynamic-batching-and-packing",
        GRPO_BASE,
        ["policy.dynamic_batching.enabled=true"],
        LM,
        "setup",
        "Dynamic Batching is exclusive of Sequence Packing",
    ),
    (
        "no-backend",
        "nemo_rl/sspo_math_1B.yaml",
        ["policy.dtensor_cfg.enabled=false", "nemo_granular.entropy_source=current_logits"],
        LM,
        "setup",
        "Please either set policy.megatron_cfg.enabled=true",
    ),
    (
        "one-node-no-training-gpus",
        GRPO_BASE,
        ["policy.generation.colocated.enabled=false", "policy.generation.colocated.resources.gpus_per_node=8"],
        GRPO,
        "setup",
        "No enough GPUs for training",
    ),
    (
        "generation-gpus-per-node",
        MOE_BASE,
        [
            "policy.generation.colocated.enabled=false",
            "policy.generation.colocated.resources.num_nodes=2",
            "policy.generation.colocated.resources.gpus_per_node=4",
        ],
        GRPO,
        "setup",
        "must be explicitly set and equal to cluster.gpus_per_node",
    ),
    (
        "kv-fp8-dtensor",
        "nemo_rl/sspo_math_1B.yaml",
        [
            "policy.generation.vllm_cfg.kv_cache_dtype=fp8",
            "policy.generation.vllm_cfg.precision=fp8",
            "loss_fn.use_importance_sampling_correction=true",
        ],
        GRPO,
        "setup",
        "DTensor backend is not supported with kv cache fp8 enabled",
    ),
    (
        "kv-fp8-pipeline",
        MOE_BASE,
        [
            "policy.generation.vllm_cfg.kv_cache_dtype=fp8",
            "policy.generation.vllm_cfg.precision=fp8",
            "loss_fn.use_importance_sampling_correction=true",
        ],
        GRPO,
        "setup",
        "we only support pipeline_model_parallel_size=1",
    ),
    (
        "val-top-k",
        GRPO_BASE,
        ["policy.generation.val_top_k=5"],
        GRPO,
        "setup",
        "only supported for vLLM NeMo-Gym rollouts",
    ),
    (
        "offload-needs-distributed-optimizer",
        GRPO_BASE,
        [
            "policy.megatron_cfg.optimizer.optimizer_cpu_offload=true",
            "policy.megatron_cfg.optimizer.optimizer_offload_fraction=1.0",
            "policy.megatron_cfg.optimizer.use_distributed_optimizer=false",
        ],
        f"{MS}:_validate_optimizer_config",
        "megatron",
        "requires use_distributed_optimizer=True",
    ),
    (
        "lora-dtensor-v1",
        "nemo_rl/sspo_math_1B.yaml",
        [
            "policy.dtensor_cfg._v2=false",
            "policy.dtensor_cfg.lora_cfg.enabled=true",
            "nemo_granular.entropy_source=current_logits",
        ],
        LM,
        "setup",
        "LoRA is not supported for DTensorPolicyWorker V1",
    ),
    (
        "ppo-megatron-value-cp",
        PPO_BASE,
        [
            "value.megatron_cfg.enabled=true",
            "value.dtensor_cfg.enabled=false",
            "value.megatron_cfg.context_parallel_size=2",
        ],
        PPO,
        "setup",
        "requires value.sequence_packing.enabled=true",
    ),
    # nemo-granular's own refusals: the driver's own function gives the same verdict
    (
        "async-grpo-dynamic-sampling",
        GRPO_BASE,
        ["grpo.async_grpo.enabled=true", "grpo.use_dynamic_sampling=true"],
        "nemo_granular/run_grpo.py:check_config",
        "run_grpo",
        "grpo.use_dynamic_sampling: true is not supported with async",
    ),
    (
        "data-plane",
        GRPO_BASE,
        ["data_plane.enabled=true"],
        "nemo_granular/run_grpo.py:check_config",
        "run_grpo",
        "data_plane.enabled: true is not supported by nemo_granular",
    ),
    (
        "ratio-always-one",
        GRPO_BASE,
        ["policy.train_global_batch_size=1024"],
        "nemo_granular/run_grpo.py:check_config",
        "run_grpo",
        "one optimizer step per rollout",
    ),
    (
        "loss-config",
        GRPO_BASE,
        ["+loss_fn.granular.clip=adaptive"],
        "nemo_granular/config.py:parse_policy_loss_config",
        "loss",
        "loss_fn.granular.clip",
    ),
    (
        "sppo-estimator-in-grpo",
        GRPO_BASE,
        ["grpo.adv_estimator.name=sppo"],
        "nemo_granular/nemo_rl/estimators.py:install",
        "none",
        "",
    ),
    (
        "extension-on-dtensor-v1",
        "nemo_rl/sspo_math_1B.yaml",
        ["policy.dtensor_cfg._v2=false"],
        "nemo_granular/nemo_rl/policy.py:extension_fqn_for",
        "extension",
        "not the DTensor v1 worker",
    ),
    (
        "sppo-estimator",
        PPO_BASE,
        ["ppo.adv_estimator.name=gae"],
        "nemo_granular/sppo/validate.py:validate_sppo_config",
        "run_sppo",
        "ppo.adv_estimator.name must be 'sppo'",
    ),
    (
        "sppo-ratio-always-one",
        PPO_BASE,
        ["policy.train_global_batch_size=256", "value.train_global_batch_size=256"],
        "nemo_granular/run_sppo.py:prepare_config",
        "run_sppo",
        "one optimizer step per rollout",
    ),
]


def _nemo_rl_verdict(stage: str, cfg: dict, driver: str, tmp_path, monkeypatch) -> str:
    if stage == "setup":
        return drive_setup(cfg, driver, tmp_path, monkeypatch)
    if stage == "megatron":
        return drive_megatron_validators(cfg["policy"])
    if stage == "shard":  # the first Policy.train: NeMo-RL's own sharding of the rollout batch
        import torch
        from nemo_rl.distributed.batched_data_dict import BatchedDataDict

        rows = cfg["grpo"]["num_prompts_per_step"] * cfg["grpo"]["num_generations_per_prompt"]
        batch = BatchedDataDict({"input_ids": torch.zeros(rows, 4, dtype=torch.long)})
        try:
            batch.shard_by_batch_size(8, batch_size=cfg["policy"]["train_global_batch_size"])
        except AssertionError as err:
            return str(err)
        return "accepted"
    if stage == "micro":  # a worker's micro-batches of its DP shard (no packing / dynamic batching)
        import torch
        from nemo_rl.distributed.batched_data_dict import BatchedDataDict

        per_rank = cfg["policy"]["train_global_batch_size"] // 8
        try:
            list(
                BatchedDataDict({"input_ids": torch.zeros(per_rank, 4)}).make_microbatch_iterator(
                    cfg["policy"]["train_micro_batch_size"]
                )
            )
        except AssertionError as err:
            return str(err)
        return "accepted"
    if stage.startswith("call:"):
        import nemo_rl.algorithms.grpo as grpo

        try:
            getattr(grpo, stage.split(":", 1)[1])(grpo.MasterConfig(**cfg))
        except (AssertionError, ValueError) as err:
            return str(err)
        return "accepted"
    if stage == "run_grpo":
        from nemo_granular.run_grpo import check_config

        try:
            check_config(cfg)
        except ValueError as err:
            return str(err)
        return "accepted"
    if stage == "loss":
        from nemo_granular.losses import GranularPolicyLoss

        try:
            GranularPolicyLoss(cfg["loss_fn"], vocab_size=151936)
        except ValueError as err:
            return str(err)
        return "accepted"
    if stage == "extension":
        from nemo_granular.nemo_rl.policy import extension_fqn_for

        try:
            extension_fqn_for(cfg["policy"])
        except ValueError as err:
            return str(err)
        return "accepted"
    if stage == "run_sppo":
        import types

        import nemo_rl.algorithms.ppo as ppo

        from nemo_granular.run_sppo import prepare_config

        try:
            prepare_config(types.SimpleNamespace(load_resolved=lambda *a: cfg, ppo=ppo), "config", [])
        except ValueError as err:
            return str(err)
        return "accepted"
    if stage == "none":
        return ""
    if stage == "estimator":
        import nemo_rl.algorithms.grpo as grpo

        try:
            grpo._create_advantage_estimator(grpo.MasterConfig(**cfg))
        except ValueError as err:
            return str(err)
        return "accepted"
    raise AssertionError(stage)


@pytest.mark.nemo_rl
@pytest.mark.needs_nemo_rl("preflight_setup_parity")
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_each_check_fails_its_config_like_nemo_rl(case, nemo_rl_src, megatron_workers, tmp_path, monkeypatch):
    _, base, overrides, source, stage, fragment = case
    res = preflight(base, overrides)
    found = [f for f in errors(res) if f.source == source]
    assert found, f"preflight did not report {source}: {[f.line() for f in res.findings]}"
    verdict = _nemo_rl_verdict(stage, res.resolved, res.driver, tmp_path, monkeypatch)
    assert fragment in verdict, f"NeMo-RL's verdict: {verdict!r}"
    # the base config itself passes the same check (no false alarm)
    assert not [f for f in errors(base_result(base)) if f.source == source]


_BASE: dict = {}


def base_result(name):
    if name not in _BASE:
        _BASE[name] = preflight(name)
    return _BASE[name]


# ------------------------------------------------ checks no CPU drive reaches: drift guards ---
# (preflight source, the NeMo-RL/Megatron function, expressions that must still be in its body,
#  a failing config for preflight)
GUARDS = [
    (
        "nemo_rl/algorithms/ppo.py:ppo_train",
        "nemo_rl.algorithms.ppo:ppo_train",
        [
            "if master_config.ppo.skip_reference_policy_logprobs_calculation:",
            "assert master_config.loss_fn.reference_policy_kl_penalty == 0",
        ],
        PPO_BASE,
        ["loss_fn.reference_policy_kl_penalty=0.1"],
    ),
    (
        "megatron/core/parallel_state.py:initialize_model_parallel",
        "megatron.core.parallel_state:initialize_model_parallel",
        [
            "expert_tensor_parallel_size\n        * expert_model_parallel_size\n        * pipeline_model_parallel_size",
            "if world_size % expert_tensor_model_pipeline_parallel_size != 0:",
        ],
        MOE_BASE,
        ["policy.megatron_cfg.expert_model_parallel_size=24"],
    ),
    (
        "nemo_rl/models/automodel/setup.py:validate_and_prepare_config",
        "nemo_rl.models.automodel.setup:validate_and_prepare_config",
        ["if cp_size > 1 and enable_seq_packing:", "Context parallel is not supported for sequence packing"],
        PPO_BASE,
        ["policy.dtensor_cfg.context_parallel_size=2", "policy.dtensor_cfg.tensor_parallel_size=1"],
    ),
    (
        "nemo_rl/models/automodel/setup.py:setup_distributed",
        "nemo_rl.models.automodel.setup:setup_distributed",
        ["if dp_size % dp_replicate_size != 0:", "if world_size == 1 and cpu_offload:"],
        PPO_BASE,
        ["+policy.dtensor_cfg.dp_replicate_size=3"],
    ),
    (
        "megatron/core/parallel_state.py:initialize_model_parallel",
        "megatron.core.parallel_state:initialize_model_parallel",
        ["if virtual_pipeline_model_parallel_size is not None:", "if not pipeline_model_parallel_size > 1:"],
        GRPO_BASE,
        ["+policy.megatron_cfg.virtual_pipeline_model_parallel_size=2"],
    ),
    (
        "nemo_rl/models/megatron/setup.py:validate_and_set_config",
        "nemo_rl.models.megatron.setup:validate_and_set_config",
        [
            'config["megatron_cfg"].get("transformer_impl") == "inference_optimized"',
            'and not config["megatron_cfg"]["sequence_parallel"]',
        ],
        "grpo_qwen2.5_math_7b.yaml",
        ["+policy.megatron_cfg.transformer_impl=inference_optimized", "policy.megatron_cfg.sequence_parallel=false"],
    ),
]


def function_source(module: str, func: str) -> str:
    """The source of ``module.func`` read from NeMo-RL's / Megatron-LM's files (no import: the
    Automodel worker module imports Transformer Engine at load time)."""
    import ast
    import importlib.util

    path = Path(importlib.util.find_spec(module).origin)
    text = path.read_text()
    node = next(n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.FunctionDef) and n.name == func)
    return ast.get_source_segment(text, node)


@pytest.mark.nemo_rl
@pytest.mark.needs_nemo_rl("preflight_setup_parity")
@pytest.mark.parametrize("guard", GUARDS, ids=[f"{g[0].rsplit(':', 1)[1]}-{i}" for i, g in enumerate(GUARDS)])
def test_restated_check_still_guards_nemo_rl_source(guard, nemo_rl_src, megatron_workers):
    source, target, expressions, base, overrides = guard
    body = function_source(*target.split(":"))
    for expr in expressions:
        assert expr in body, f"{target} no longer contains {expr!r}: re-check preflight's restatement"
    res = preflight(base, overrides)
    assert [f for f in errors(res) if f.source == source], [f.line() for f in res.findings]
    assert not [f for f in errors(base_result(base)) if f.source == source]


@pytest.mark.nemo_rl
def test_architecture_checks_agree_with_megatron_transformer_config(megatron_workers):
    """heads % TP and KV heads vs TP: preflight's verdict equals Megatron-Core's own TransformerConfig."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from nemo_granular.preflight.model import ModelFacts, architecture_checks

    for heads, kv, tp in [(32, 4, 4), (32, 4, 8), (28, 4, 8), (30, 6, 4), (12, 2, 3), (16, 16, 2)]:
        facts = ModelFacts(
            vocab_size=1000,
            hidden_size=heads * 8,
            num_layers=2,
            num_heads=heads,
            num_kv_heads=kv,
            head_dim=8,
            ffn_size=64,
        )
        ours = architecture_checks("policy", facts, dict(backend="megatron", tp=tp, pp=1, cp=1, ep=1), {})
        try:
            TransformerConfig(
                num_layers=2,
                hidden_size=heads * 8,
                num_attention_heads=heads,
                num_query_groups=kv,
                tensor_model_parallel_size=tp,
            )
            megatron_ok = True
        except ValueError:
            megatron_ok = False
        assert (not ours) == megatron_ok, (heads, kv, tp, [f.line() for f in ours])
