"""NeMo-RL loss objects: the granular policy loss and the SPPO critic loss.

Both follow NeMo-RL's ``LossFunction`` protocol (``nemo_rl/algorithms/loss/interfaces.py``):
``loss_fn(data=..., global_valid_seqs=..., global_valid_toks=..., next_token_logprobs=...)``
returns ``(loss, metrics)``; per-token data keys are ``[B, S]`` and used as ``[:, 1:]``
against ``next_token_logprobs`` ``[B, S-1]``; every cross-row denominator is a global count,
so the partial results of microbatches (or of single-sequence calls under sequence
packing) add up to the global-batch value. No collective is ever called.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .config import PolicyLossConfig, parse_policy_loss_config
from .core.advantages import first_response_index, sppo_critic_bce
from .core.aggregation import safe_divide, seq_mean_token_mean
from .core.clipping import clipped_surrogate, espo_entropy_clip_bounds, sspo_entropy_clip_bounds
from .core.groups import build_delimiter_table, group_ids_for
from .core.ratios import GroupIndex
from .protocol import LossInputType, LossType, MetricNormalizer

__all__ = ["GranularPolicyLoss", "SequenceValueLoss", "kl_penalty_per_token", "LOG_RATIO_BOUND"]

# exp() is applied to log-ratios clamped to ±LOG_RATIO_BOUND (ratio ≤ 4.8e8): an extreme
# token then cannot turn a zero gradient into inf·0 = NaN. Exact below the bound.
LOG_RATIO_BOUND = 20.0

_TOKEN_METRICS = (
    "probs_ratio", "probs_ratio_clamped", "token_mult_prob_error", "gen_kl_error", "policy_kl_error",
    "js_divergence_error", "approx_entropy", "clip_frac_low", "clip_frac_high", "clip_bound_low_mean",
    "clip_bound_high_mean", "prev_entropy_mean", "nonfinite_token_frac",
)
_SEQ_METRICS = ("clip_frac_low_groups", "clip_frac_high_groups", "groups_per_response", "group_size_mean")
_RAW_METRICS = ("num_valid_samples", "nonfinite_tokens", "positive_nll_loss",
                "probs_ratio_min", "probs_ratio_max", "probs_ratio_clamped_min", "probs_ratio_clamped_max")


def _key(data: Mapping, name: str, like: torch.Tensor, shift: bool = True) -> torch.Tensor:
    """``data[name][:, 1:]`` checked against ``like``'s shape (the shift convention)."""
    if name not in data:
        raise KeyError(f"data['{name}'] is missing (required by the granular loss)")
    x = data[name]
    if hasattr(x, "full_tensor"):
        raise ValueError(f"data['{name}'] is a DTensor (DTensor context parallelism): precompute "
                         "'granular_group_ids' on the driver instead of reading it in the loss")
    x = x[:, 1:] if shift else x
    if tuple(x.shape) != tuple(like.shape):
        raise ValueError(f"data['{name}'][:, 1:] has shape {tuple(x.shape)} but next_token_logprobs has "
                         f"shape {tuple(like.shape)}")
    return x.to(like.device)


def kl_penalty_per_token(logp, logp_ref, kl_type="k3", input_clamp=20.0, output_clamp=10.0, weights=None):
    """Per-token KL(π_θ‖π_ref) estimator k1/k2/k3 (Schulman 2020), as NeMo-RL's ``calculate_kl``.

    With ``logr = logp_ref − logp``: k1 = −logr, k2 = logr²/2, k3 = exp(logr) − 1 − logr;
    optional input/output clamping; ``weights`` multiply before the output clamp (detached
    where the input clamp is active).
    """
    logr = logp_ref - logp
    if input_clamp is not None:
        clamped = logr.clamp(-input_clamp, input_clamp)
        if weights is not None:
            weights = torch.where(logr == clamped, weights, weights.detach())
        logr = clamped
    if kl_type == "k1":
        kl = -logr
    elif kl_type == "k2":
        kl = logr.square() / 2
    elif kl_type == "k3":
        kl = torch.exp(logr) - 1 - logr
    else:
        raise ValueError(f"loss_fn.reference_policy_kl_type: unknown value {kl_type!r}")
    if weights is not None:
        kl = weights * kl
    if output_clamp is not None:
        kl = kl.clamp(-output_clamp, output_clamp)
    return kl


