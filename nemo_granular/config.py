"""The user-facing configuration contract (pydantic), and the algorithm presets of docs/algorithms/math.md §8.

```yaml
loss_fn:                     # NeMo-RL's own keys keep their meaning
  granular:
    algorithm: sspo          # grpo | gspo | gspo_token | sspo | sspo_no_ec | espo | sppo
    granularity: segment     # token | sequence | segment | entropy_group (overrides the preset)
    ratio: shared            # shared | token_decomposed
    segment_delimiters: ["\\n\\n"]
    entropy_top_fraction: 0.2
    clip: sspo_entropy       # fixed | sspo_entropy | espo_entropy
    sspo: {alpha: 0.0, beta: 0.8, gamma: 1.75}
    espo: {alpha: 1.0, vocab_size: null}
    aggregation: seq_mean_token_mean
grpo:
  adv_estimator: {name: espo}
```

A preset fills only the fields the user did not set. NeMo-RL's ``ratio_clip_min`` /
``ratio_clip_max``, when present in ``loss_fn``, are the ε of ``fixed`` clipping and override
the preset's ε. Every validation error is a one-line ``ValueError`` naming the field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, ValidationError, field_validator, model_validator

__all__ = [
    "PRESETS",
    "SSPOClipConfig",
    "ESPOClipConfig",
    "GranularConfig",
    "PolicyLossConfig",
    "AdvantageConfig",
    "format_validation_error",
    "parse_policy_loss_config",
    "parse_advantage_config",
]

Algorithm = Literal["grpo", "gspo", "gspo_token", "sspo", "sspo_no_ec", "espo", "sppo"]
Granularity = Literal["token", "sequence", "segment", "entropy_group"]
RatioForm = Literal["shared", "token_decomposed"]
ClipKind = Literal["fixed", "sspo_entropy", "espo_entropy"]
Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_group_mean"]

# docs/algorithms/math.md §8 (ε of `fixed` clipping as (low, high); advantage estimator name)
PRESETS: dict[str, dict[str, Any]] = {
    "grpo": dict(granularity="token", ratio="shared", clip="fixed", eps=(0.2, 0.2),
                 aggregation="token_mean", advantage="grpo"),
    "gspo": dict(granularity="sequence", ratio="shared", clip="fixed", eps=(3e-4, 4e-4),
                 aggregation="seq_mean_token_mean", advantage="grpo"),
    "gspo_token": dict(granularity="sequence", ratio="token_decomposed", clip="fixed", eps=(3e-4, 4e-4),
                       aggregation="seq_mean_token_mean", advantage="grpo"),
    "sspo": dict(granularity="segment", ratio="shared", clip="sspo_entropy", eps=(0.2, 0.2),
                 aggregation="seq_mean_token_mean", advantage="grpo"),
    "sspo_no_ec": dict(granularity="segment", ratio="shared", clip="fixed", eps=(0.2, 0.2),
                       aggregation="seq_mean_token_mean", advantage="grpo"),
    "espo": dict(granularity="entropy_group", ratio="token_decomposed", clip="espo_entropy", eps=(0.2, 0.2),
                 aggregation="seq_mean_group_mean", advantage="espo"),
    "sppo": dict(granularity="token", ratio="shared", clip="fixed", eps=(0.2, 0.2),
                 aggregation="token_mean", advantage="sppo"),
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class SSPOClipConfig(_Strict):
    """SSPO eq. 13–15: hi = min(1 + α + H̄, γ), lo = max(0, min(1 − H̄, β))."""

    alpha: NonNegativeFloat = 0.0
    beta: Annotated[float, Field(ge=0.0, le=1.0)] = 0.8
    gamma: Annotated[float, Field(ge=1.0)] = 1.75


class ESPOClipConfig(_Strict):
    """ESPO §3.4: ε = α · mean_group(H / log|V|); |V| = vocab_size (null: taken from the model)."""

    alpha: NonNegativeFloat = 1.0
    vocab_size: Optional[Annotated[int, Field(ge=2)]] = None


class GranularConfig(_Strict):
    """``loss_fn.granular``. Fields left unset are filled from ``algorithm``'s preset."""

    algorithm: Algorithm = "grpo"
    granularity: Optional[Granularity] = None
    ratio: Optional[RatioForm] = None
    segment_delimiters: list[str] = Field(default_factory=lambda: ["\n\n"])
    entropy_top_fraction: Union[float, list[float]] = 0.2
    clip: Optional[ClipKind] = None
    sspo: SSPOClipConfig = Field(default_factory=SSPOClipConfig)
    espo: ESPOClipConfig = Field(default_factory=ESPOClipConfig)
    aggregation: Optional[Aggregation] = None
    # filled from the preset when the user gives neither this nor loss_fn.ratio_clip_min/max
    eps_low: Optional[NonNegativeFloat] = None
    eps_high: Optional[NonNegativeFloat] = None

    @field_validator("segment_delimiters")
    @classmethod
    def _delims(cls, v):
        if not v or any((not isinstance(d, str)) or d == "" for d in v):
            raise ValueError(f"must be a non-empty list of non-empty strings, got {v!r}")
        return v

    @field_validator("entropy_top_fraction")
    @classmethod
    def _top(cls, v):
        cuts = [v] if isinstance(v, (int, float)) else list(v)
        if not cuts or any(not 0.0 < q < 1.0 for q in cuts):
            raise ValueError(f"must be in (0, 1) (or an increasing list of such cut points), got {v!r}")
        if any(b <= a for a, b in zip(cuts, cuts[1:])):
            raise ValueError(f"cut points must be strictly increasing, got {v!r}")
        return v

    @model_validator(mode="after")
    def _fill_preset(self):
        preset = PRESETS[self.algorithm]
        # object.__setattr__: filling defaults must not re-trigger validate_assignment
        for name in ("granularity", "ratio", "clip", "aggregation"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, preset[name])
        if self.eps_low is None:
            object.__setattr__(self, "eps_low", preset["eps"][0])
        if self.eps_high is None:
            object.__setattr__(self, "eps_high", preset["eps"][1])
        if self.clip == "espo_entropy" and self.espo.alpha == 0:
            raise ValueError("loss_fn.granular.espo.alpha: 0 freezes the policy (every ratio clipped at 1)")
        return self

    @property
    def entropy_cut_points(self) -> list[float]:
        v = self.entropy_top_fraction
        return [float(v)] if isinstance(v, (int, float)) else [float(q) for q in v]

    @property
    def needs_entropy(self) -> bool:
        return self.granularity == "entropy_group" or self.clip in ("sspo_entropy", "espo_entropy")

    @property
    def advantage(self) -> str:
        return PRESETS[self.algorithm]["advantage"]


