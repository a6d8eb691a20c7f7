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

The config is loaded by :func:`nemo_granular.nemo_rl.configs.load_resolved`: NeMo-RL's own
``load_config`` with the ``nemo_rl/upstream/`` parents resolved against NeMo-RL's
``examples/configs`` (``$NEMO_RL_SRC`` or the importable ``nemo_rl``'s checkout; no link needed).

Refused with one line (exit status 2): ``data_plane.enabled: true`` (TransferQueue moves a fixed
field list and drops our keys); the single-controller trainer (``async_rl`` section); the
combinations NeMo-RL's ``examples/run_grpo.py`` refuses for async GRPO (dynamic sampling,
reward scaling, reward shaping, multiple dataloaders — ``async_grpo_train`` does not check
them itself); settings under which the importance ratio is identically 1
(``loss_fn.force_on_policy_ratio: true``, one optimizer step per rollout) unless
``nemo_granular.allow_ratio_always_one: true``; a missing config file or NeMo-RL parent config;
a missing NeMo-RL.
"""

from __future__ import annotations

import argparse
import os
import pprint
import sys
from collections.abc import Mapping
from typing import Any

from .lookup import lookup

__all__ = [
    "main",
    "parse_args",
    "check_supported_modes",
    "check_async_grpo",
    "check_config",
    "runtime_options",
    "build_loss",
    "EstimatorMetricsLogger",
    "RUNTIME_SECTION",
]

RUNTIME_SECTION = "nemo_granular"
ENTROPY_SOURCES = ("extension", "current_logits")
ALLOW_RATIO_ONE = "allow_ratio_always_one"
RUNTIME_KEYS = ("entropy_source", ALLOW_RATIO_ONE)
# what NeMo-RL's examples/run_grpo.py refuses for async GRPO (async_grpo_train does not check them)
ASYNC_GRPO_UNSUPPORTED = (
    ("grpo", "use_dynamic_sampling"),
    ("grpo", "reward_scaling", "enabled"),
    ("grpo", "reward_shaping", "enabled"),
    ("data", "use_multiple_dataloader"),
)


# the same sentences in run_sppo (tests/test_user_text.py)
OVERRIDES_HELP = "Unknown arguments are Hydra overrides (a.b=v, +a.b=v, ++a.b=v, ~a.b)."
INSTALL_HINT = (
    "run it inside NeMo-RL's environment (v0.7.0 or main 7ea279ab) with nemo-granular installed into it: "
    "`cd <NeMo-RL> && uv pip install --no-deps -e <nemo-granular>`, then `uv run python -m {prog} "
    "--config ...` (docs/nemo-rl.md §1)"
)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m nemo_granular.run_grpo",
        usage="%(prog)s [-h] --config CONFIG [key=value ...]",
        description="GRPO-family training (SSPO, ESPO, GSPO, GRPO) with nemo_granular on NeMo-RL. " + OVERRIDES_HELP,
    )
    parser.add_argument("--config", type=str, required=True, help="YAML config (may inherit NeMo-RL examples)")
    return parser.parse_known_args(argv)


def check_supported_modes(config: Mapping[str, Any]) -> None:
    """Refuse trainers that cannot carry our per-token keys (one-line ``ValueError``)."""
    dp = config.get("data_plane") or {}
    if bool(dp.get("enabled", False)):
        raise ValueError(
            "data_plane.enabled: true is not supported by nemo_granular (the TransferQueue trainer "
            "moves a fixed field list and drops prev_entropy/granular_group_ids); set it to false"
        )
    if lookup(config, ("loss_fn", "metrics_level")) == "minimal":
        from .nemo_rl.compat import require

        require("grpo_minimal_loss_metrics", "loss_fn.metrics_level: minimal (use full with run_grpo)")
    if config.get("async_rl") is not None:
        raise ValueError(
            "async_rl: the single-controller trainer is not supported by nemo_granular; "
            "use grpo.async_grpo with this script or the synchronous trainer"
        )


def check_async_grpo(config: Mapping[str, Any]) -> None:
    """NeMo-RL's launcher checks for async GRPO (``examples/run_grpo.py``), before any GPU work."""
    if not bool(lookup(config, ("grpo", "async_grpo", "enabled"))):
        return
    for path in ASYNC_GRPO_UNSUPPORTED:
        if bool(lookup(config, path)):
            raise ValueError(
                f"{'.'.join(path)}: true is not supported with async GRPO "
                "(grpo.async_grpo.enabled: true), "
                f"as in NeMo-RL's examples/run_grpo.py"
            )


