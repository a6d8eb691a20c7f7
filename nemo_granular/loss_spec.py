"""The loss config resolved: the algorithm presets of docs/algorithms/math.md §8 and the frozen
spec the loss runs on.

:class:`~nemo_granular.config.PolicyLossConfig` holds the ``loss_fn`` mapping as given (``None``:
left out) and stays as given; :func:`resolve_loss_spec` computes every effective value from it
once — a preset fills what the config leaves out, NeMo-RL's mode keys pick the surrogate, the
aggregation and the ratio's groups — and refuses a contradiction (a ``ValueError``, which the
config's validator turns into its one-line :class:`~nemo_granular.config.LossConfigError`).
Nothing is assigned back: each derived value is computed by one function here.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields, replace
from typing import Any

__all__ = ["PRESETS", "GranularSpec", "PolicyLossSpec", "preset_value", "resolve_loss_spec"]

# docs/algorithms/math.md §8 (ε of `fixed` clipping as (low, high); advantage estimator name)
PRESETS: dict[str, dict[str, Any]] = {
    "grpo": dict(
        granularity="token",
        ratio="shared",
        clip="fixed",
        eps=(0.2, 0.2),
        surrogate="clipped",
        aggregation="token_mean",
        advantage="grpo",
    ),
    "gspo": dict(
        granularity="sequence",
        ratio="shared",
        clip="fixed",
        eps=(3e-4, 4e-4),
        surrogate="clipped",
        aggregation="seq_mean_token_mean",
        advantage="grpo",
    ),
    "gspo_token": dict(
        granularity="sequence",
        ratio="token_decomposed",
        clip="fixed",
        eps=(3e-4, 4e-4),
        surrogate="clipped",
        aggregation="seq_mean_token_mean",
        advantage="grpo",
    ),
    "sspo": dict(
        granularity="segment",
        ratio="shared",
        clip="sspo_entropy",
        eps=(0.2, 0.2),
        surrogate="clipped",
        aggregation="seq_mean_token_mean",
        advantage="grpo",
    ),
    "sspo_no_ec": dict(
        granularity="segment",
        ratio="shared",
        clip="fixed",
        eps=(0.2, 0.2),
        surrogate="clipped",
        aggregation="seq_mean_token_mean",
        advantage="grpo",
    ),
    "espo": dict(
        granularity="entropy_group",
        ratio="token_decomposed",
        clip="espo_entropy",
        eps=(0.2, 0.2),
        surrogate="clipped",
        aggregation="seq_mean_group_mean",
        advantage="espo",
    ),
    "sppo": dict(
        granularity="token",
        ratio="shared",
        clip="fixed",
        eps=(0.2, 0.2),
        surrogate="clipped",
        aggregation="token_mean",
        advantage="sppo",
    ),
    # NeMo-RL's use_cispo / disable_ppo_ratio as presets: at token granularity they ARE those modes
    "cispo": dict(
        granularity="token",
        ratio="shared",
        clip="fixed",
        eps=(0.2, 0.2),
        surrogate="cispo",
        aggregation="token_mean",
        advantage="grpo",
    ),
    "reinforce": dict(
        granularity="token",
        ratio="shared",
        clip="fixed",
        eps=(0.2, 0.2),
        surrogate="reinforce",
        aggregation="token_mean",
        advantage="grpo",
    ),
}


def preset_value(granular, name: str):
    """``granular.<name>`` as given, else ``algorithm``'s preset value (``eps_low`` / ``eps_high``:
    the preset's ε pair)."""
    given = getattr(granular, name)
    if given is not None:
        return given
    preset = PRESETS[granular.algorithm]
    if name in ("eps_low", "eps_high"):
        return preset["eps"][name == "eps_high"]
    return preset[name]


