"""SPPO on NeMo-RL's unmodified PPO loop.

    python -m nemo_granular.run_sppo --config examples/configs/sppo_r1_distill_qwen_1.5b.yaml [hydra overrides]

Follows NeMo-RL's ``examples/run_ppo.py`` flow (``load_config`` → ``parse_hydra_overrides``
→ ``MasterConfig`` → ``init_ray`` → tokenizer / data → ``ppo.setup`` → ``ppo_train`` or
``async_ppo_train``) with four SPPO substitutions:

1. the ``sppo`` estimator is installed into ``nemo_rl.algorithms.ppo._create_advantage_estimator``
   for the duration of the run (A = (R − σ(v))·mask, returns = R·mask);
2. ``value_loss_fn`` (NeMo-RL's MSE loss) is replaced by :class:`nemo_granular.losses.SequenceValueLoss`
   (BCE on the critic logit at the first response column);
3. the value model is wrapped in :class:`nemo_granular.sppo.critic.PromptOnlyValue` (critic
   forwards prompt + 1 token, unique prompts only; logs critic diagnostics each step);
4. start-up checks: binary rewards (reward scaling / shaping off), estimator name, N and KL
   warnings, the same-tokenizer check for a smaller decoupled critic, the checks NeMo-RL's
   ``examples/run_ppo.py`` makes for async PPO (all before any GPU work except the FP8
   KV-scale one, which needs the generation object), and a refusal of settings under which the
   importance ratio is identically 1 (``loss_fn.force_on_policy_ratio: true``, one optimizer
   step per rollout) unless ``sppo.allow_ratio_always_one: true``, and of a multi-GPU DTensor
   critic whose HF config sets ``pad_token_id`` (its value head would start as uninitialised
   memory; ``sppo.validate.check_value_head_initialised``).

The config is loaded by :func:`nemo_granular.nemo_rl.configs.load_resolved` (NeMo-RL's
``load_config`` with ``nemo_rl/upstream/`` resolved against NeMo-RL's ``examples/configs``).

SPPO's own options live in the top-level ``sppo:`` section (see ``nemo_granular.sppo.validate``).
Errors a user can fix (missing NeMo-RL, bad config) print one line and exit with code 2.
"""

from __future__ import annotations

import argparse
import sys
from types import SimpleNamespace

from .run_grpo import INSTALL_HINT, OVERRIDES_HELP

__all__ = ["main", "prepare_config", "MissingDependencyError"]

PROG = "nemo_granular.run_sppo"


class MissingDependencyError(ImportError):
    """NeMo-RL (or one of its own imports) is not importable."""


def _import_nemo_rl() -> SimpleNamespace:
    """Import the NeMo-RL pieces the entry script needs; one-line error naming the package."""
    try:
        import nemo_rl  # noqa: F401
    except ImportError as err:
        raise MissingDependencyError(
            f"NeMo-RL is not installed (cannot import {err.name or 'nemo_rl'!r}); " + INSTALL_HINT.format(prog=PROG)
        ) from None
    try:
        from omegaconf import OmegaConf

        from .nemo_rl import compat
        from .nemo_rl.configs import load_resolved

        compat.version()  # refuses a NeMo-RL that is none of the supported versions, in one line
        ppo_module = compat.module("ppo")
        get_tokenizer, setup_response_data = compat.get("get_tokenizer"), compat.get("setup_response_data")
        init_ray, configure_generation_config = compat.get("init_ray"), compat.get("configure_generation_config")
        get_next_experiment_dir = compat.get("get_next_experiment_dir")
    except compat.UnsupportedNemoRL as err:
        raise MissingDependencyError(str(err)) from None
    except ImportError as err:
        raise MissingDependencyError(
            f"NeMo-RL is installed but {err.name or 'one of its modules'!r} cannot be imported ({err}); "
            f"{PROG} needs NeMo-RL's PPO (nemo_rl.algorithms.ppo)"
        ) from None
    return SimpleNamespace(
        OmegaConf=OmegaConf,
        ppo=ppo_module,
        compat=compat,
        get_tokenizer=get_tokenizer,
        setup_response_data=setup_response_data,
        init_ray=init_ray,
        configure_generation_config=configure_generation_config,
        load_resolved=load_resolved,
        get_next_experiment_dir=get_next_experiment_dir,
    )


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog=f"python -m {PROG}",
        usage="%(prog)s [-h] --config CONFIG [key=value ...]",
        description="SPPO (sequence-level PPO, scalar BCE critic) on NeMo-RL's PPO loop. " + OVERRIDES_HELP,
    )
    parser.add_argument("--config", required=True, help="YAML config (NeMo-RL PPO config + sppo: section)")
    return parser.parse_known_args(argv)


