"""GRPO-family training (SSPO, ESPO, GSPO, GRPO) on NeMo-RL with the granular loss.

    python -m nemo_granular.run_grpo --config examples/configs/nemo_rl/sspo_math_1B.yaml [key=value ...]

NeMo-RL's own flow (``examples/run_grpo.py`` at 7ea279ab): ``load_config`` +
``parse_hydra_overrides`` + OmegaConf resolve → ``MasterConfig`` → Ray → tokenizer → data and
environments → ``setup(..., policy_factory=...)`` → ``grpo_train`` / ``async_grpo_train``, with
our hooks in between:

1. ``nemo_granular.nemo_rl.install()`` — our ``grpo`` / ``espo`` advantage estimators;
2. the ``espo_math`` environment and the worker-extension fqns are registered;
3. ``policy_factory`` = ``GranularPolicy`` on the worker extension (exact π_old entropy), unless
   ``nemo_granular.entropy_source: current_logits`` (fallback: LOGIT wrapper loss);
4. the returned ``loss_fn`` is replaced by ``GranularPolicyLoss(master_config.loss_fn,
   tokenizer=..., vocab_size=...)``.

Refused: ``data_plane.enabled: true`` (TransferQueue moves a fixed field list and drops our
keys) and the single-controller trainer (``async_rl`` section). Without NeMo-RL installed the
script prints one line naming the missing package and exits with status 2.
"""

from __future__ import annotations

import argparse
import os
import pprint
import sys
from collections.abc import Mapping
from typing import Any

__all__ = ["main", "parse_args", "check_supported_modes", "runtime_options", "build_loss", "RUNTIME_SECTION"]

RUNTIME_SECTION = "nemo_granular"
ENTROPY_SOURCES = ("extension", "current_logits")


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m nemo_granular.run_grpo",
                                     description="GRPO-family training with nemo_granular on NeMo-RL")
    parser.add_argument("--config", type=str, required=True, help="YAML config (may inherit NeMo-RL examples)")
    return parser.parse_known_args(argv)


def check_supported_modes(config: Mapping[str, Any]) -> None:
    """Refuse trainers that cannot carry our per-token keys (one-line ``ValueError``)."""
    dp = config.get("data_plane") or {}
    if bool(dp.get("enabled", False)):
        raise ValueError("data_plane.enabled: true is not supported by nemo_granular (the TransferQueue trainer "
                         "moves a fixed field list and drops prev_entropy/granular_group_ids); set it to false")
    if config.get("async_rl") is not None:
        raise ValueError("async_rl: the single-controller trainer is not supported by nemo_granular; "
                         "use grpo.async_grpo with this script or the synchronous trainer")


def runtime_options(config: Mapping[str, Any]) -> dict[str, Any]:
    """The top-level ``nemo_granular:`` section (our runtime switches), validated."""
    opts = dict(config.get(RUNTIME_SECTION) or {})
    unknown = set(opts) - {"entropy_source"}
    if unknown:
        raise ValueError(f"{RUNTIME_SECTION}: unknown key(s) {sorted(unknown)} (allowed: entropy_source)")
    src = opts.setdefault("entropy_source", "extension")
    if src not in ENTROPY_SOURCES:
        raise ValueError(f"{RUNTIME_SECTION}.entropy_source: must be one of {list(ENTROPY_SOURCES)}, got {src!r}")
    return opts


def build_loss(master_config: Any, tokenizer, vocab_size: int | None, entropy_source: str = "extension"):
    """The loss object handed to ``grpo_train`` (replaces NeMo-RL's ``ClippedPGLossFn``)."""
    from .losses import GranularPolicyLoss
    from .nemo_rl.estimators import config_get

    loss = GranularPolicyLoss(config_get(master_config, "loss_fn"), tokenizer=tokenizer, vocab_size=vocab_size)
    if entropy_source == "current_logits":
        from .nemo_rl.fallback import CurrentLogitsEntropyLoss

        return CurrentLogitsEntropyLoss(loss, master_config=master_config)
    return loss


def _model_vocab_size(policy_cfg: Mapping[str, Any], tokenizer) -> int:
    """|V| of the model (ESPO's log|V|): the HF config's ``vocab_size``, else the tokenizer's."""
    try:
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(policy_cfg["model_name"], trust_remote_code=True)
        size = getattr(hf, "vocab_size", None) or getattr(getattr(hf, "text_config", None), "vocab_size", None)
        if size:
            return int(size)
    except Exception as err:  # noqa: BLE001 - fall back to the tokenizer, say so
        print(f"nemo_granular: model vocab size unavailable ({err}); using len(tokenizer)", file=sys.stderr)
    return len(tokenizer)