@dataclass(frozen=True)
class GranularSpec:
    """``loss_fn.granular`` resolved: every choice effective (docs/algorithms/math.md §2–§5, §10)."""

    algorithm: str
    granularity: str  # token | sequence | segment | entropy_group
    ratio: str  # shared | token_decomposed
    surrogate: str  # clipped | cispo | reinforce
    segment_delimiters: tuple[str, ...]
    entropy_top_fraction: float | tuple[float, ...]
    clip: str  # fixed | sspo_entropy | espo_entropy
    sspo: Any  # SSPOClipConfig (frozen)
    espo: Any  # ESPOClipConfig (frozen); alpha "auto" until calibrated
    aggregation: str  # token_mean | seq_mean_token_mean | seq_mean_group_mean
    is_level: str  # token | group_sum | group_mean: level of the π_old/π_gen weight
    eps_low: float  # ε of `fixed` clipping from `granular` (or the preset)
    eps_high: float

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

    def model_dump(self) -> dict[str, Any]:
        """The ``granular`` mapping with every field given (it resolves to this spec again)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out.update(
            segment_delimiters=list(self.segment_delimiters), sspo=self.sspo.model_dump(), espo=self.espo.model_dump()
        )
        if isinstance(self.entropy_top_fraction, tuple):
            out["entropy_top_fraction"] = list(self.entropy_top_fraction)
        return out


@dataclass(frozen=True)
class PolicyLossSpec:
    """``loss_fn`` resolved once (:func:`resolve_loss_spec`): NeMo-RL's keys as given (or NeMo-RL's
    defaults) and :class:`GranularSpec`; the effective ε, β and loss level are computed from them."""

    granular: GranularSpec
    disable_ppo_ratio: bool
    token_level_loss: bool | None  # as given; None: the aggregation decides (token_level)
    sequence_level_importance_ratios: bool
    ratio_clip_min: float | None
    ratio_clip_max: float | None
    ratio_clip_c: float | None
    reference_policy_kl_penalty: float
    reference_policy_kl_type: str
    kl_input_clamp_value: float | None
    kl_output_clamp_value: float | None
    use_kl_in_reward: bool
    use_importance_sampling_correction: bool
    truncated_importance_sampling_type: str | None
    truncated_importance_sampling_ratio: float | None
    truncated_importance_sampling_ratio_min: float | None
    use_on_policy_kl_approximation: bool
    force_on_policy_ratio: bool
    use_cispo: bool
    positive_example_nll_weight: float
    metrics_level: str
    enable_torch_compile: bool

    @property
    def eps_low(self) -> float:
        """ε_low of `fixed` clipping: ``ratio_clip_min`` when given, else ``granular``'s."""
        return self.ratio_clip_min if self.ratio_clip_min is not None else self.granular.eps_low

    @property
    def eps_high(self) -> float:
        return self.ratio_clip_max if self.ratio_clip_max is not None else self.granular.eps_high

    @property
    def kl_coef(self) -> float:
        """β of the loss's KL term: 0 when the KL goes into the reward."""
        return 0.0 if self.use_kl_in_reward else self.reference_policy_kl_penalty

    @property
    def token_level(self) -> bool:
        """NeMo-RL's ``LossType.TOKEN_LEVEL``: the objective is a token mean."""
        return self.granular.aggregation == "token_mean"

    def with_espo_alpha(self, alpha: float) -> PolicyLossSpec:
        """This spec with ESPO's α set (``alpha: auto`` calibrated, or restored on resume), validated as
        ``loss_fn.granular.espo.alpha``."""
        espo = self.granular.espo
        espo = type(espo).model_validate({**espo.model_dump(), "alpha": float(alpha)})
        return replace(self, granular=replace(self.granular, espo=espo))

    def nemo_rl_view(self) -> dict[str, Any]:
        """The effective value of every NeMo-RL key (what ``ClippedPGLossConfig`` would hold)."""
        out = {k: getattr(self, k) for k in _NEMO_RL_FIELDS if k not in NEMO_RL_NEXT_FIELDS}
        g = self.granular
        out.update(
            token_level_loss=self.token_level,
            ratio_clip_min=self.eps_low,
            ratio_clip_max=self.eps_high,
            use_cispo=g.surrogate == "cispo",
            disable_ppo_ratio=g.surrogate == "reinforce",
            sequence_level_importance_ratios=self.sequence_level_importance_ratios,
        )
        return out

    def model_dump(self) -> dict[str, Any]:
        """The ``loss_fn`` mapping that resolves to this spec again, silently (``granular`` with every
        field given; NeMo-RL's keys as given)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "granular"}
        out["granular"] = self.granular.model_dump()
        return out


# NeMo-RL's loss keys (config.NEMO_RL_LOSS_KEYS) and those of its next ClippedPGLossFn (NEMO_RL_NEXT_LOSS_KEYS)
_NEMO_RL_FIELDS = tuple(f.name for f in fields(PolicyLossSpec) if f.name != "granular")
NEMO_RL_NEXT_FIELDS = ("metrics_level", "enable_torch_compile")


def resolve_loss_spec(cfg) -> PolicyLossSpec:
    """The effective loss of a validated ``PolicyLossConfig`` ``cfg``, with NeMo-RL's checks in
    NeMo-RL's order; a contradiction raises ``ValueError`` naming the keys."""
    g = cfg.granular
    aggregation = _aggregation(cfg)
    surrogate = _surrogate(cfg, aggregation)
    granularity = _granularity(cfg, aggregation)
    _check_truncated_is(cfg)
    granular = GranularSpec(
        algorithm=g.algorithm,
        granularity=granularity,
        ratio=preset_value(g, "ratio"),
        surrogate=surrogate,
        segment_delimiters=tuple(g.segment_delimiters),
        entropy_top_fraction=(
            g.entropy_top_fraction
            if isinstance(g.entropy_top_fraction, (int, float))
            else tuple(g.entropy_top_fraction)
        ),
        clip=preset_value(g, "clip"),
        sspo=g.sspo,
        espo=g.espo,
        aggregation=aggregation,
        is_level=_is_level(cfg, granularity),
        eps_low=preset_value(g, "eps_low"),
        eps_high=preset_value(g, "eps_high"),
    )
    return PolicyLossSpec(granular=granular, **{k: getattr(cfg, k) for k in _NEMO_RL_FIELDS})