class PolicyLossConfig(BaseModel):
    """The subset of NeMo-RL's ``ClippedPGLossConfig`` the granular loss reads, plus ``granular``.

    Extra keys are allowed (NeMo-RL's config carries more); the unsupported modes are refused.
    """

    model_config = ConfigDict(extra="allow")

    ratio_clip_min: Optional[NonNegativeFloat] = None
    ratio_clip_max: Optional[NonNegativeFloat] = None
    ratio_clip_c: Optional[Annotated[float, Field(gt=1.0)]] = None  # dual clip
    reference_policy_kl_penalty: float = 0.0
    reference_policy_kl_type: Literal["k1", "k2", "k3"] = "k3"
    kl_input_clamp_value: Optional[float] = 20.0
    kl_output_clamp_value: Optional[float] = 10.0
    use_kl_in_reward: bool = False
    use_on_policy_kl_approximation: bool = False
    use_importance_sampling_correction: bool = False
    truncated_importance_sampling_type: Optional[Literal["tis", "icepop", "seq-mask-tis"]] = None
    truncated_importance_sampling_ratio: Optional[float] = None
    truncated_importance_sampling_ratio_min: Optional[float] = None
    force_on_policy_ratio: bool = False
    sequence_level_importance_ratios: bool = False
    disable_ppo_ratio: bool = False
    use_cispo: bool = False
    positive_example_nll_weight: float = 0.0
    granular: GranularConfig = Field(default_factory=GranularConfig)

    @model_validator(mode="after")
    def _check(self):
        g = self.granular
        if self.use_cispo:
            raise ValueError("loss_fn.use_cispo: CISPO is not a granular-ratio loss; use NeMo-RL's ClippedPGLossFn")
        if self.disable_ppo_ratio:
            raise ValueError("loss_fn.disable_ppo_ratio: the granular loss needs the PPO ratio")
        if self.sequence_level_importance_ratios and g.granularity != "sequence":
            raise ValueError(
                "loss_fn.sequence_level_importance_ratios: true conflicts with "
                f"granular.granularity={g.granularity!r} (use algorithm: gspo, or set it false)")
        if self.truncated_importance_sampling_type is not None:
            if not self.use_importance_sampling_correction:
                raise ValueError("loss_fn.truncated_importance_sampling_type needs use_importance_sampling_correction: true")
            if not self.truncated_importance_sampling_ratio or self.truncated_importance_sampling_ratio <= 0:
                raise ValueError("loss_fn.truncated_importance_sampling_ratio must be > 0")
            if self.truncated_importance_sampling_type in ("icepop", "seq-mask-tis") and \
                    self.truncated_importance_sampling_ratio_min is None:
                raise ValueError(f"loss_fn.truncated_importance_sampling_ratio_min is required for "
                                 f"{self.truncated_importance_sampling_type}")
            if self.truncated_importance_sampling_type == "seq-mask-tis" and g.granularity != "token":
                raise ValueError("loss_fn.truncated_importance_sampling_type: seq-mask-tis needs token granularity")
        return self

    @property
    def eps_low(self) -> float:
        return self.ratio_clip_min if self.ratio_clip_min is not None else self.granular.eps_low

    @property
    def eps_high(self) -> float:
        return self.ratio_clip_max if self.ratio_clip_max is not None else self.granular.eps_high

    @property
    def kl_coef(self) -> float:
        return 0.0 if self.use_kl_in_reward else self.reference_policy_kl_penalty