class GranularPolicyLoss:
    """Clipped policy-gradient loss with granular importance ratios (spec §1–§5).

    loss = −Agg_i,t[ min(r_it·A_it, clip(r_it, lo_ig, hi_ig)·A_it) ] + β·KL

    r_it = exp(mean_{u∈g(i,t)} (logp_iu − logq_iu)) per token group g (token: GRPO;
    sequence: GSPO; segment: SSPO; entropy group: ESPO), in the `shared` or
    `token_decomposed` form; [lo, hi] fixed or entropy-adaptive per group; Agg one of
    token_mean / seq_mean_token_mean / seq_mean_group_mean (global normalisation).

    Batch keys: NeMo-RL's ``token_mask``, ``sample_mask``, ``advantages``, ``prev_logprobs``,
    ``generation_logprobs``, ``reference_policy_logprobs`` (when KL ≠ 0), plus ours:
    ``prev_entropy`` (π_old full-vocabulary entropy, ``[B, S]``, same shift) and
    ``granular_group_ids`` (int64 ``[B, S]``, −1 outside the response). Group ids are computed
    here when absent (segment: from ``input_ids`` and the delimiter table; entropy_group:
    from ``prev_entropy``).

    Config: ``loss_fn`` with ``granular:`` (see :mod:`nemo_granular.config`).
    """

    input_type = LossInputType.LOGPROB

    def __init__(self, cfg, use_fused_linear_logprobs: bool = False, *, tokenizer=None,
                 delimiter_table: torch.Tensor | None = None, vocab_size: int | None = None):
        self.cfg: PolicyLossConfig = parse_policy_loss_config(cfg)
        self.granular = self.cfg.granular
        self.use_fused_linear_logprobs = use_fused_linear_logprobs
        self.reference_policy_kl_penalty = self.cfg.kl_coef
        self.loss_type = LossType.TOKEN_LEVEL if self.granular.aggregation == "token_mean" else LossType.SEQUENCE_LEVEL
        self.vocab_size = self.granular.espo.vocab_size or vocab_size
        self.delimiter_table = delimiter_table.bool().cpu() if delimiter_table is not None else None
        if tokenizer is not None and self.delimiter_table is None and self.granular.granularity == "segment":
            self.set_tokenizer(tokenizer, vocab_size)
        grad_norm = MetricNormalizer.TOKENS if self.loss_type == LossType.TOKEN_LEVEL else MetricNormalizer.SEQUENCES
        self.metric_normalizations = {"loss": grad_norm, "kl_penalty": grad_norm}
        self.metric_normalizations.update({k: MetricNormalizer.TOKENS for k in _TOKEN_METRICS})
        self.metric_normalizations.update({k: MetricNormalizer.SEQUENCES for k in _SEQ_METRICS})
        self.metric_normalizations.update({k: MetricNormalizer.NONE for k in _RAW_METRICS})
        self.metric_normalizations["sampling_importance_ratio"] = (
            MetricNormalizer.SEQUENCES if self.granular.granularity == "sequence" else MetricNormalizer.TOKENS)
        if self.cfg.truncated_importance_sampling_type is not None:
            self.metric_normalizations["is_oob_ratio"] = (
                MetricNormalizer.SEQUENCES if self.cfg.truncated_importance_sampling_type == "seq-mask-tis"
                else MetricNormalizer.TOKENS)

    def set_tokenizer(self, tokenizer, vocab_size: int | None = None) -> None:
        """Build the delimiter lookup table (segment granularity) once from ``tokenizer``."""
        self.delimiter_table = build_delimiter_table(tokenizer, self.granular.segment_delimiters, vocab_size)

    # ------------------------------------------------------------------ helpers
    def _group_ids(self, data, token_mask, entropy, like):
        g = self.granular
        if "granular_group_ids" in data:
            ids = _key(data, "granular_group_ids", like).long()
            if ids.numel() and int(ids.max()) >= like.shape[1]:
                raise ValueError(f"data['granular_group_ids'] holds id {int(ids.max())} >= {like.shape[1]} "
                                 "(ids must be per-row local, 0..G-1)")
            return ids
        if g.granularity == "segment":
            if self.delimiter_table is None:
                raise ValueError("granular.granularity 'segment' needs a tokenizer (GranularPolicyLoss(..., "
                                 "tokenizer=...)) or precomputed data['granular_group_ids']")
            return group_ids_for("segment", token_mask, token_ids=_key(data, "input_ids", like),
                                 delimiter_table=self.delimiter_table)
        return group_ids_for(g.granularity, token_mask, entropy=entropy,
                             entropy_cut_points=g.entropy_cut_points)

    def _bounds(self, entropy_per_unit, like):
        """[lo, hi] per token (token granularity) or per group, from the unit's mean π_old entropy."""
        g = self.granular
        if g.clip == "fixed":  # scalars: clamp broadcasts them without materialising [B, T] tensors
            return 1.0 - self.cfg.eps_low, 1.0 + self.cfg.eps_high
        if g.clip == "sspo_entropy":
            return sspo_entropy_clip_bounds(entropy_per_unit, g.sspo.alpha, g.sspo.beta, g.sspo.gamma)
        if self.vocab_size is None:
            raise ValueError("loss_fn.granular.espo.vocab_size is unset and no model vocabulary size was given")
        return espo_entropy_clip_bounds(entropy_per_unit, g.espo.alpha, self.vocab_size)

    # ------------------------------------------------------------------ main
    def __call__(self, next_token_logprobs: torch.Tensor, data: Mapping, global_valid_seqs,
                 global_valid_toks, **kwargs) -> tuple[torch.Tensor, dict]:
        cfg, g = self.cfg, self.granular
        logp_raw = next_token_logprobs.float()
        if logp_raw.dim() != 2:
            raise ValueError(f"next_token_logprobs must be [B, S-1], got shape {tuple(logp_raw.shape)}")
        dev = logp_raw.device
        token_mask = _key(data, "token_mask", logp_raw) > 0
        sample_mask = data["sample_mask"].to(dev).float().reshape(-1)
        if sample_mask.shape[0] != logp_raw.shape[0]:
            raise ValueError(f"data['sample_mask'] has shape {tuple(data['sample_mask'].shape)} but "
                             f"next_token_logprobs has {logp_raw.shape[0]} rows")
        adv_raw = _key(data, "advantages", logp_raw).float()
        prev_raw = logp_raw.detach() if cfg.force_on_policy_ratio else _key(data, "prev_logprobs", logp_raw).float()
        gen_raw = _key(data, "generation_logprobs", logp_raw).float() if "generation_logprobs" in data else prev_raw
        ent_raw = _key(data, "prev_entropy", logp_raw).float() if "prev_entropy" in data else None
        if g.needs_entropy and ent_raw is None:
            raise KeyError(f"data['prev_entropy'] is missing: algorithm {g.algorithm!r} (clip={g.clip}, "
                           f"granularity={g.granularity}) needs the π_old entropy")

        # NaN/inf tokens are excluded (and counted); everything below sees finite values only
        finite = torch.isfinite(logp_raw) & torch.isfinite(prev_raw) & torch.isfinite(adv_raw)
        if cfg.use_importance_sampling_correction:
            finite &= torch.isfinite(gen_raw)
        if ent_raw is not None and g.needs_entropy:
            finite &= torch.isfinite(ent_raw)
        row_on = sample_mask != 0
        valid = token_mask & finite
        zero = torch.zeros((), device=dev)
        logp = torch.where(valid, logp_raw, zero)
        prev = torch.where(valid, prev_raw, zero)
        adv = torch.where(valid, adv_raw, zero)
        gen = torch.where(valid & torch.isfinite(gen_raw), gen_raw, prev)
        ent = torch.where(valid & torch.isfinite(ent_raw), ent_raw, zero) if ent_raw is not None else None
        valid_f = valid.float()
        tok_w = valid_f * sample_mask[:, None]  # NeMo-RL's token_mask * sample_mask

        log_ratio = logp - prev
        per_token = g.granularity == "token"
        index = counts = None
        if per_token:  # GRPO fast path: every token is its own group, no scatter needed
            ratio = torch.exp(log_ratio.clamp(max=LOG_RATIO_BOUND))
            lo, hi = self._bounds(ent, log_ratio)
            n_groups_row = valid_f.sum(-1)
        else:
            group_ids = self._group_ids(data, token_mask, None if ent_raw is None else
                                        torch.where(valid, ent_raw, torch.nan), log_ratio)
            G = log_ratio.shape[1] if "granular_group_ids" in data else \
                {"sequence": 1, "entropy_group": len(g.entropy_cut_points) + 1}.get(g.granularity, log_ratio.shape[1])
            index = GroupIndex(group_ids, max(G, 1), valid)  # the scatter plan, shared by every group statistic
            counts = index.sum(valid_f)
            group_lr = (index.sum(log_ratio) / counts.clamp(min=1)).clamp(max=LOG_RATIO_BOUND)
            if g.ratio == "shared":  # GSPO eq. 6 / SSPO eq. 9: gradient through the group mean
                ratio = torch.exp(index.gather(group_lr))
            else:  # token_decomposed (GSPO-token / ESPO): value s_g, gradient via the token's own logprob
                ratio = torch.exp(index.gather(group_lr.detach())) * torch.exp(logp - logp.detach())
            if g.clip == "fixed":
                lo, hi = self._bounds(None, None)
            else:
                lo_g, hi_g = self._bounds(index.sum(ent) / counts.clamp(min=1), None)
                lo, hi = index.gather(lo_g), index.gather(hi_g)
            n_groups_row = (counts > 0).sum(-1).float()

        surrogate, clipped_low, clipped_high = clipped_surrogate(ratio, adv, lo, hi, cfg.ratio_clip_c)
        metrics: dict[str, torch.Tensor] = {}

        # off-policy correction π_old/π_gen (NeMo-RL's options; one weight per group for group ratios)
        is_weight = None
        if cfg.use_importance_sampling_correction:
            is_weight = self._importance_weights(prev, gen, valid, index, sample_mask, global_valid_toks,
                                                 global_valid_seqs, metrics)
            surrogate = surrogate * is_weight

        if g.aggregation == "token_mean":
            objective = safe_divide((surrogate * tok_w).sum(), global_valid_toks)
        elif g.aggregation == "seq_mean_token_mean" or per_token:  # token groups: the two means coincide
            objective = seq_mean_token_mean(surrogate, valid, sample_mask, global_valid_seqs)
        else:
            per_group = index.sum(surrogate) / counts.clamp(min=1)
            per_row = per_group.sum(-1) / n_groups_row.clamp(min=1)  # empty groups add 0
            objective = safe_divide((per_row * sample_mask).sum(), global_valid_seqs)
        loss = -objective

        kl = zero
        if self.reference_policy_kl_penalty != 0:
            kl = self._kl(data, logp_raw, logp, gen, valid, sample_mask, tok_w, global_valid_toks, global_valid_seqs)
            loss = loss + kl
        nll = zero
        if cfg.positive_example_nll_weight > 0 and "rewards" in data:
            correct = tok_w * (data["rewards"].to(dev).float() > 0).float()[:, None]
            nll = -(logp * correct).sum() / correct.sum().clamp(min=1)
            loss = loss + cfg.positive_example_nll_weight * nll

        with torch.no_grad():
            self._metrics(metrics, loss, kl, nll, ratio, lo, hi, clipped_low, clipped_high, valid, token_mask,
                          row_on, sample_mask, tok_w, prev, gen, logp, ent, index, counts, n_groups_row,
                          is_weight, global_valid_toks, global_valid_seqs)
            names = list(metrics)
            values = torch.stack([metrics[k].float().reshape(()).to(dev) for k in names]).tolist()  # one sync
        return loss, dict(zip(names, values))

    # ------------------------------------------------------------------ pieces
    def _importance_weights(self, prev, gen, valid, index, sample_mask, global_valid_toks, global_valid_seqs,
                            metrics):
        cfg = self.cfg
        diff = (prev - gen).detach()
        if index is None:
            w = torch.exp(diff.clamp(max=LOG_RATIO_BOUND))
        else:  # one weight per group: exp(Σ_group (logq − log π_gen)), NeMo-RL's GSPO convention
            w = torch.exp(index.gather(index.sum(diff)).clamp(max=LOG_RATIO_BOUND))
        w = torch.nan_to_num(w, nan=0.0, posinf=0.0, neginf=0.0)
        kind, hi, lo = (cfg.truncated_importance_sampling_type, cfg.truncated_importance_sampling_ratio,
                        cfg.truncated_importance_sampling_ratio_min)
        tok_w = valid.float() * sample_mask[:, None]
        if kind == "tis":
            lo = 0.0 if lo is None else lo
            metrics["is_oob_ratio"] = safe_divide((((w > hi) | (w < lo)).float() * tok_w).sum(), global_valid_toks)
            w = w.clamp(lo, hi)
        elif kind == "icepop":
            keep = (w >= lo) & (w <= hi)
            metrics["is_oob_ratio"] = safe_divide(((~keep).float() * tok_w).sum(), global_valid_toks)
            w = torch.where(keep, w, torch.zeros_like(w))
        elif kind == "seq-mask-tis":
            n = valid.sum(-1).clamp(min=1)
            geo = torch.exp(torch.where(valid, diff, 0.0).sum(-1) / n)
            keep = ((geo >= lo) & (geo <= hi)).float()
            metrics["is_oob_ratio"] = safe_divide(((1 - keep) * sample_mask).sum(), global_valid_seqs)
            w = w * keep[:, None]
        return w

    def _kl(self, data, logp_raw, logp, gen, valid, sample_mask, tok_w, global_valid_toks, global_valid_seqs):
        cfg = self.cfg
        ref = torch.where(valid, _key(data, "reference_policy_logprobs", logp_raw).float(), 0.0)
        curr = data.get("curr_logprobs_unfiltered", None)
        curr = logp if curr is None else torch.where(valid, curr.float(), 0.0)
        if cfg.use_on_policy_kl_approximation:
            w = torch.exp((curr - gen).clamp(max=LOG_RATIO_BOUND))
        else:
            w = torch.exp(curr - curr.detach())
        w = torch.nan_to_num(w, nan=0.0, posinf=0.0, neginf=0.0)
        kl = self.reference_policy_kl_penalty * kl_penalty_per_token(
            curr, ref, cfg.reference_policy_kl_type, cfg.kl_input_clamp_value, cfg.kl_output_clamp_value, w)
        if self.loss_type == LossType.TOKEN_LEVEL:
            return safe_divide((kl * tok_w).sum(), global_valid_toks)
        return seq_mean_token_mean(kl, valid, sample_mask, global_valid_seqs)

    def _metrics(self, m, loss, kl, nll, ratio, lo, hi, clipped_low, clipped_high, valid, token_mask, row_on,
                 sample_mask, tok_w, prev, gen, logp, ent, index, counts, n_groups_row, is_weight,
                 global_valid_toks, global_valid_seqs):
        n_tok = tok_w.sum()

        def tok(x):
            if not torch.is_tensor(x) or x.dim() == 0:  # a constant (fixed clip bound)
                return safe_divide(n_tok * float(x), global_valid_toks)
            return safe_divide((x.float() * tok_w).sum(), global_valid_toks)

        def seq(x_row):
            return safe_divide((x_row.float() * sample_mask).sum(), global_valid_seqs)

        r = ratio.detach()
        r_clamped = torch.clamp(r, lo, hi)
        live = valid & row_on[:, None]
        inf = torch.tensor(float("inf"), device=r.device)
        m["loss"] = loss.detach()
        m["num_valid_samples"] = sample_mask.sum()
        m["probs_ratio"] = tok(r)
        m["probs_ratio_clamped"] = tok(r_clamped)
        m["probs_ratio_min"] = torch.where(live, r, inf).min() if r.numel() else inf
        m["probs_ratio_max"] = torch.where(live, r, -inf).max() if r.numel() else -inf
        m["probs_ratio_clamped_min"] = torch.where(live, r_clamped, inf).min() if r.numel() else inf
        m["probs_ratio_clamped_max"] = torch.where(live, r_clamped, -inf).max() if r.numel() else -inf
        coef = self.reference_policy_kl_penalty
        m["kl_penalty"] = kl.detach() / coef if coef else torch.zeros((), device=r.device)
        diff = prev - gen
        m["token_mult_prob_error"] = tok(torch.exp(diff.abs()))
        m["gen_kl_error"] = tok(kl_penalty_per_token(gen, prev, self.cfg.reference_policy_kl_type, None, None))
        m["policy_kl_error"] = tok(kl_penalty_per_token(prev, gen, self.cfg.reference_policy_kl_type, None, None))
        log_mix = torch.log(0.5 * torch.exp(prev) + 0.5 * torch.exp(gen))
        js = 0.5 * (torch.exp(prev - log_mix) - (prev - log_mix) - 1) + 0.5 * (torch.exp(gen - log_mix) - (gen - log_mix) - 1)
        m["js_divergence_error"] = tok(js)
        if self.granular.granularity == "sequence":  # one weight per response
            w_row = torch.exp(torch.where(valid, diff, 0.0).sum(-1).clamp(max=LOG_RATIO_BOUND))
            if is_weight is not None:
                w_row = torch.where(valid, is_weight, 0.0).amax(-1)
            m["sampling_importance_ratio"] = seq(w_row)
        else:
            m["sampling_importance_ratio"] = tok(is_weight if is_weight is not None else
                                                 torch.exp(diff.clamp(max=LOG_RATIO_BOUND)))
        m["approx_entropy"] = -tok(torch.exp((logp - gen).clamp(max=LOG_RATIO_BOUND)) * logp)
        m["positive_nll_loss"] = nll.detach()
        # ours
        m["clip_frac_low"] = tok(clipped_low)
        m["clip_frac_high"] = tok(clipped_high)
        m["clip_bound_low_mean"] = tok(lo)
        m["clip_bound_high_mean"] = tok(hi)
        n_tok_row = valid.sum(-1).float()
        for name, ind in (("clip_frac_low_groups", clipped_low), ("clip_frac_high_groups", clipped_high)):
            ind = (ind & valid).float()
            if index is None:  # token groups: the group-weighted fraction is the per-row token fraction
                frac_row = ind.sum(-1) / n_tok_row.clamp(min=1)
            else:  # mean over the row's non-empty groups of the clipped fraction inside each group
                frac_row = (index.sum(ind) / counts.clamp(min=1)).sum(-1) / n_groups_row.clamp(min=1)
            m[name] = seq(frac_row)
        m["groups_per_response"] = seq(n_groups_row)
        m["group_size_mean"] = seq(n_tok_row / n_groups_row.clamp(min=1))
        m["prev_entropy_mean"] = tok(ent) if ent is not None else torch.zeros((), device=r.device)
        nonfinite = (token_mask & ~valid & row_on[:, None]).float().sum()
        m["nonfinite_tokens"] = nonfinite
        m["nonfinite_token_frac"] = safe_divide(nonfinite, global_valid_toks)