def _aggregation(cfg) -> str:
    """``token_level_loss`` (given) picks NeMo-RL's level; the per-sequence form comes from
    ``granular.aggregation`` or the preset (docs/algorithms/math.md §5, Decision)."""
    g, level = cfg.granular, cfg.token_level_loss
    if level is None:
        return preset_value(g, "aggregation")
    if "aggregation" in g.model_fields_set:
        if (g.aggregation == "token_mean") != level:
            raise ValueError(
                f"loss_fn.token_level_loss: {str(level).lower()} contradicts granular.aggregation "
                f"{g.aggregation!r}; drop one of the two"
            )
        return g.aggregation
    preset = PRESETS[g.algorithm]["aggregation"]
    if level:
        agg = "token_mean"
    else:
        agg = preset if preset != "token_mean" else "seq_mean_token_mean"
    if (preset == "token_mean") != level and "algorithm" in g.model_fields_set:
        # NeMo-RL's example configs set token_level_loss: true; say so when it overrides a preset
        warnings.warn(
            f"loss_fn.token_level_loss: {str(level).lower()} overrides algorithm {g.algorithm!r}'s "
            f"aggregation {preset!r} (now {agg!r}); set token_level_loss: {str(not level).lower()} "
            "to keep the preset's",
            stacklevel=2,
        )
    return agg


def _surrogate(cfg, aggregation: str) -> str:
    """``use_cispo`` / ``disable_ppo_ratio`` set to true pick NeMo-RL's CISPO / REINFORCE
    surrogate (false, NeMo-RL's default, leaves it to ``granular``), with NeMo-RL's checks."""
    g = cfg.granular
    if cfg.use_cispo and cfg.disable_ppo_ratio:
        raise ValueError(
            "use_cispo is incompatible with disable_ppo_ratio; CISPO needs the pi_theta/pi_theta_old "
            "ratio but disable_ppo_ratio removes it (loss_fn.use_cispo: true, "
            "disable_ppo_ratio: true)"
        )
    wanted = None
    if cfg.use_cispo:
        wanted = "cispo"
    elif cfg.disable_ppo_ratio:
        # NeMo-RL checks force_on_policy_ratio first: the forced ratio wins
        wanted = "clipped" if cfg.force_on_policy_ratio else "reinforce"
    if wanted is not None and "surrogate" in g.model_fields_set and g.surrogate != wanted:
        key = "use_cispo" if cfg.use_cispo else "disable_ppo_ratio"
        raise ValueError(f"loss_fn.{key}: true contradicts granular.surrogate {g.surrogate!r}; drop one of the two")
    surrogate = wanted or preset_value(g, "surrogate")
    if cfg.force_on_policy_ratio and surrogate == "reinforce":  # the preset's (or granular's): as above
        surrogate = "clipped"
    if surrogate == "cispo":
        _check_cispo(cfg, aggregation)
    return surrogate


