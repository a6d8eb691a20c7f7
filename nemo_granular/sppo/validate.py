"""Start-up checks for SPPO on NeMo-RL's PPO loop.

* :class:`SPPOOptions` — the top-level ``sppo:`` config section (NeMo-RL's
  ``value_loss_fn`` config is ``extra="forbid"``, so SPPO's own keys live here).
* :func:`validate_sppo_config` — one-line ``ValueError`` for settings that break SPPO
  (non-binary rewards, wrong estimator, fused value loss, batch divisibility) and warnings
  for settings that deviate from the paper (N ≠ 1, KL ≠ 0).
* :func:`check_same_tokenizer` / :func:`check_critic_tokenizer` — a smaller decoupled
  critic must share the policy's tokenizer: ``ppo.setup`` hands the critic the *policy*
  tokenizer's ids (``nemo_rl/algorithms/ppo.py`` ``Value(..., tokenizer)``).
* :func:`check_value_head_initialised` — refuses the one setting under which NeMo-RL's DTensor
  value worker leaves the critic's head as uninitialised memory.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from ..config import NEMO_RL_LOSS_KEYS, format_validation_error
from ..lookup import lookup

__all__ = [
    "SPPOOptions",
    "parse_sppo_options",
    "validate_sppo_config",
    "check_same_tokenizer",
    "check_critic_tokenizer",
    "check_value_head_initialised",
]


class SPPOOptions(BaseModel):
    """``sppo:`` section.

    prompt_only_critic: wrap the value model in ``PromptOnlyValue`` (critic forwards prompt + 1
        token instead of the full sequence; identical result, see ``sppo/critic.py``).
    dedup_prompts: forward each distinct prompt once in ``get_values`` (matters for N > 1).
    check_tokenizers: compare the critic's tokenizer with the policy's at start-up.
    log_diagnostics / diagnostics_prefix: log :func:`critic_diagnostics` every step.
    allow_ratio_always_one: run even when the importance ratio is identically 1
        (``loss_fn.force_on_policy_ratio: true`` or one optimizer step per rollout); refused otherwise.
    """

    model_config = ConfigDict(extra="forbid")

    prompt_only_critic: bool = True
    dedup_prompts: bool = True
    check_tokenizers: bool = True
    log_diagnostics: bool = True
    diagnostics_prefix: str = "sppo_critic"
    allow_ratio_always_one: bool = False

    @field_validator("diagnostics_prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        if not v or "/" in v:
            raise ValueError("must be a non-empty name without '/'")
        return v


def parse_sppo_options(cfg: Mapping | None) -> SPPOOptions:
    """Validate the ``sppo:`` section (missing → defaults); one-line ``ValueError``."""
    try:
        return SPPOOptions.model_validate(dict(cfg or {}))
    except ValidationError as err:
        raise ValueError(format_validation_error(err, "sppo")) from None


def validate_sppo_config(cfg: Mapping, source: str = "config") -> tuple[SPPOOptions, list[str]]:
    """Check a resolved master config (plain mapping, OmegaConf container or NeMo-RL
    ``MasterConfig``) for SPPO. Returns ``(options, warnings)``; raises a one-line
    ``ValueError`` naming the field and ``source`` for a setting SPPO cannot run with."""

    def fail(msg: str):
        raise ValueError(f"{source}: {msg}")

    for section in ("ppo", "policy", "value", "loss_fn"):
        if lookup(cfg, section) is None:
            fail(f"section '{section}' is missing (SPPO runs on NeMo-RL's PPO config)")
    opts = parse_sppo_options(lookup(cfg, "sppo"))
    name = lookup(cfg, "ppo.adv_estimator.name")
    if name != "sppo":
        fail(f"ppo.adv_estimator.name must be 'sppo' (got {name!r})")
    if bool(lookup(cfg, "ppo.reward_scaling.enabled", False)):
        fail("ppo.reward_scaling.enabled must be false: the SPPO critic's BCE needs rewards in {0, 1}")
    if bool(lookup(cfg, "ppo.reward_shaping.enabled", False)):
        fail("ppo.reward_shaping.enabled must be false: the SPPO critic's BCE needs rewards in {0, 1}")
    if bool(lookup(cfg, "value.sequence_packing.fuse_loss", False)):
        fail("value.sequence_packing.fuse_loss must be false (the value loss needs the critic's logits)")
    if bool(lookup(cfg, "ppo.use_dynamic_sampling", False)):
        fail("ppo.use_dynamic_sampling must be false (SPPO keeps every prompt; N = 1 has no group variance)")
    n = int(lookup(cfg, "ppo.num_generations_per_prompt", 1))
    prompts = int(lookup(cfg, "ppo.num_prompts_per_step", 1))
    rows = n * prompts
    for key in ("policy.train_global_batch_size", "value.train_global_batch_size"):
        gbs = lookup(cfg, key)
        if gbs is not None and (int(gbs) <= 0 or rows % int(gbs) != 0):
            fail(f"{key}={gbs} must divide ppo.num_prompts_per_step × num_generations_per_prompt = {rows}")
    warnings: list[str] = []
    if n != 1:
        warnings.append(f"ppo.num_generations_per_prompt={n}: SPPO is meant for N = 1 (one sample per prompt)")
    # a missing key means NeMo-RL's default (0.01), which the loss then applies
    kl_default = NEMO_RL_LOSS_KEYS["reference_policy_kl_penalty"][1]
    kl = float(lookup(cfg, "loss_fn.reference_policy_kl_penalty", kl_default) or 0.0)
    if kl != 0.0:
        unset = "" if lookup(cfg, "loss_fn.reference_policy_kl_penalty") is not None else " (unset: NeMo-RL's default)"
        warnings.append(f"loss_fn.reference_policy_kl_penalty={kl}{unset}: the SPPO paper uses no KL penalty (0)")
    if bool(lookup(cfg, "loss_fn.use_kl_in_reward", False)):
        fail("loss_fn.use_kl_in_reward must be false: it makes rewards non-binary")
    if int(lookup(cfg, "ppo.ppo_epochs", 1)) != 1:
        warnings.append(f"ppo.ppo_epochs={lookup(cfg, 'ppo.ppo_epochs')}: the paper makes one pass per rollout batch")
    return opts, warnings


def _special(tok: Any) -> dict:
    out = {}
    for attr in ("bos_token", "eos_token", "unk_token", "pad_token"):
        tid = getattr(tok, f"{attr}_id", None)
        out[attr] = (getattr(tok, attr, None), tid)
    out["all_special_tokens"] = tuple(sorted(str(t) for t in getattr(tok, "all_special_tokens", [])))
    return out


def check_same_tokenizer(
    policy_tok: Any, critic_tok: Any, policy_name: str = "policy", critic_name: str = "value"
) -> None:
    """Raise a one-line ``ValueError`` unless the two tokenizers map every token to the same
    id and agree on their special tokens (bos/eos/unk/pad and the full special-token set)."""
    why = None
    pv, cv = policy_tok.get_vocab(), critic_tok.get_vocab()
    if len(pv) != len(cv):
        why = f"vocabulary sizes differ ({len(pv)} vs {len(cv)})"
    elif pv != cv:
        bad = sorted(t for t in pv if cv.get(t) != pv[t])[:1]
        t = bad[0] if bad else next(iter(set(cv) - set(pv)))
        why = f"token {t!r} has id {pv.get(t)} in the policy tokenizer but {cv.get(t)} in the critic's"
    else:
        ps, cs = _special(policy_tok), _special(critic_tok)
        for k in ps:
            if ps[k] != cs[k]:
                why = f"special token {k} differs ({ps[k]!r} vs {cs[k]!r})"
                break
    if why is not None:
        raise ValueError(
            f"critic {critic_name!r} does not share the policy tokenizer {policy_name!r}: {why}; "
            f"the critic reads the policy's token ids, so use a critic of the same tokenizer family"
        )


def check_critic_tokenizer(cfg: Mapping, loader: Callable[[str], Any] | None = None) -> bool:
    """Compare the tokenizer of ``value.model_name`` with ``policy.tokenizer.name`` (or
    ``policy.model_name``). Returns False when both name the same checkpoint (nothing to
    check), True after a successful comparison; raises ``ValueError`` on a mismatch.
    ``loader`` defaults to ``transformers.AutoTokenizer.from_pretrained``."""
    pname = lookup(cfg, "policy.tokenizer.name") or lookup(cfg, "policy.model_name")
    cname = lookup(cfg, "value.model_name") or pname
    if pname is None:
        raise ValueError("policy.tokenizer.name / policy.model_name is missing")
    if str(cname) == str(pname):
        return False
    if loader is None:
        from transformers import AutoTokenizer

        def loader(name):
            return AutoTokenizer.from_pretrained(name)

    check_same_tokenizer(loader(str(pname)), loader(str(cname)), str(pname), str(cname))
    return True


def check_value_head_initialised(cfg: Mapping, config_loader: Callable[[str], Any] | None = None) -> bool:
    """Refuse (one-line ``ValueError``) a DTensor value model on more than one GPU whose HF config
    sets ``pad_token_id``; returns True when the setting is safe, False when the config could not be read.

    With more than one worker, Automodel builds the model on the meta device and materialises the
    parameters with ``torch.empty`` (``checkpointing.py:594-596``), then skips ``initialize_weights``
    when a sharded embedding has a ``padding_idx`` (``checkpointing.py:640-662``, Automodel
    24b47e856). The value head (``score``) is not in the causal-LM checkpoint, so it keeps that
    uninitialised memory: the critic starts from garbage (the CPU loop measured a BCE of 1e30).
    ``value.hf_config_overrides.pad_token_id: null`` removes the ``padding_idx`` (NeMo-RL still takes
    the pad id from the tokenizer, ``automodel/setup.py:786``) and the head is initialised.
    ``config_loader`` defaults to ``transformers.AutoConfig.from_pretrained``.
    """
    if not bool(lookup(cfg, "value.dtensor_cfg.enabled", False)) or bool(
        lookup(cfg, "value.megatron_cfg.enabled", False)
    ):
        return True
    gpus = int(lookup(cfg, "cluster.gpus_per_node", 1) or 1) * int(lookup(cfg, "cluster.num_nodes", 1) or 1)
    tp = int(lookup(cfg, "value.dtensor_cfg.tensor_parallel_size", 1) or 1)
    if gpus <= 1 and tp <= 1:
        return True
    overrides = lookup(cfg, "value.hf_config_overrides") or {}
    if "pad_token_id" in overrides:
        pad = overrides["pad_token_id"]
    else:
        name = lookup(cfg, "value.model_name")
        if config_loader is None:
            from transformers import AutoConfig

            def config_loader(n):
                return AutoConfig.from_pretrained(n, trust_remote_code=True)

        try:
            hf = config_loader(str(name))
        except Exception:  # noqa: BLE001 - not readable here (e.g. a hub name offline): nothing to check
            return False
        pad = getattr(hf, "pad_token_id", None)
    if pad is not None:
        raise ValueError(
            f"value.model_name {lookup(cfg, 'value.model_name')!r} sets pad_token_id={pad}: NeMo-RL's DTensor value "
            f"worker on {max(gpus, tp)} GPUs then leaves the value head as uninitialised memory (Automodel skips "
            f"initialize_weights for a sharded embedding with a padding_idx); set value.hf_config_overrides."
            f"pad_token_id: null (the pad id still comes from the tokenizer)"
        )
    return True