class SequenceValueLoss:
    """SPPO critic loss (SPPO §3.2; spec §7): BCE-with-logits on V(s_p).

    NeMo-RL hands a value loss ``logits`` = the critic's values ``[B, S]`` (or ``[B, S, 1]``),
    already right-shifted by one: column t holds the head output at position t−1. The value
    of the prompt, read at the last prompt token, therefore sits at the first response column
    (the first 1 of ``token_mask``). loss = Σ_i sample_mask_i · BCE(v_i, R_i) / global_valid_seqs,
    R_i = ``data['rewards']`` ∈ {0, 1}.
    """

    input_type = LossInputType.LOGIT
    loss_type = LossType.SEQUENCE_LEVEL

    def __init__(self, cfg=None):
        self.cfg = dict(cfg or {})
        self.metric_normalizations = {
            "loss": MetricNormalizer.SEQUENCES, "bce": MetricNormalizer.SEQUENCES,
            "acc": MetricNormalizer.SEQUENCES, "brier": MetricNormalizer.SEQUENCES,
            "values_mean": MetricNormalizer.SEQUENCES, "returns_mean": MetricNormalizer.SEQUENCES,
            "num_valid_samples": MetricNormalizer.NONE,
        }

    def __call__(self, logits: torch.Tensor, data: Mapping, global_valid_seqs, global_valid_toks,
                 **kwargs) -> tuple[torch.Tensor, dict]:
        values = logits.squeeze(-1) if logits.dim() == 3 else logits
        if values.dim() != 2:
            raise ValueError(f"value logits must be [B, S] or [B, S, 1], got shape {tuple(logits.shape)}")
        token_mask = data["token_mask"].to(values.device)
        if token_mask.shape[1] < values.shape[1] or token_mask.shape[0] != values.shape[0]:
            raise ValueError(f"data['token_mask'] has shape {tuple(token_mask.shape)} but the values have "
                             f"shape {tuple(values.shape)}")
        token_mask = token_mask[:, : values.shape[1]]
        if "rewards" not in data:
            raise KeyError("data['rewards'] is missing (SPPO's critic regresses the binary reward)")
        rewards = data["rewards"].to(values.device).float().reshape(-1)
        sample_mask = data["sample_mask"].to(values.device).float().reshape(-1)
        has_response = token_mask.bool().any(-1)
        idx = first_response_index(token_mask)
        v = values.float().gather(-1, idx[:, None]).squeeze(-1)
        w = sample_mask * has_response.float()
        v = torch.where(w > 0, v, torch.zeros_like(v))  # padded/empty rows stay finite
        bce = sppo_critic_bce(v, rewards)
        loss = safe_divide((bce * w).sum(), global_valid_seqs)
        with torch.no_grad():
            p = torch.sigmoid(v)
            stats = {
                "loss": loss.detach(),
                "bce": loss.detach(),
                "acc": safe_divide((((p > 0.5).float() == (rewards > 0.5).float()).float() * w).sum(), global_valid_seqs),
                "brier": safe_divide((((p - rewards) ** 2) * w).sum(), global_valid_seqs),
                "values_mean": safe_divide((p * w).sum(), global_valid_seqs),
                "returns_mean": safe_divide((rewards * w).sum(), global_valid_seqs),
                "num_valid_samples": w.sum(),
            }
            names = list(stats)
            vals = torch.stack([stats[k].float().reshape(()) for k in names]).tolist()
        return loss, dict(zip(names, vals))
