"""The checks NeMo-RL makes when it constructs its workers, re-stated as pure functions of the config.

These rules live inside constructors that need GPUs and Ray (``Policy.__init__``,
``VllmGeneration.__init__``, the Megatron and Automodel workers' set-up) or in modules that import
Megatron-Bridge / Transformer Engine at load time, so they cannot be called from a driver
environment. Each finding names the NeMo-RL ``file:function`` it mirrors (commit 7ea279ab);
``tests/test_preflight_nemo_rl.py`` proves agreement by running NeMo-RL's real constructors and
validators on CPU on the same configs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from .findings import Finding, error, warning
from .layout import policy_parallel, vllm_parallel

__all__ = [
    "policy_init_checks",
    "value_init_checks",
    "vllm_init_checks",
    "megatron_worker_checks",
    "automodel_worker_checks",
    "megatron_parallel_state_checks",
    "ATTENTION_BACKENDS",
]

LM_POLICY = "nemo_rl/models/policy/lm_policy.py:Policy.__init__"
LM_VALUE = "nemo_rl/models/value/lm_value.py:Value.__init__"
VLLM = "nemo_rl/models/generation/vllm/vllm_generation.py:VllmGeneration.__init__"
MSETUP = "nemo_rl/models/megatron/setup.py"
ASETUP = "nemo_rl/models/automodel/setup.py"
# megatron.core.transformer.enums.AttnBackend member names (NeMo-RL looks the key up there)
ATTENTION_BACKENDS = ("flash", "fused", "unfused", "local", "auto")


def _world_checks(src: str, world: int, tp: int, pp: int, cp: int, what: str) -> list[Finding]:
    mp = tp * pp * cp
    if world < mp:
        return [error(src, f"{what}: {world} GPUs < PP {pp} × CP {cp} × TP {tp} = {mp}; DP would be < 1")]
    if world % mp:
        return [error(src, f"{what}: {world} GPUs not divisible by PP {pp} × CP {cp} × TP {tp} = {mp}")]
    return []


# NeMo-RL's docker/Dockerfile (7ea279ab and v0.7.0): `ENV TORCH_CUDA_ARCH_LIST="9.0 10.0"` (H100, B200)
IMAGE_TORCH_CUDA_ARCH_LIST = "9.0 10.0"


def torch_cuda_arch_list_finding(env: Mapping[str, str]) -> Finding:
    """``TORCH_CUDA_ARCH_LIST`` unset with the Megatron backend: ``Policy.__init__`` raises
    RuntimeError in NeMo-RL's ``setup()`` (after the allocation started). An error where ``env`` is
    the job's environment: bare metal, or inside the job's container (``NG_CONTAINER``). A warning
    on the submit host of a container job (``CONTAINER`` set, not inside it): the image's own
    value wins there (NeMo-RL's image sets it), and this host cannot see the image's."""
    if env.get("CONTAINER") and not env.get("NG_CONTAINER"):
        return warning(
            LM_POLICY,
            "TORCH_CUDA_ARCH_LIST is not set on this host; the job's CONTAINER must set it "
            f"(NeMo-RL's image does: '{IMAGE_TORCH_CUDA_ARCH_LIST}'): NeMo-RL's Megatron "
            "backend raises without it",
        )
    return error(
        LM_POLICY,
        "TORCH_CUDA_ARCH_LIST is not set: NeMo-RL's Megatron backend (policy.megatron_cfg."
        "enabled) raises in setup() without it; export TORCH_CUDA_ARCH_LIST="
        f"'{IMAGE_TORCH_CUDA_ARCH_LIST}' (NeMo-RL's image: H100, B200) or your GPUs' capability",
    )


def policy_init_checks(policy: Mapping, world: int, env: Mapping[str, str] | None = None) -> list[Finding]:
    """``Policy.__init__``: one backend, draft model limits, the TP≥4 batch rule, world-size divisibility,
    dynamic batching vs PP and packing. ``TORCH_CUDA_ARCH_LIST`` (read from ``env``, the driver's
    environment) is required by the Megatron backend (:func:`torch_cuda_arch_list_finding`)."""
    env = os.environ if env is None else env
    out: list[Finding] = []
    meg = bool((policy.get("megatron_cfg") or {}).get("enabled", False))
    dt_cfg = policy.get("dtensor_cfg") or {}
    dt = bool(dt_cfg.get("enabled", False))
    draft = bool((policy.get("draft") or {}).get("enabled", False))
    if meg and dt:
        return [
            error(LM_POLICY, "policy.megatron_cfg.enabled and policy.dtensor_cfg.enabled are both true; choose one")
        ]
    if not meg and not dt:
        return [error(LM_POLICY, "neither policy.megatron_cfg.enabled nor policy.dtensor_cfg.enabled is true")]
    if draft and not meg:
        out.append(error(LM_POLICY, "policy.draft.enabled needs the Megatron backend"))
    if draft and bool((policy.get("sequence_packing") or {}).get("enabled", False)):
        out.append(error(LM_POLICY, "policy.draft.enabled does not support policy.sequence_packing.enabled"))
    if meg and "TORCH_CUDA_ARCH_LIST" not in env:
        out.append(torch_cuda_arch_list_finding(env))
    if dt and not dt_cfg.get("_v2", False):
        if (dt_cfg.get("lora_cfg") or {}).get("enabled", False):
            out.append(error(LM_POLICY, "LoRA is not supported by the DTensor v1 worker (set policy.dtensor_cfg._v2)"))
        if (dt_cfg.get("dp_replicate_size") or 1) > 1:
            out.append(error(LM_POLICY, "policy.dtensor_cfg.dp_replicate_size > 1 needs policy.dtensor_cfg._v2: true"))
    par = policy_parallel(policy)
    if (
        not env.get("NRL_IGNORE_TP_ACCURACY_CHECK")
        and "logprob_batch_size" in policy
        and par["tp"] >= 4
        and policy["train_micro_batch_size"] != policy["logprob_batch_size"]
    ):
        out.append(
            error(
                LM_POLICY,
                f"TP {par['tp']} >= 4 needs policy.train_micro_batch_size "
                f"({policy['train_micro_batch_size']}) == policy.logprob_batch_size "
                f"({policy['logprob_batch_size']}) (NeMo-RL's TP batch-variance check)",
            )
        )
    out += _world_checks(LM_POLICY, world, par["tp"], par["pp"], par["cp"], "policy")
    dyn = bool((policy.get("dynamic_batching") or {}).get("enabled", False))
    if dyn and par["pp"] != 1:
        out.append(error(LM_POLICY, "policy.dynamic_batching.enabled needs pipeline_model_parallel_size 1"))
    if dyn and bool((policy.get("sequence_packing") or {}).get("enabled", False)):
        out.append(error(LM_POLICY, "policy.dynamic_batching and policy.sequence_packing are exclusive"))
    return out


def value_init_checks(value: Mapping, world: int) -> list[Finding]:
    """``Value.__init__`` (PPO's critic): one backend, DTensor needs ``_v2``, world-size divisibility."""
    meg = bool((value.get("megatron_cfg") or {}).get("enabled", False))
    dt_cfg = value.get("dtensor_cfg") or {}
    if meg and bool(dt_cfg.get("enabled", False)):
        return [error(LM_VALUE, "value.megatron_cfg.enabled and value.dtensor_cfg.enabled are both true")]
    if not meg:
        if not dt_cfg.get("enabled", False):
            return [error(LM_VALUE, "neither value.megatron_cfg.enabled nor value.dtensor_cfg.enabled is true")]
        if not dt_cfg.get("_v2", False):
            return [error(LM_VALUE, "DTensor value models need value.dtensor_cfg._v2: true")]
    par = policy_parallel(value)
    return _world_checks(LM_VALUE, world, par["tp"], par["pp"], par["cp"], "value model")


def vllm_init_checks(gen: Mapping, world: int) -> list[Finding]:
    """``VllmGeneration.__init__``: world % (TP·PP), PP needs the async engine, EP a multiple of TP (and
    EP ≠ TP, i.e. DP inside vLLM, not with the async engine), top-k / top-p ranges, required keys."""
    if gen.get("backend") != "vllm":
        return []
    out: list[Finding] = []
    v, vcfg = vllm_parallel(gen), gen.get("vllm_cfg") or {}
    if world % (v["tp"] * v["pp"]):
        out.append(error(VLLM, f"generation: {world} GPUs not a multiple of vLLM TP {v['tp']} × PP {v['pp']}"))
    if v["pp"] > 1 and not vcfg.get("async_engine"):
        out.append(error(VLLM, "vllm_cfg.pipeline_parallel_size > 1 needs vllm_cfg.async_engine: true"))
    if v["ep"] > 1:
        if v["ep"] % v["tp"]:
            out.append(
                error(
                    VLLM,
                    f"vllm_cfg.expert_parallel_size {v['ep']} must be a multiple of "
                    f"tensor_parallel_size {v['tp']} (vLLM's EP = DP × TP)",
                )
            )
        elif v["ep"] != v["tp"] and vcfg.get("async_engine"):
            out.append(
                error(
                    VLLM,
                    "vllm_cfg.expert_parallel_size != tensor_parallel_size (DP inside vLLM) is not "
                    "supported with vllm_cfg.async_engine: true",
                )
            )
    top_k, top_p = gen.get("top_k"), gen.get("top_p")
    if top_k is not None and top_k != -1 and top_k < 1:
        out.append(error(VLLM, f"policy.generation.top_k must be null, -1 or >= 1 (got {top_k})"))
    if top_p is None or top_p <= 0 or top_p > 1.0:
        out.append(error(VLLM, f"policy.generation.top_p must be in (0, 1] (got {top_p})"))
    try:
        from ..nemo_rl import compat

        VllmConfig = compat.get("VllmConfig")

        missing = sorted(k for k in VllmConfig.__required_keys__ if k not in gen and k != "model_name")
    except ImportError:
        missing = []
    if missing:
        out.append(error(VLLM, f"policy.generation is missing vLLM keys: {', '.join(missing)}"))
    return out


def megatron_worker_checks(policy: Mapping) -> list[Finding]:
    """The config checks of the Megatron worker's set-up (``nemo_rl/models/megatron/setup.py``):
    ``validate_and_set_config``, ``setup_model_config`` → ``validate_router_replay_config``,
    ``_apply_parallelism_config``, ``_apply_performance_config`` (attention backend, activation
    offloading; its ``recompute_granularity`` check is already NeMo-RL's ``MasterConfig``'s),
    ``_validate_optimizer_config``, ``_validate_chunking_config``."""
    meg = policy.get("megatron_cfg") or {}
    if not meg.get("enabled", False):
        return []
    out: list[Finding] = []
    src = f"{MSETUP}:validate_and_set_config"
    if (
        meg.get("transformer_impl") == "inference_optimized"
        and meg.get("tensor_model_parallel_size", 1) > 1
        and not meg.get("sequence_parallel")
    ):
        out.append(error(src, "megatron_cfg.transformer_impl=inference_optimized with TP > 1 needs sequence_parallel"))
    if (policy.get("reward_model_cfg") or {}).get("enabled"):
        out.append(error(src, "reward models are not supported with the Megatron backend"))
    rope = (policy.get("hf_config_overrides") or {}).get("rope_scaling") or {}
    yarn = (
        "factor",
        "rope_theta",
        "original_max_position_embeddings",
        "truncate",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
    )
    if rope.get("rope_type") == "yarn" and any(k not in rope for k in yarn):
        out.append(error(src, f"hf_config_overrides.rope_scaling (yarn) misses {[k for k in yarn if k not in rope]}"))
    out += _router_replay(policy, meg)
    src = f"{MSETUP}:_apply_parallelism_config"
    if meg.get("context_parallel_size", 1) > 1:
        if not (policy.get("sequence_packing") or {}).get("enabled", False):
            out.append(error(src, "megatron_cfg.context_parallel_size > 1 needs policy.sequence_packing.enabled"))
        if meg.get("use_fused_linear_logprobs", False):
            out.append(
                error(src, "megatron_cfg.context_parallel_size > 1 is not supported with use_fused_linear_logprobs")
            )
    out += _performance(meg)
    out += _optimizer(meg.get("optimizer") or {})
    chunk = policy.get("logprob_chunk_size")
    if chunk is not None and chunk > 0 and not meg.get("defer_fp32_logits"):
        out.append(
            error(
                f"{MSETUP}:_validate_chunking_config",
                f"policy.logprob_chunk_size={chunk} needs policy.megatron_cfg.defer_fp32_logits: true "
                f"(NeMo-RL: 'defer_fp32_logits must be True if logprob_chunk_size is set')",
            )
        )
    return out


def _router_replay(policy: Mapping, meg: Mapping) -> list[Finding]:
    src = "nemo_rl/models/megatron/router_replay.py:validate_router_replay_config"
    if not bool((policy.get("router_replay") or {}).get("enabled", False)):
        return []
    out = []
    if (policy.get("generation") or {}).get("backend") != "vllm":
        out.append(error(src, "policy.router_replay.enabled needs vLLM generation"))
    if meg.get("virtual_pipeline_model_parallel_size") not in (None, 1):
        out.append(error(src, "policy.router_replay.enabled does not support virtual pipeline parallelism"))
    return out


def _performance(meg: Mapping) -> list[Finding]:
    src = f"{MSETUP}:_apply_performance_config"
    out = []
    backend = meg.get("attention_backend")
    if backend is not None and backend not in ATTENTION_BACKENDS:
        out.append(error(src, f"megatron_cfg.attention_backend {backend!r} is not one of {list(ATTENTION_BACKENDS)}"))
    if meg.get("fine_grained_activation_offloading"):
        mods = meg.get("offload_modules")
        if not isinstance(mods, list) or not mods:
            out.append(
                error(
                    src,
                    "megatron_cfg.offload_modules must be a non-empty list when "
                    "fine_grained_activation_offloading is true",
                )
            )
    return out


def _optimizer(opt: Mapping) -> list[Finding]:
    src = f"{MSETUP}:_validate_optimizer_config"
    offload = bool(opt.get("optimizer_cpu_offload", False))
    frac = opt.get("optimizer_offload_fraction", 0.0)
    out = []
    if offload and not (0 < frac <= 1):
        out.append(error(src, "megatron_cfg.optimizer.optimizer_cpu_offload needs 0 < optimizer_offload_fraction <= 1"))
    if offload and not opt.get("use_distributed_optimizer"):
        out.append(error(src, "megatron_cfg.optimizer.optimizer_cpu_offload needs use_distributed_optimizer: true"))
    if offload and opt.get("optimizer") not in ("adam", "sgd"):
        out.append(error(src, "megatron_cfg.optimizer.optimizer_cpu_offload needs optimizer adam or sgd"))
    if not offload and opt.get("overlap_cpu_optimizer_d2h_h2d"):
        out.append(error(src, "megatron_cfg.optimizer.overlap_cpu_optimizer_d2h_h2d needs optimizer_cpu_offload"))
    return out


def automodel_worker_checks(section: str, cfg: Mapping, world: int) -> list[Finding]:
    """The DTensor v2 (Automodel) worker's set-up checks (``nemo_rl/models/automodel/setup.py``
    ``validate_and_prepare_config`` and ``setup_distributed``) for ``policy`` or ``value``."""
    dt = cfg.get("dtensor_cfg") or {}
    if not dt.get("enabled", False) or not dt.get("_v2", False):
        return []
    out: list[Finding] = []
    src = f"{ASETUP}:validate_and_prepare_config"
    if cfg.get("precision") not in ("float32", "bfloat16", "float16"):
        out.append(error(src, f"{section}.precision {cfg.get('precision')!r} is not float32, bfloat16 or float16"))
    if ((cfg.get("hf_config_overrides") or {}).get("rope_scaling") or {}).get("rope_type") == "yarn":
        out.append(error(src, f"{section}: YaRN rope scaling is not supported by the DTensor backend"))
    packing = bool((cfg.get("sequence_packing") or {}).get("enabled", False))
    rm = cfg.get("reward_model_cfg") or {}
    if rm.get("enabled") and packing:
        out.append(error(src, f"{section}.sequence_packing is not supported for reward models"))
    cp = int(dt.get("context_parallel_size", 1) or 1)
    if cp > 1 and packing:
        out.append(
            error(src, f"{section}.dtensor_cfg.context_parallel_size > 1 is not supported with sequence packing")
        )
    src = f"{ASETUP}:setup_distributed"
    mp = int(dt.get("tensor_parallel_size", 1) or 1) * cp * int(dt.get("expert_parallel_size", 1) or 1)
    replicate = int(dt.get("dp_replicate_size", 1) or 1)
    dp = world // mp if mp else 0
    if replicate and dp % replicate:
        out.append(
            error(src, f"{section}: data-parallel size {dp} not divisible by dtensor_cfg.dp_replicate_size {replicate}")
        )
    if world == 1 and dt.get("cpu_offload"):
        out.append(error(src, f"{section}.dtensor_cfg.cpu_offload does not work on a single GPU"))
    return out


def megatron_parallel_state_checks(meg: Mapping, world: int, section: str = "policy") -> list[Finding]:
    """Megatron-Core's process-group set-up for the Megatron worker
    (``megatron/core/parallel_state.py:initialize_model_parallel``): the expert grid ETP × EP × PP must
    divide the world, and an interleaved (virtual) pipeline needs PP > 1."""
    if not meg.get("enabled", False):
        return []
    src = "megatron/core/parallel_state.py:initialize_model_parallel"
    pp = int(meg.get("pipeline_model_parallel_size", 1))
    ep, etp = int(meg.get("expert_model_parallel_size", 1) or 1), meg.get("expert_tensor_parallel_size")
    etp = int(etp) if etp is not None else int(meg.get("tensor_model_parallel_size", 1))
    out = []
    if world % (etp * ep * pp):
        out.append(
            error(
                src,
                f"{section}: {world} GPUs not divisible by expert_tensor_parallel {etp} × "
                f"expert_model_parallel {ep} × pipeline {pp} = {etp * ep * pp}",
            )
        )
    if meg.get("virtual_pipeline_model_parallel_size") is not None and pp <= 1:
        out.append(
            error(
                src,
                f"{section}.megatron_cfg.virtual_pipeline_model_parallel_size needs pipeline_model_parallel_size > 1",
            )
        )
    return out