def runtime_options(config: Mapping[str, Any]) -> dict[str, Any]:
    """The top-level ``nemo_granular:`` section (our runtime switches), validated."""
    opts = dict(config.get(RUNTIME_SECTION) or {})
    unknown = set(opts) - set(RUNTIME_KEYS)
    if unknown:
        raise ValueError(f"{RUNTIME_SECTION}: unknown key(s) {sorted(unknown)} (allowed: {', '.join(RUNTIME_KEYS)})")
    src = opts.setdefault("entropy_source", "extension")
    if src not in ENTROPY_SOURCES:
        raise ValueError(f"{RUNTIME_SECTION}.entropy_source: must be one of {list(ENTROPY_SOURCES)}, got {src!r}")
    allow = opts.setdefault(ALLOW_RATIO_ONE, False)
    if not isinstance(allow, bool):
        raise ValueError(f"{RUNTIME_SECTION}.{ALLOW_RATIO_ONE}: must be true or false, got {allow!r}")
    return opts


def check_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """All start-up checks on the resolved config; returns the runtime options (one-line ``ValueError``)."""
    from .nemo_rl.configs import check_ratio_is_active

    check_supported_modes(config)
    check_async_grpo(config)
    opts = runtime_options(config)
    auto_alpha = lookup(config, ("loss_fn", "granular", "espo", "alpha")) == "auto"
    if auto_alpha and opts["entropy_source"] == "current_logits":
        raise ValueError(
            "loss_fn.granular.espo.alpha: auto is set from the π_old entropy on the driver, which "
            f"{RUNTIME_SECTION}.entropy_source: current_logits does not compute; give α as a number"
        )
    if not opts[ALLOW_RATIO_ONE]:
        check_ratio_is_active(dict(config), "grpo", f"{RUNTIME_SECTION}.{ALLOW_RATIO_ONE}")
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


