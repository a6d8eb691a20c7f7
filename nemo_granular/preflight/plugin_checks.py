"""nemo-granular's own start-up refusals, reused from the drivers (nothing re-stated here).

* ``run_grpo``: :func:`nemo_granular.run_grpo.check_config` (data plane, single-controller and
  async-GRPO refusals, the ``nemo_granular:`` section, ratio-always-one), the loss config
  (:func:`nemo_granular.config.parse_policy_loss_config`, what ``GranularPolicyLoss`` validates),
  the advantage estimator name (ours or one NeMo-RL's ``_create_advantage_estimator`` knows) and
  the worker extension's backend (:func:`nemo_granular.nemo_rl.policy.extension_fqn_for`);
* ``run_sppo``: :func:`nemo_granular.sppo.validate.validate_sppo_config` (with its warnings), the
  ratio-always-one refusal and the async-PPO checks ``run_sppo`` makes before ``setup()``.
"""

from __future__ import annotations

from collections.abc import Mapping

from .findings import Finding, error, warning
from .layout import dig

__all__ = ["grpo_plugin_checks", "sppo_plugin_checks", "NEMO_RL_ESTIMATORS", "OUR_ESTIMATORS"]

RUN_GRPO = "nemo_granular/run_grpo.py:check_config"
RUN_SPPO = "nemo_granular/run_sppo.py:prepare_config"
OUR_ESTIMATORS = ("grpo", "espo")
# the names nemo_rl/algorithms/grpo.py:_create_advantage_estimator accepts (others raise at step 1)
NEMO_RL_ESTIMATORS = ("gdpo", "grpo", "opd", "reinforce_plus_plus")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def grpo_plugin_checks(cfg: Mapping) -> list[Finding]:
    from ..config import parse_advantage_config, parse_policy_loss_config
    from ..nemo_rl.policy import extension_fqn_for
    from ..run_grpo import check_config

    out: list[Finding] = []
    try:
        opts = check_config(cfg)
    except ValueError as err:
        out.append(error(RUN_GRPO, _first_line(err)))
        opts = {"entropy_source": dig(cfg, "nemo_granular.entropy_source", "extension")}
    try:
        parse_policy_loss_config(cfg.get("loss_fn") or {})
    except ValueError as err:
        out.append(error("nemo_granular/config.py:parse_policy_loss_config", _first_line(err)))
    name = dig(cfg, "grpo.adv_estimator.name", "grpo")
    if name == "sppo":
        out.append(
            error(
                "nemo_granular/nemo_rl/estimators.py:install",
                "grpo.adv_estimator.name: sppo needs the PPO loop and a critic: use run_sppo with a PPO config",
            )
        )
    elif name in OUR_ESTIMATORS:
        try:
            parse_advantage_config(dig(cfg, "grpo.adv_estimator", {}))
        except ValueError as err:
            out.append(error("nemo_granular/config.py:parse_advantage_config", _first_line(err)))
    elif name not in NEMO_RL_ESTIMATORS:
        out.append(
            error(
                "nemo_rl/algorithms/grpo.py:_create_advantage_estimator",
                f"grpo.adv_estimator.name {name!r} is unknown (ours: {', '.join(OUR_ESTIMATORS)}; "
                f"NeMo-RL's: {', '.join(NEMO_RL_ESTIMATORS)})",
            )
        )
    if opts.get("entropy_source") == "extension":
        try:
            extension_fqn_for(cfg.get("policy") or {})
        except ValueError as err:
            out.append(error("nemo_granular/nemo_rl/policy.py:extension_fqn_for", _first_line(err)))
    return out


def sppo_plugin_checks(cfg: Mapping, master) -> list[Finding]:
    """``master``: NeMo-RL's PPO ``MasterConfig`` (for the async checks), or None when it did not validate."""
    from ..nemo_rl.configs import check_ratio_is_active
    from ..run_sppo import _check_async, async_ppo_enabled
    from ..sppo.validate import validate_sppo_config

    out: list[Finding] = []
    try:
        opts, warns = validate_sppo_config(cfg, source="sppo")
    except ValueError as err:
        return [error("nemo_granular/sppo/validate.py:validate_sppo_config", _first_line(err))]
    out += [warning("nemo_granular/sppo/validate.py:validate_sppo_config", w) for w in warns]
    if not opts.allow_ratio_always_one:
        try:
            check_ratio_is_active(dict(cfg), "ppo", "sppo.allow_ratio_always_one")
        except ValueError as err:
            out.append(error(RUN_SPPO, _first_line(err)))
    if master is not None and async_ppo_enabled(master):
        try:
            _check_async(master)
        except ValueError as err:
            out.append(error("nemo_granular/run_sppo.py:_check_async", _first_line(err)))
    out += _value_head_checks(cfg)
    return out


def _value_head_checks(cfg: Mapping) -> list[Finding]:
    """run_sppo's refusal of a multi-GPU DTensor critic whose HF config sets ``pad_token_id`` (its value
    head would start as uninitialised memory), from the locally cached model config only (offline)."""
    from transformers import AutoConfig

    from ..sppo.validate import check_value_head_initialised

    where = "nemo_granular/sppo/validate.py:check_value_head_initialised"
    try:
        readable = check_value_head_initialised(
            cfg, lambda name: AutoConfig.from_pretrained(name, local_files_only=True, trust_remote_code=False)
        )
    except ValueError as err:
        return [error(where, _first_line(err))]
    if not readable:
        return [
            warning(
                where,
                "the value model's config is not cached here, so its pad_token_id (an uninitialised "
                "value head on several GPUs) was not checked; run_sppo checks it at start",
            )
        ]
    return []