def _missing_nemo_rl() -> str | None:
    """Name of the missing package when NeMo-RL (or one of its imports) cannot be imported."""
    try:
        import nemo_rl.algorithms.grpo  # noqa: F401
        import nemo_rl.utils.config  # noqa: F401
    except ImportError as err:
        return err.name or str(err)
    return None


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - the body needs NeMo-RL and GPUs
    args, overrides = parse_args(argv)
    missing = _missing_nemo_rl()
    if missing is not None:
        print(f"nemo_granular.run_grpo: missing package '{missing}': run inside a NeMo-RL (commit 7ea279ab) "
              f"environment with nemo_granular on PYTHONPATH (see docs/nemo-rl.md)", file=sys.stderr)
        return 2

    from omegaconf import OmegaConf

    from nemo_rl.algorithms.grpo import MasterConfig, grpo_train, setup, shutdown_environments
    from nemo_rl.algorithms.utils import get_tokenizer
    from nemo_rl.data.utils import setup_response_data
    from nemo_rl.distributed.virtual_cluster import init_ray
    from nemo_rl.models.generation import configure_generation_config
    from nemo_rl.utils.config import load_config, parse_hydra_overrides, register_omegaconf_resolvers
    from nemo_rl.utils.logger import get_next_experiment_dir

    from .nemo_rl import install
    from .nemo_rl.environments import register_espo_environment
    from .nemo_rl.policy import make_policy_factory, register_worker_extensions

    register_omegaconf_resolvers()
    config = load_config(args.config)
    if overrides:
        config = parse_hydra_overrides(config, overrides)
    config = OmegaConf.to_container(config, resolve=True)
    try:
        check_supported_modes(config)
        opts = runtime_options(config)
    except ValueError as err:
        print(f"nemo_granular.run_grpo: {err}", file=sys.stderr)
        return 2
    master_config = MasterConfig(**config)
    pprint.pprint(master_config)

    master_config.logger["log_dir"] = get_next_experiment_dir(master_config.logger["log_dir"])
    init_ray()
    tokenizer = get_tokenizer(master_config.policy["tokenizer"])
    gen_cfg = master_config.policy["generation"]
    if gen_cfg is None:
        print("nemo_granular.run_grpo: policy.generation is required for GRPO", file=sys.stderr)
        return 2
    megatron_cfg = master_config.policy.get("megatron_cfg") or {}
    master_config.policy["generation"] = configure_generation_config(
        gen_cfg, tokenizer, has_refit_draft_weights=bool((master_config.policy.get("draft") or {}).get("enabled")),
        trains_mtp=bool(megatron_cfg.get("mtp_num_layers")))

    register_espo_environment()
    register_worker_extensions()
    dataset, val_dataset, task_to_env, val_task_to_env = setup_response_data(
        tokenizer, master_config.data, master_config.env)

    install()
    vocab_size = _model_vocab_size(master_config.policy, tokenizer)
    loss_fn = build_loss(master_config, tokenizer, vocab_size, opts["entropy_source"])
    delimiter_table = getattr(getattr(loss_fn, "inner", loss_fn), "delimiter_table", None)
    factory = make_policy_factory(master_config, delimiter_table) if opts["entropy_source"] == "extension" else None

    (policy, policy_generation, _gym, _clusters, dataloader, val_dataloader, _nemo_loss, logger, checkpointer,
     grpo_state, master_config, teacher_worker_groups, alias_to_group_alias) = setup(
        master_config, tokenizer, dataset, val_dataset, policy_factory=factory)

    try:
        if master_config.grpo.async_grpo.enabled:
            from nemo_rl.algorithms.grpo import async_grpo_train

            async_grpo_train(policy=policy, policy_generation=policy_generation, dataloader=dataloader,
                             val_dataloader=val_dataloader, tokenizer=tokenizer, loss_fn=loss_fn,
                             task_to_env=task_to_env, val_task_to_env=val_task_to_env, logger=logger,
                             checkpointer=checkpointer, grpo_save_state=grpo_state, master_config=master_config,
                             max_trajectory_age_steps=master_config.grpo.async_grpo.max_trajectory_age_steps,
                             teacher_worker_groups=teacher_worker_groups, alias_to_group_alias=alias_to_group_alias)
        else:
            with checkpointer:
                grpo_train(policy, policy_generation, dataloader, val_dataloader, tokenizer, loss_fn, task_to_env,
                           val_task_to_env, logger, checkpointer, grpo_state, master_config)
    finally:
        shutdown_environments(task_to_env, val_task_to_env)
        try:
            policy_generation.shutdown()
        except Exception as err:  # noqa: BLE001
            print(f"error shutting down generation: {err}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