def _check_cispo(cfg, aggregation: str) -> None:
    """NeMo-RL's refusals of ``use_cispo`` (its sentence first when it is NeMo-RL's key)."""
    key = "loss_fn.use_cispo: true" if cfg.use_cispo else "loss_fn.granular.surrogate 'cispo'"

    def refuse(nemo: str, ours: str):
        raise ValueError(f"{nemo} ({key}: {ours})" if cfg.use_cispo else f"{key}: {ours}")

    if cfg.force_on_policy_ratio:
        refuse(
            "use_cispo is incompatible with force_on_policy_ratio; forcing ratio=1 removes the clipped "
            "IS-weight that CISPO optimizes",
            "incompatible with force_on_policy_ratio, as in NeMo-RL",
        )
    if cfg.sequence_level_importance_ratios:
        refuse(
            "use_cispo is incompatible with sequence_level_importance_ratios; CISPO uses token-level "
            "importance weights",
            "incompatible with sequence_level_importance_ratios; for CISPO on "
            "sequence ratios use granular.granularity: sequence",
        )
    if cfg.ratio_clip_c is not None:
        refuse(
            "use_cispo is incompatible with dual clipping (ratio_clip_c); the dual-clip block runs after the "
            "CISPO loss assembly and would silently overwrite it. Set ratio_clip_c=null when use_cispo=True.",
            "incompatible with dual clipping; set ratio_clip_c: null, as NeMo-RL requires",
        )
    if cfg.use_cispo and aggregation != "token_mean":
        refuse(
            "use_cispo requires token_level_loss=True (LossType.TOKEN_LEVEL).",
            "needs token_level_loss: true, as in NeMo-RL (CISPO with a per-sequence mean: "
            "granular.algorithm: cispo with token_level_loss: false)",
        )


def _granularity(cfg, aggregation: str) -> str:
    """The ratio's groups; ``sequence_level_importance_ratios: true`` is NeMo-RL's GSPO mode: sequence
    groups when ``granular`` chooses none, refused with other groups or a token-level loss."""
    g = cfg.granular
    if not cfg.sequence_level_importance_ratios:
        return preset_value(g, "granularity")
    granularity = preset_value(g, "granularity") if {"granularity", "algorithm"} & g.model_fields_set else "sequence"
    if granularity != "sequence":
        raise ValueError(
            "loss_fn.sequence_level_importance_ratios: true conflicts with "
            f"granular.granularity={granularity!r} (use algorithm: gspo, or set it false)"
        )
    if aggregation == "token_mean":
        raise ValueError(
            "sequence-level importance sampling (e.g. GSPO) is mutually exclusive with "
            "token-level loss (loss_fn.sequence_level_importance_ratios: true needs a "
            "per-sequence loss, token_level_loss: false)"
        )
    return granularity


def _is_level(cfg, granularity: str) -> str:
    """The level of the π_old/π_gen weight (math.md §10): as given, else NeMo-RL's GSPO-mode weight
    (``group_sum``, one per response) under ``sequence_level_importance_ratios: true``, else ``token``
    for token groups and the geometric mean (``group_mean``) at every group granularity (Decision)."""
    given = cfg.granular.is_level
    if given is not None:
        return given
    if cfg.sequence_level_importance_ratios:
        return "group_sum"
    return "token" if granularity == "token" else "group_mean"


def _check_truncated_is(cfg) -> None:
    """NeMo-RL's checks of ``ClippedPGLossFn.__init__`` (and of its first call), in its order."""
    kind, hi = cfg.truncated_importance_sampling_type, cfg.truncated_importance_sampling_ratio
    lo = cfg.truncated_importance_sampling_ratio_min
    if kind is None:
        if hi is not None:
            raise ValueError(
                "Invalid truncated importance sampling type: None (loss_fn.truncated_importance_"
                "sampling_ratio is set but truncated_importance_sampling_type is null; NeMo-RL "
                "refuses it at its first call)"
            )
        return
    if not cfg.use_importance_sampling_correction:
        raise ValueError(
            "truncated importance sampling is only supported when use_importance_sampling_correction "
            f"is True (loss_fn.truncated_importance_sampling_type: {kind} needs "
            "use_importance_sampling_correction: true)"
        )
    if hi is None or hi <= 0:
        raise ValueError(
            f"truncated_importance_sampling_ratio should be positive (loss_fn.truncated_importance_"
            f"sampling_ratio: got {hi!r})"
        )
    if lo is not None and lo > hi:
        raise ValueError(
            "truncated_importance_sampling_ratio_min must be <= truncated_importance_sampling_ratio "
            f"(loss_fn: truncated_importance_sampling_ratio_min {lo} > "
            f"truncated_importance_sampling_ratio {hi})"
        )
    if kind in ("icepop", "seq-mask-tis") and lo is None:
        raise ValueError(
            "truncated_importance_sampling_ratio_min should be set when truncated_importance_"
            f"sampling_type is 'icepop' or 'seq-mask-tis' (loss_fn: it is {kind})"
        )
    if kind == "seq-mask-tis" and cfg.sequence_level_importance_ratios:
        raise ValueError(
            "seq-mask-tis uses token-level IS correction with sequence-level masking, and is "
            "incompatible with sequence_level_importance_ratios=True (loss_fn."
            "truncated_importance_sampling_type: seq-mask-tis, sequence_level_importance_ratios: "
            "true)"
        )