def prepare_config(nr: SimpleNamespace, path: str, overrides: list[str]):
    """Load + override + resolve + validate. Returns ``(MasterConfig, SPPOOptions)``."""
    from pydantic import ValidationError

    from .nemo_rl.configs import check_ratio_is_active
    from .sppo.validate import validate_sppo_config

    config = nr.load_resolved(path, overrides)
    opts, warnings = validate_sppo_config(config, source=path)
    if not opts.allow_ratio_always_one:
        check_ratio_is_active(config, "ppo", "sppo.allow_ratio_always_one")
    for w in warnings:
        print(f"{PROG}: warning: {w}", file=sys.stderr)
    try:
        return nr.ppo.MasterConfig(**config), opts
    except ValidationError as err:
        first = err.errors()[0]
        raise ValueError(f"{path}: {'.'.join(str(x) for x in first['loc'])}: {first['msg']}") from None


def async_ppo_enabled(config) -> bool:
    """``ppo.async_ppo.enabled`` (false where the NeMo-RL version has no async PPO section)."""
    from .nemo_rl.compat import conf

    return bool(conf(config, "ppo.async_ppo.enabled", False))


def _check_async(config, policy_generation=None) -> None:
    """NeMo-RL's async-PPO checks (``examples/run_ppo.py`` ``_validate_async_ppo_config``), as one-line
    ``ValueError``s. Without ``policy_generation`` (before setup) the FP8 KV-scale check is skipped.
    A NeMo-RL without async PPO (v0.7.0) refuses first, naming its version."""
    from .nemo_rl.compat import conf, require

    require("async_ppo", "ppo.async_ppo.enabled: true")
    gen = config.policy["generation"] or {}
    vllm = gen.get("vllm_cfg") or {}
    if gen.get("backend") != "vllm" or not vllm.get("async_engine"):
        raise ValueError(
            "async PPO needs policy.generation.backend=vllm and policy.generation.vllm_cfg.async_engine=true"
        )
    if not config.loss_fn.use_importance_sampling_correction:
        raise ValueError("async PPO needs loss_fn.use_importance_sampling_correction=true")
    if config.loss_fn.force_on_policy_ratio:
        raise ValueError("async PPO needs loss_fn.force_on_policy_ratio=false")
    if (gen.get("colocated") or {}).get("enabled", True):
        raise ValueError("async PPO needs policy.generation.colocated.enabled=false")
    if conf(config, "ppo.max_num_epochs") != -1:
        raise ValueError(
            "async PPO does not support an epoch limit: set ppo.max_num_epochs=-1 and use "
            "ppo.max_num_steps to control the training length"
        )
    unsupported = {
        "ppo.use_dynamic_sampling": conf(config, "ppo.use_dynamic_sampling", False),
        "ppo.reward_scaling.enabled": conf(config, "ppo.reward_scaling.enabled", False),
        "ppo.reward_shaping.enabled": conf(config, "ppo.reward_shaping.enabled", False),
        "data.use_multiple_dataloader": config.data.get("use_multiple_dataloader", False),
        "env.should_use_nemo_gym (NeMo Gym rollout)": (config.env or {}).get("should_use_nemo_gym", False),
    }
    if policy_generation is not None:
        unsupported["FP8 KV-scale synchronization (policy.generation)"] = getattr(
            policy_generation, "requires_kv_scale_sync", False
        )
    for what, enabled in unsupported.items():
        if bool(enabled):
            raise ValueError(
                f"{what} is not supported with async PPO (ppo.async_ppo.enabled: true), "
                f"as in NeMo-RL's examples/run_ppo.py"
            )