class AdvantageConfig(BaseModel):
    """``grpo.adv_estimator`` (NeMo-RL's key names; extra keys allowed)."""

    model_config = ConfigDict(extra="allow")

    name: Literal["grpo", "espo", "sppo"] = "grpo"
    normalize_rewards: bool = True
    use_leave_one_out_baseline: bool = False
    epsilon: float = 1e-6
    # ESPO: per-response flag in the rollout batch that marks a failed verification
    verification_failed_key: str = "verification_failed"


def format_validation_error(err: ValidationError, prefix: str = "") -> str:
    """One line per pydantic error: ``<prefix>.<field.path>: <message>``."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"] if p not in ("function-after",) and not str(p).startswith("function"))
        name = f"{prefix}.{loc}" if prefix and loc else (prefix or loc)
        msg = e["msg"].removeprefix("Value error, ")
        if e.get("type") in ("literal_error", "enum", "greater_than", "greater_than_equal", "less_than_equal",
                             "less_than") and "input" in e:
            msg += f" (got {e['input']!r})"
        already_named = name and (msg.startswith(name + ".") or msg.startswith(name + ":") or
                                  (prefix and msg.startswith(prefix + ".")))
        lines.append(msg if already_named or not name else f"{name}: {msg}")
    return "; ".join(lines)


def _parse(model, cfg, prefix):
    if isinstance(cfg, model):
        return cfg
    if cfg is None:
        cfg = {}
    if hasattr(cfg, "model_dump"):
        cfg = cfg.model_dump()
    try:
        return model.model_validate(dict(cfg))
    except ValidationError as err:
        raise ValueError(format_validation_error(err, prefix)) from None


def parse_policy_loss_config(cfg) -> PolicyLossConfig:
    """Validate a ``loss_fn`` mapping (dict, OmegaConf container or pydantic model)."""
    return _parse(PolicyLossConfig, cfg, "loss_fn")


def parse_advantage_config(cfg) -> AdvantageConfig:
    """Validate a ``grpo.adv_estimator`` mapping."""
    return _parse(AdvantageConfig, cfg, "adv_estimator")