class EstimatorMetricsLogger:
    """NeMo-RL's ``Logger`` plus the advantage estimator's ``last_metrics`` in synchronous runs.

    ``async_grpo_train`` merges ``adv_estimator.last_metrics`` into the step's rollout metrics;
    ``grpo_train`` never reads them, so ESPO's ``verification_failed_frac`` was never logged in
    synchronous runs. This wrapper (handed to ``grpo_train`` in place of the logger ``setup``
    returned) adds the metrics of the estimator our factory built last
    (:data:`nemo_granular.nemo_rl.estimators.LAST_BUILT`) to the next ``prefix="train"`` call
    after each ``compute_advantage`` — the step's main train metrics — without overwriting keys
    already there (async runs keep theirs). Everything else is delegated unchanged."""

    def __init__(self, logger, estimator_source=None):
        from .nemo_rl import estimators

        self._inner = logger
        self._source = estimator_source or (lambda: estimators.LAST_BUILT[0] if estimators.LAST_BUILT else None)
        self._consumed = 0

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def log_metrics(self, metrics, step, prefix="", *args, **kwargs):
        if prefix == "train":
            est = self._source()
            calls = getattr(est, "calls", None)
            extra = getattr(est, "last_metrics", None)
            if isinstance(calls, int) and calls > self._consumed:
                self._consumed = calls
                if extra:
                    metrics = {**metrics, **{k: v for k, v in extra.items() if k not in metrics}}
        return self._inner.log_metrics(metrics, step, prefix, *args, **kwargs)


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
    from .nemo_rl.compat import module

    try:
        module("grpo")
        module("nemo_rl.utils.config")
    except ImportError as err:
        return err.name or str(err)
    return None


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - the body needs NeMo-RL and GPUs
    from .nemo_rl.time_limit import StopWatch, check_save_every, install_stop_signal

    install_stop_signal()  # first: SIGUSR1 (slurm/launch.sh's "save and stop") must never kill the driver
    args, overrides = parse_args(argv)
    from .nemo_rl.configs import ConfigFileError, check_config_files

    try:  # before NeMo-RL's algorithms are imported: a wrong path is answered at once
        check_config_files(args.config)
    except ConfigFileError as err:
        print(f"nemo_granular.run_grpo: {err}", file=sys.stderr)
        return 2
    missing = _missing_nemo_rl()
    if missing is not None:
        print(
            f"nemo_granular.run_grpo: missing package '{missing}': "
            + INSTALL_HINT.format(prog="nemo_granular.run_grpo"),
            file=sys.stderr,
        )
        return 2

    from pydantic import ValidationError

    from .nemo_rl import compat, install

    try:
        print(f"nemo_granular.run_grpo: {compat.version()}", flush=True)
    except compat.UnsupportedNemoRL as err:
        print(f"nemo_granular.run_grpo: {err}", file=sys.stderr)
        return 2
    MasterConfig, grpo_train, setup = compat.get("MasterConfig"), compat.get("grpo_train"), compat.get("setup")
    get_tokenizer = compat.get("get_tokenizer")
    setup_response_data, init_ray = compat.get("setup_response_data"), compat.get("init_ray")
    configure_generation_config = compat.get("configure_generation_config")
    get_next_experiment_dir = compat.get("get_next_experiment_dir")
    from .nemo_rl.configs import load_resolved
    from .nemo_rl.environments import register_espo_environment
    from .nemo_rl.policy import make_policy_factory, register_worker_extensions

    try:
        config = load_resolved(args.config, overrides)
        opts = check_config(config)
        check_save_every(bool(lookup(config, ("checkpointing", "enabled"))))
        master_config = MasterConfig(**config)
    except (ValueError, FileNotFoundError) as err:  # ConfigFileError is a FileNotFoundError
        if isinstance(err, ValidationError):
            first = err.errors()[0]
            msg = f"{args.config}: {'.'.join(str(x) for x in first['loc'])}: {first['msg']}"
        else:
            msg = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"nemo_granular.run_grpo: {msg}", file=sys.stderr)
        return 2
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
        gen_cfg,
        tokenizer,
        has_refit_draft_weights=bool((master_config.policy.get("draft") or {}).get("enabled")),
        trains_mtp=bool(megatron_cfg.get("mtp_num_layers")),
    )

    register_espo_environment()
    register_worker_extensions()
    dataset, val_dataset, task_to_env, val_task_to_env = setup_response_data(
        tokenizer, master_config.data, master_config.env
    )

    install()
    vocab_size = _model_vocab_size(master_config.policy, tokenizer)
    loss_fn = build_loss(master_config, tokenizer, vocab_size, opts["entropy_source"])
    delimiter_table = getattr(getattr(loss_fn, "inner", loss_fn), "delimiter_table", None)
    factory = make_policy_factory(master_config, delimiter_table) if opts["entropy_source"] == "extension" else None

    (
        policy,
        policy_generation,
        _gym,
        _clusters,
        dataloader,
        val_dataloader,
        _nemo_loss,
        logger,
        checkpointer,
        grpo_state,
        master_config,
        teacher_worker_groups,
        alias_to_group_alias,
    ) = setup(master_config, tokenizer, dataset, val_dataset, policy_factory=factory)

    logger = EstimatorMetricsLogger(logger)
    # NeMo-RL's time limit, SIGUSR1, NG_SAVE_EVERY_MINUTES (through the checkpointing dict the loop reads)
    watch = StopWatch(compat.module("grpo"), master_config.checkpointing).start()
    async_on = bool(compat.conf(master_config, "grpo.async_grpo.enabled", False))
    try:
        if async_on:
            async_grpo_train = compat.get("async_grpo_train")
            async_grpo_train(
                policy=policy,
                policy_generation=policy_generation,
                dataloader=dataloader,
                val_dataloader=val_dataloader,
                tokenizer=tokenizer,
                loss_fn=loss_fn,
                task_to_env=task_to_env,
                val_task_to_env=val_task_to_env,
                logger=logger,
                checkpointer=checkpointer,
                grpo_save_state=grpo_state,
                master_config=master_config,
                max_trajectory_age_steps=compat.conf(master_config, "grpo.async_grpo.max_trajectory_age_steps"),
                teacher_worker_groups=teacher_worker_groups,
                alias_to_group_alias=alias_to_group_alias,
            )
        else:
            with compat.checkpoint_flush(checkpointer):
                grpo_train(
                    policy,
                    policy_generation,
                    dataloader,
                    val_dataloader,
                    tokenizer,
                    loss_fn,
                    task_to_env,
                    val_task_to_env,
                    logger,
                    checkpointer,
                    grpo_state,
                    master_config,
                )
    finally:
        watch.stop()
        compat.shutdown_environments(task_to_env, val_task_to_env)
        try:
            policy_generation.shutdown()
        except Exception as err:  # noqa: BLE001
            print(f"error shutting down generation: {err}", file=sys.stderr)
    # 99 when NeMo-RL stopped at its time limit (or after SIGUSR1) before the end: slurm/launch.sh requeues
    return watch.exit_code(
        grpo_state, master_config.grpo, master_config.checkpointing, None if async_on else dataloader
    )


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