def _startup(argv: list[str] | None):
    args, overrides = parse_args(argv)
    from .nemo_rl.configs import check_config_files

    check_config_files(args.config)  # before NeMo-RL's algorithms are imported: a wrong path is answered at once
    nr = _import_nemo_rl()
    config, opts = prepare_config(nr, args.config, overrides)
    from .nemo_rl.time_limit import check_save_every

    check_save_every(bool(nr.compat.conf(config, "checkpointing.enabled", False)))
    if async_ppo_enabled(config):
        _check_async(config)
    if opts.check_tokenizers:
        from .sppo.validate import check_critic_tokenizer

        check_critic_tokenizer(config)
    from .sppo.validate import check_value_head_initialised

    check_value_head_initialised(config)
    return nr, args, config, opts


def main(argv: list[str] | None = None) -> int:
    from .nemo_rl.time_limit import StopWatch, install_stop_signal

    install_stop_signal()  # first: SIGUSR1 (slurm/launch.sh's "save and stop") must never kill the driver
    try:
        nr, args, config, opts = _startup(argv)
    except (MissingDependencyError, ValueError, FileNotFoundError) as err:
        msg = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"{PROG}: error: {msg}", file=sys.stderr)
        return 2

    from .losses import SequenceValueLoss
    from .sppo.critic import PromptOnlyValue
    from .sppo.install import sppo_estimator_installed

    print(f"Loaded configuration from: {args.config} ({nr.compat.version()})")
    config.logger["log_dir"] = nr.get_next_experiment_dir(config.logger["log_dir"])
    nr.init_ray()
    tokenizer = nr.get_tokenizer(config.policy["tokenizer"])
    if config.policy["generation"] is None:
        raise ValueError("policy.generation is required for PPO")
    config.policy["generation"] = nr.configure_generation_config(config.policy["generation"], tokenizer)
    dataset, val_dataset, task_to_env, val_task_to_env = nr.setup_response_data(tokenizer, config.data, config.env)

    with sppo_estimator_installed(nr.ppo):
        (
            policy,
            policy_generation,
            value_model,
            _cluster,
            dataloader,
            val_dataloader,
            loss_fn,
            _mse_value_loss,
            logger,
            checkpointer,
            ppo_state,
            master_config,
        ) = nr.ppo.setup(config, tokenizer, dataset, val_dataset)
        async_on = async_ppo_enabled(config)
        if async_on:
            try:
                _check_async(config, policy_generation)
            except ValueError as err:
                print(f"{PROG}: error: {err}", file=sys.stderr)
                return 2
        value_loss_fn = SequenceValueLoss()
        if opts.prompt_only_critic:
            value_model = PromptOnlyValue(
                value_model,
                tokenizer.pad_token_id,
                pad_to_multiple=config.value.get("make_sequence_length_divisible_by", 1) or 1,
                dedup=opts.dedup_prompts,
                logger=logger if opts.log_diagnostics else None,
                start_step=int(ppo_state["total_steps"]),
                diagnostics_prefix=opts.diagnostics_prefix,
            )
        train = nr.compat.get("async_ppo_train") if async_on else nr.ppo.ppo_train
        print(f"🚀 Running SPPO ({'async' if async_on else 'sync'} PPO loop)", flush=True)
        with nr.compat.checkpoint_flush(checkpointer), StopWatch(nr.ppo, master_config.checkpointing) as watch:
            # NeMo-RL's time limit, SIGUSR1, NG_SAVE_EVERY_MINUTES (through the checkpointing dict the loop reads)
            train(
                policy,
                policy_generation,
                value_model,
                dataloader,
                val_dataloader,
                tokenizer,
                loss_fn,
                value_loss_fn,
                task_to_env,
                val_task_to_env,
                logger,
                checkpointer,
                ppo_state,
                master_config,
            )
    # 99 when NeMo-RL stopped at its time limit (or after SIGUSR1) before the end: slurm/launch.sh requeues
    return watch.exit_code(ppo_state, master_config.ppo, master_config.checkpointing, None if async_on else dataloader)


if __name__ == "__main__":
    sys.exit(main())
