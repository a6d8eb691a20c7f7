"""The user-facing configuration contract (pydantic); the algorithm presets of docs/algorithms/math.md §8
and the resolved spec are in :mod:`nemo_granular.loss_spec`.

```yaml
loss_fn:                     # NeMo-RL's own keys keep their meaning
  granular:
    algorithm: sspo          # grpo | gspo | gspo_token | sspo | sspo_no_ec | espo | sppo | cispo | reinforce
    granularity: segment     # token | sequence | segment | entropy_group (overrides the preset)
    ratio: shared            # shared | token_decomposed
    surrogate: clipped       # clipped | cispo | reinforce
    segment_delimiters: ["\\n\\n"]
    entropy_top_fraction: 0.2
    clip: sspo_entropy       # fixed | sspo_entropy | espo_entropy
    sspo: {alpha: 0.0, beta: 0.8, gamma: 1.75}
    espo: {alpha: auto, vocab_size: null}   # auto: 3.5e-4·log|V|/H̄₀ from the first rollout
    aggregation: seq_mean_token_mean
    is_level: group_mean     # token | group_sum | group_mean: level of the π_old/π_gen correction
grpo:
  adv_estimator: {name: espo}
```

A preset fills only what the config leaves unset — its ``granular`` fields and the NeMo-RL keys
it implies (``token_level_loss`` through ``aggregation``, ``ratio_clip_min/max`` through ε);
every NeMo-RL key left out otherwise gets NeMo-RL's default, so with the default preset
(``grpo``) an empty config is NeMo-RL's default ``ClippedPGLossConfig``. A NeMo-RL key that
is given keeps NeMo-RL's meaning and wins over the preset; one that contradicts an explicit
``granular`` field is refused. The models hold the config as given (frozen); the effective
values are computed once, at validation, into a frozen :class:`~nemo_granular.loss_spec.PolicyLossSpec`
(what :func:`parse_policy_loss_config` returns). :data:`NEMO_RL_LOSS_KEYS` says, key by key, how each composes
with ``granular`` (docs/nemo-rl.md §3 is rendered from it). Every validation error of the
loss config is a one-line :class:`LossConfigError` naming the field: both a ``ValueError`` and an
``AssertionError``, so code written for NeMo-RL (whose ``ClippedPGLossFn`` refuses with ``assert``)
and code written for us catch it alike.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from .loss_spec import PRESETS, PolicyLossSpec, preset_value, resolve_loss_spec

__all__ = [
    "LossConfigError",
    "PRESETS",
    "NEMO_RL_LOSS_KEYS",
    "NEMO_RL_NEXT_LOSS_KEYS",
    "NEMO_RL_ESTIMATOR_KEYS",
    "SSPOClipConfig",
    "ESPOClipConfig",
    "GranularConfig",
    "PolicyLossConfig",
    "PolicyLossSpec",
    "AdvantageConfig",
    "format_validation_error",
    "parse_policy_loss_config",
    "parse_advantage_config",
    "render_key_table",
]

Algorithm = Literal["grpo", "gspo", "gspo_token", "sspo", "sspo_no_ec", "espo", "sppo", "cispo", "reinforce"]
Granularity = Literal["token", "sequence", "segment", "entropy_group"]
RatioForm = Literal["shared", "token_decomposed"]
ClipKind = Literal["fixed", "sspo_entropy", "espo_entropy"]
Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_group_mean"]
Surrogate = Literal["clipped", "cispo", "reinforce"]
MetricsLevel = Literal["full", "minimal"]


class LossConfigError(ValueError, AssertionError):
    """A refused ``loss_fn`` config: one line naming the key. NeMo-RL's ``ClippedPGLossFn`` refuses
    with ``AssertionError`` (and pydantic's ``ValueError``): this is both, so ``except
    AssertionError`` / ``pytest.raises(AssertionError)`` written for NeMo-RL catch it too."""


ISLevel = Literal["token", "group_sum", "group_mean"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)  # the config as given: never rewritten


class SSPOClipConfig(_Strict):
    """SSPO eq. 13–15: hi = min(1 + α + H̄, γ), lo = max(0, min(1 − H̄, β))."""

    alpha: NonNegativeFloat = 0.0
    beta: Annotated[float, Field(ge=0.0, le=1.0)] = 0.8
    gamma: Annotated[float, Field(ge=1.0)] = 1.75


class ESPOClipConfig(_Strict):
    """ESPO §3.4: ε = α · mean_group(H / log|V|); |V| = vocab_size (null: taken from the model).

    ``alpha: auto`` is the project's rule α = 3.5e-4·log|V|/H̄₀ (docs/algorithms/espo.md), H̄₀
    the mean π_old entropy of the first rollout: the trainers set it from their first π_old pass
    and keep it in the checkpoint."""

    alpha: Union[NonNegativeFloat, Literal["auto"]] = 1.0
    vocab_size: Optional[Annotated[int, Field(ge=2)]] = None


class GranularConfig(_Strict):
    """``loss_fn.granular`` as given. A field left unset (``None``) is ``algorithm``'s preset value
    in the resolved spec (:class:`~nemo_granular.loss_spec.GranularSpec`)."""

    algorithm: Algorithm = "grpo"
    granularity: Optional[Granularity] = None
    ratio: Optional[RatioForm] = None
    surrogate: Optional[Surrogate] = None
    segment_delimiters: list[str] = Field(default_factory=lambda: ["\n\n"])
    entropy_top_fraction: Union[float, list[float]] = 0.2
    clip: Optional[ClipKind] = None
    sspo: SSPOClipConfig = Field(default_factory=SSPOClipConfig)
    espo: ESPOClipConfig = Field(default_factory=ESPOClipConfig)
    aggregation: Optional[Aggregation] = None
    # level of the π_old/π_gen correction (math.md §10); null: token for token groups, else group_mean
    # (NeMo-RL's group_sum under loss_fn.sequence_level_importance_ratios: true)
    is_level: Optional[ISLevel] = None
    # the preset's when the user gives neither this nor loss_fn.ratio_clip_min/max
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
    def _alpha_moves_the_policy(self):
        if preset_value(self, "clip") == "espo_entropy" and self.espo.alpha != "auto" and self.espo.alpha == 0:
            raise ValueError("loss_fn.granular.espo.alpha: 0 freezes the policy (every ratio clipped at 1)")
        return self


class PolicyLossConfig(BaseModel):
    """NeMo-RL's ``ClippedPGLossConfig`` keys (NeMo-RL's defaults and validation), plus ``granular``.

    Extra keys are allowed (NeMo-RL's config carries more). ``None`` on ``token_level_loss`` and
    ``ratio_clip_min/max`` means "left out": the preset decides (for ``grpo``, NeMo-RL's
    default). The config stays as given; validation resolves it once into :attr:`spec` (the
    effective choices, :class:`~nemo_granular.loss_spec.PolicyLossSpec`) and refuses what
    contradicts.
    """

    model_config = ConfigDict(extra="allow", frozen=True)
    _spec: PolicyLossSpec = PrivateAttr()

    disable_ppo_ratio: bool = False
    token_level_loss: Optional[bool] = None
    sequence_level_importance_ratios: bool = False
    ratio_clip_min: Optional[NonNegativeFloat] = None
    ratio_clip_max: Optional[NonNegativeFloat] = None
    ratio_clip_c: Optional[Annotated[float, Field(gt=1.0)]] = None  # dual clip
    reference_policy_kl_penalty: float = 0.01
    reference_policy_kl_type: Literal["k1", "k2", "k3"] = "k3"
    kl_input_clamp_value: Optional[float] = 20.0
    kl_output_clamp_value: Optional[float] = 10.0
    use_kl_in_reward: bool = False
    use_importance_sampling_correction: bool = False
    truncated_importance_sampling_type: Optional[Literal["tis", "icepop", "seq-mask-tis"]] = None
    truncated_importance_sampling_ratio: Optional[float] = None
    truncated_importance_sampling_ratio_min: Optional[float] = None
    use_on_policy_kl_approximation: bool = False
    force_on_policy_ratio: bool = False
    use_cispo: bool = False
    positive_example_nll_weight: float = 0.0
    # NeMo-RL's next ClippedPGLossFn (NVIDIA-NeMo/RL pull request 3751): `minimal` skips the
    # diagnostics that do not feed the objective; `enable_torch_compile` compiles the tensor-only
    # objective lazily on first call (torch.compile, dynamic shapes)
    metrics_level: MetricsLevel = "full"
    enable_torch_compile: bool = False
    granular: GranularConfig = Field(default_factory=GranularConfig)

    # NeMo-RL's refusals keep its sentence verbatim (``pytest.raises(..., match=...)`` written for
    # ClippedPGLossFn matches ours), our detail after it
    @field_validator("ratio_clip_c", mode="before")
    @classmethod
    def _dual_clip_above_one(cls, v):
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not v > 1:
            raise ValueError(
                f"ratio_clip_c must exceed 1 representing a lower bound of the ratios, got {v}. "
                "(NeMo-RL refuses it at its first call)"
            )
        return v

    @field_validator("truncated_importance_sampling_type", mode="before")
    @classmethod
    def _known_truncation(cls, v):
        if v is not None and v not in ("tis", "icepop", "seq-mask-tis"):
            raise ValueError(f"truncated_importance_sampling_type must be 'tis', 'icepop', or 'seq-mask-tis', got {v}")
        return v

    @model_validator(mode="after")
    def _resolve(self):
        self._spec = resolve_loss_spec(self)  # refuses a contradiction (ValueError: one line, naming the keys)
        return self

    @property
    def spec(self) -> PolicyLossSpec:
        """The effective loss (:func:`~nemo_granular.loss_spec.resolve_loss_spec`), resolved once at validation."""
        return self._spec

    @property
    def kl_coef(self) -> float:
        return self._spec.kl_coef

    @property
    def token_level(self) -> bool:
        return self._spec.token_level


class AdvantageConfig(BaseModel):
    """``grpo.adv_estimator`` (NeMo-RL's key names; extra keys allowed)."""

    model_config = ConfigDict(extra="allow")

    name: Literal["grpo", "espo", "sppo"] = "grpo"
    normalize_rewards: bool = True
    use_leave_one_out_baseline: bool = True
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
        if (
            e.get("type")
            in ("literal_error", "enum", "greater_than", "greater_than_equal", "less_than_equal", "less_than")
            and "input" in e
        ):
            msg += f" (got {e['input']!r})"
        already_named = name and (
            msg.startswith(name + ".") or msg.startswith(name + ":") or (prefix and msg.startswith(prefix + "."))
        )
        lines.append(msg if already_named or not name else f"{name}: {msg}")
    return "; ".join(lines)


def _given(cfg) -> dict:
    """The keys a pydantic config was given (NeMo-RL's ``ClippedPGLossConfig`` fills its defaults
    in: a key it holds only by default counts as left out), plus its extra keys."""
    dumped = cfg.model_dump()
    given = set(getattr(cfg, "model_fields_set", dumped)) | set(getattr(cfg, "model_extra", None) or {})
    return {k: v for k, v in dumped.items() if k in given}


def _parse(model, cfg, prefix, error=ValueError):
    if isinstance(cfg, model):
        return cfg
    if cfg is None:
        cfg = {}
    if hasattr(cfg, "model_dump"):
        cfg = _given(cfg)
    try:
        return model.model_validate(dict(cfg))
    except ValidationError as err:
        raise error(format_validation_error(err, prefix)) from None


def parse_policy_loss_config(cfg) -> PolicyLossSpec:
    """Validate a ``loss_fn`` mapping (dict, OmegaConf container or pydantic model) and resolve it:
    the frozen spec the loss runs on (a spec is returned as it is); a refusal raises
    :class:`LossConfigError` (a ``ValueError`` and an ``AssertionError``)."""
    if isinstance(cfg, PolicyLossSpec):
        return cfg
    return _parse(PolicyLossConfig, cfg, "loss_fn", LossConfigError).spec


def parse_advantage_config(cfg) -> AdvantageConfig:
    """Validate a ``grpo.adv_estimator`` mapping."""
    return _parse(AdvantageConfig, cfg, "adv_estimator")


# ---------------------------------------------------------------------------- NeMo-RL's keys
# Every key of NeMo-RL's ClippedPGLossConfig (7ea279ab): (NeMo-RL's type, NeMo-RL's default,
# status, how it composes with `granular`). status "NeMo-RL" = NeMo-RL's meaning, default and
# validation; "refused" = cannot apply to a granular ratio. docs/nemo-rl.md §3 is rendered from
# this table and tests/test_nemo_rl_dropin.py compares it with the real ClippedPGLossConfig.
NEMO_RL_LOSS_KEYS: dict[str, tuple[str, Any, str, str]] = {
    "disable_ppo_ratio": (
        "bool",
        False,
        "NeMo-RL",
        "true: the REINFORCE surrogate A·logp (`surrogate: reinforce`) at any granularity; false "
        "leaves the surrogate to `granular`. Ignored under `force_on_policy_ratio: true` and refused "
        "with `use_cispo: true`, as in NeMo-RL",
    ),
    "token_level_loss": (
        "bool",
        True,
        "NeMo-RL",
        "true: `token_mean`; false: a per-sequence mean (`seq_mean_token_mean`, or "
        "`seq_mean_group_mean` when `granular.aggregation` or the preset says so); the KL term and "
        "the `loss` normaliser follow. Left out: the preset's aggregation decides (grpo: true). "
        "Refused when it contradicts an explicit `granular.aggregation`",
    ),
    "sequence_level_importance_ratios": (
        "bool",
        False,
        "NeMo-RL",
        "true: NeMo-RL's GSPO mode; needs `granularity: sequence` and a per-sequence "
        "loss (refused otherwise). false leaves the ratio's granularity to "
        "`granular.granularity`",
    ),
    "ratio_clip_min": (
        "float",
        0.2,
        "NeMo-RL",
        "ε_low of `fixed` clipping (and of CISPO's weight) at every granularity; left out: the "
        "preset's ε (grpo: 0.2). Not used by the entropy-adaptive clips. Also refused: < 0",
    ),
    "ratio_clip_max": ("float", 0.2, "NeMo-RL", "ε_high, as `ratio_clip_min`"),
    "ratio_clip_c": (
        "float | None",
        None,
        "NeMo-RL",
        "dual clip C for A < 0 on the granular ratio; refused when <= 1 (NeMo-RL: at its first call) and with CISPO",
    ),
    "reference_policy_kl_penalty": ("float", 0.01, "NeMo-RL", "β of the KL term; 0: no reference logprobs needed"),
    "reference_policy_kl_type": (
        "str",
        "k3",
        "NeMo-RL",
        "k1 / k2 / k3; another value is refused when the loss is built (NeMo-RL: at its first call)",
    ),
    "kl_input_clamp_value": ("float | None", 20.0, "NeMo-RL", "as NeMo-RL's `calculate_kl`"),
    "kl_output_clamp_value": ("float | None", 10.0, "NeMo-RL", "as NeMo-RL's `calculate_kl`"),
    "use_kl_in_reward": (
        "bool",
        False,
        "NeMo-RL",
        "true: no KL term in the loss (an estimator that reads it adds KL to the reward; `grpo` "
        "and `espo`, like NeMo-RL's `grpo`, do not)",
    ),
    "use_importance_sampling_correction": (
        "bool",
        False,
        "NeMo-RL",
        "π_old/π_gen weights at `granular.is_level`: per token, or one per group "
        "of the ratio — exp(Σδ) (`group_sum`, NeMo-RL's GSPO convention, the "
        "default under `sequence_level_importance_ratios: true`) or exp(mean δ) "
        "(`group_mean`, the default at every group granularity; math.md §10)",
    ),
    "truncated_importance_sampling_type": (
        "str | None",
        None,
        "NeMo-RL",
        "tis / icepop on those weights (per token or per group), NeMo-RL's "
        "checks; seq-mask-tis masks each group of the ratio (a whole response "
        "for token and sequence groups) whose geometric-mean weight leaves "
        "[min, max]",
    ),
    "truncated_importance_sampling_ratio": (
        "float | None",
        None,
        "NeMo-RL",
        "> 0 when a type is set; set without a type: refused (NeMo-RL: at its first call)",
    ),
    "truncated_importance_sampling_ratio_min": (
        "float | None",
        None,
        "NeMo-RL",
        "<= `truncated_importance_sampling_ratio`; required for icepop and seq-mask-tis; tis: 0 when null",
    ),
    "use_on_policy_kl_approximation": ("bool", False, "NeMo-RL", "as NeMo-RL"),
    "force_on_policy_ratio": (
        "bool",
        False,
        "NeMo-RL",
        "π_old := sg(π_θ): every group ratio is 1 with its gradient; refused with CISPO",
    ),
    "use_cispo": (
        "bool",
        False,
        "NeMo-RL",
        "true: the CISPO surrogate sg(clip(r))·A·logp with NeMo-RL's checks (token-level loss, no "
        "dual clip, no forced ratio, no sequence-level ratios); CISPO at any granularity or "
        "aggregation: `algorithm: cispo`. false leaves the surrogate to `granular`",
    ),
    "positive_example_nll_weight": ("float", 0.0, "NeMo-RL", "VAPO's NLL on correct responses, as NeMo-RL"),
}

# The keys NVIDIA-NeMo/RL pull request 3751 (the rewrite of ClippedPGLossFn) adds to
# ClippedPGLossConfig; NeMo-RL 7ea279ab and v0.7.0 do not declare them (same columns as above)
NEMO_RL_NEXT_LOSS_KEYS: dict[str, tuple[str, Any, str, str]] = {
    "metrics_level": (
        "str",
        "full",
        "NeMo-RL",
        "`full` or `minimal`; minimal drops the diagnostics NeMo-RL's minimal mode drops (the "
        "`probs_ratio*` statistics, π_old-vs-π_gen errors, `approx_entropy`, and "
        "`sampling_importance_ratio` unless the IS correction is on), and so our mismatch "
        "diagnostics (`gen_mismatch_*`, `gen_kl_k3`, `is_oob_*_frac`) unless the correction is on, "
        "and our group and bound diagnostics (`clip_frac_*_groups`, `groups_per_response`, "
        "`group_size_mean`, `clip_bound_*_mean`, `prev_entropy_mean`); `clip_frac_low/high` and "
        "`nonfinite_tokens` stay",
    ),
    "enable_torch_compile": (
        "bool",
        False,
        "NeMo-RL",
        "true: the tensor-only objective (ratios, surrogate, weights, closed-form gradient) "
        "is compiled with `torch.compile` on the first call, as NeMo-RL compiles its actor "
        "objective",
    ),
}

# NeMo-RL's AdvEstimatorConfig keys as our `grpo` / `espo` estimators read them (same columns)
NEMO_RL_ESTIMATOR_KEYS: dict[str, tuple[str, Any, str, str]] = {
    "name": (
        "str",
        "grpo",
        "NeMo-RL",
        "`grpo` and `espo` are ours (grpo: NeMo-RL's estimator's values), `sppo` is refused in run_grpo; "
        "every other name is NeMo-RL's own estimator",
    ),
    "normalize_rewards": ("bool", True, "NeMo-RL", "divide by the group's std (+1e-6) where it is > 0"),
    "use_leave_one_out_baseline": ("bool", True, "NeMo-RL", "RLOO baseline: mean and std of the other responses"),
    "reward_weights": (
        "list[float] | None",
        None,
        "NeMo-RL",
        "GDPO's; not read by `grpo` / `espo` (nor by NeMo-RL's grpo)",
    ),
    "minus_baseline": ("bool", True, "NeMo-RL", "Reinforce++'s; not read by `grpo` / `espo` (nor by NeMo-RL's grpo)"),
}


def render_key_table(keys: dict[str, tuple[str, Any, str, str]], last_column: str = "with `granular`") -> str:
    """The markdown table of docs/nemo-rl.md §3 for ``keys``."""

    def show(v):
        if v is None:
            return "null"
        return str(v).lower() if isinstance(v, bool) else str(v)

    rows = [f"| key | type | NeMo-RL default | status | {last_column} |", "|---|---|---|---|---|"]
    pipe = "\\|"  # a `|` inside a cell
    rows += [
        f"| `{k}` | {t.replace('|', pipe)} | `{show(d)}` | {status} | {note} |"
        for k, (t, d, status, note) in keys.items()
    ]
    return "\n".join(rows)
