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
from .core.clipping import espo_entropy_clip_bounds, sspo_entropy_clip_bounds
from .core.fused import (LinearizedLoss, RowIndex, clip_terms, compute_dtype, finite_valid, indicator,
                         masked_extrema, masked_values, prob_error_sums, substitute_nonfinite)
from .core.aggregation import safe_divide
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


def _count(x, like: torch.Tensor) -> torch.Tensor:
    """A global count (tensor or number) as a 0-d tensor of ``like``'s dtype, clamped to 1e-8."""
    x = x.to(like.device, like.dtype) if torch.is_tensor(x) else torch.tensor(float(x), dtype=like.dtype,
                                                                               device=like.device)
    return x.reshape(()).clamp(min=1e-8)


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
    """Clipped policy-gradient loss with granular importance ratios (docs/algorithms/math.md §1–§5).

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
        lp_in = next_token_logprobs
        if lp_in.dim() != 2:
            raise ValueError(f"next_token_logprobs must be [B, S-1], got shape {tuple(lp_in.shape)}")
        dt = compute_dtype(lp_in.dtype)  # float64 stays float64; bf16/fp16 compute in float32
        dev = lp_in.device
        L = lp_in.detach().to(dt)
        token_mask = _key(data, "token_mask", L)
        sm = data["sample_mask"].to(dev, dt).reshape(-1)
        if sm.shape[0] != L.shape[0]:
            raise ValueError(f"data['sample_mask'] has shape {tuple(data['sample_mask'].shape)} but "
                             f"next_token_logprobs has {L.shape[0]} rows")
        A = _key(data, "advantages", L).to(dt)
        Q = L if cfg.force_on_policy_ratio else _key(data, "prev_logprobs", L).to(dt)
        G = _key(data, "generation_logprobs", L).to(dt) if "generation_logprobs" in data else None
        H = _key(data, "prev_entropy", L).to(dt) if "prev_entropy" in data else None
        if g.needs_entropy and H is None:
            raise KeyError(f"data['prev_entropy'] is missing: algorithm {g.algorithm!r} (clip={g.clip}, "
                           f"granularity={g.granularity}) needs the π_old entropy")

        # 0/1 masks in the compute dtype; NaN/inf tokens are excluded (and counted)
        mask_f = indicator(torch.gt, token_mask, 0, L)
        present = [x for x in (L, Q, A, G, H) if x is not None]
        if bool(torch.isfinite(torch.stack([x.sum() for x in present])).all()):  # one sync; the usual case
            valid = mask_f
            logp, adv = L * mask_f, A * mask_f
            prev = logp if Q is L else Q * mask_f
            gen = prev if G is None else G * mask_f
            ent = H * mask_f if H is not None else None
        else:
            checked = [L, Q, A]
            if cfg.use_importance_sampling_correction and G is not None:
                checked.append(G)
            if g.needs_entropy:
                checked.append(H)
            valid = finite_valid(mask_f, *checked)
            logp, prev, adv = masked_values(L, valid), masked_values(Q, valid), masked_values(A, valid)
            if G is None:
                gen = prev
            elif cfg.use_importance_sampling_correction:
                gen = masked_values(G, valid)
            else:  # a non-finite π_gen logprob only feeds diagnostics: π_old stands in for it
                gen = substitute_nonfinite(G, prev, valid)
            ent = masked_values(H, valid) if H is not None else None

        inv_gvt = 1 / _count(global_valid_toks, L)
        inv_gvs = 1 / _count(global_valid_seqs, L)
        n_row = valid.sum(-1)
        row_on = indicator(torch.ne, sm, 0, sm)
        w_tok = valid * (sm * inv_gvt)[:, None]  # NeMo-RL's token_mask·sample_mask / global_valid_toks

        log_ratio = logp - prev
        per_token = g.granularity == "token"
        index = counts = s = lo_g = hi_g = cap_g = None
        if per_token:  # GRPO: every token is its own group, no scatter
            ratio = torch.exp(log_ratio.clamp(max=LOG_RATIO_BOUND))
            lo, hi = self._bounds(ent, log_ratio)
            n_groups_row = n_row
        else:
            index = self._index(data, token_mask, valid, ent, L)
            counts, group_lr = index.sum2(valid, log_ratio)  # one scatter for both
            counts_c = counts.clamp(min=1)
            group_lr = group_lr / counts_c
            cap_g = indicator(torch.le, group_lr, LOG_RATIO_BOUND, group_lr)  # d clamp / d x
            s = torch.exp(group_lr.clamp(max=LOG_RATIO_BOUND))  # s_g, the group ratio
            ratio = index.gather(s)  # value of r_it for both forms
            if g.clip == "fixed":
                lo, hi = lo_g, hi_g = self._bounds(None, None)
            else:
                lo_g, hi_g = self._bounds(index.sum(ent) / counts_c, None)
                lo, hi = index.gather(lo_g), index.gather(hi_g)
            n_groups_row = counts.clamp(max=1).sum(-1)
        c, ratio_clamped, low, high, keep = clip_terms(ratio, adv, lo, hi, cfg.ratio_clip_c)

        # per-token aggregation weight: objective = Σ_t W_t·c_t (docs/algorithms/math.md §5, global denominators)
        seq_w = group_w = None
        if g.aggregation == "token_mean":
            W = w_tok
        elif g.aggregation == "seq_mean_token_mean" or per_token:  # token groups: the two means coincide
            W = seq_w = valid * (sm * inv_gvs / n_row.clamp(min=1))[:, None]
        else:
            W = group_w = valid * index.gather((sm * inv_gvs / n_groups_row.clamp(min=1))[:, None] / counts_c)
        metrics: dict[str, torch.Tensor] = {}
        is_weight = None
        if cfg.use_importance_sampling_correction:  # off-policy correction π_old/π_gen (detached)
            is_weight = self._importance_weights(prev, gen, valid, index, sm, inv_gvt, inv_gvs, w_tok, metrics)
            W = W * is_weight
        objective = torch.dot(W.reshape(-1), c.reshape(-1)) if W.shape == c.shape else (W * c).sum()

        # d objective / d logp in closed form: dc/dr = keep·A, and dr/dlogp per ratio form
        wak = W * adv * keep
        if per_token:
            grad = wak.mul_(ratio).mul_(indicator(torch.le, log_ratio, LOG_RATIO_BOUND, log_ratio))
        elif g.ratio == "token_decomposed":  # sg[s_g]·exp(logp − sg[logp]): d/dlogp_t = s_g
            grad = wak.mul_(ratio)
        else:  # shared: r = exp(mean_g log-ratio), d/dlogp_u = s_g/|g| for every u in g
            grad = index.gather(s * cap_g / counts_c * index.sum(wak)) * valid
        loss = LinearizedLoss.apply(lp_in, -objective, grad.neg_())

        kl = torch.zeros((), dtype=dt, device=dev)
        nll = torch.zeros((), dtype=dt, device=dev)
        if self.reference_policy_kl_penalty != 0 or (cfg.positive_example_nll_weight > 0 and "rewards" in data):
            valid_b = valid > 0
            logp_g = torch.where(valid_b, lp_in.to(dt), 0.0)  # autograd path for the optional terms
            if self.reference_policy_kl_penalty != 0:
                kl = self._kl(data, L, logp_g, gen, valid_b, sm, w_tok, inv_gvs)
                loss = loss + kl
            if cfg.positive_example_nll_weight > 0 and "rewards" in data:
                correct = valid * sm[:, None] * (data["rewards"].to(dev, dt).reshape(-1) > 0).to(dt)[:, None]
                nll = -(logp_g * correct).sum() / correct.sum().clamp(min=1)
                loss = loss + cfg.positive_example_nll_weight * nll

        with torch.no_grad():
            self._metrics(metrics, loss, kl, nll, ratio, ratio_clamped, lo, hi, low, high, valid, mask_f, row_on,
                          sm, inv_gvt, inv_gvs, w_tok, seq_w, group_w, n_row, prev, gen, logp, ent, index, counts,
                          s, lo_g, hi_g, n_groups_row, is_weight)
            names = list(metrics)
            values = torch.stack([metrics[k] for k in names]).tolist()  # 0-d tensors of dt; one sync
        return loss, dict(zip(names, values))

    # ------------------------------------------------------------------ pieces
    def _index(self, data, token_mask, valid, ent, like):
        """The scatter/gather plan of the configured groups (one group per row: no scatter)."""
        g = self.granular
        if g.granularity == "sequence":
            return RowIndex(like.shape[0])
        if "granular_group_ids" in data:
            ids = _key(data, "granular_group_ids", like).long()
            lo, hi = (int(v) for v in torch.stack(torch.aminmax(ids)).tolist()) if ids.numel() else (0, 0)  # one sync
            if hi >= like.shape[1] or lo < -1:
                raise ValueError(f"data['granular_group_ids'] holds id {hi if hi >= like.shape[1] else lo} outside "
                                 f"-1..{like.shape[1] - 1} (ids must be per-row local, 0..G-1, -1 outside groups)")
            top = hi + 1  # the table needs only the ids in use
        elif g.granularity == "segment":
            if self.delimiter_table is None:
                raise ValueError("granular.granularity 'segment' needs a tokenizer (GranularPolicyLoss(..., "
                                 "tokenizer=...)) or precomputed data['granular_group_ids']")
            ids = group_ids_for("segment", token_mask > 0, token_ids=_key(data, "input_ids", like),
                                delimiter_table=self.delimiter_table)
            top = int(ids.max()) + 1 if ids.numel() else 1
        else:  # entropy_group: at most len(cut points) + 1 groups
            ids = group_ids_for(g.granularity, token_mask > 0, entropy=torch.where(valid > 0, ent, torch.nan),
                                entropy_cut_points=g.entropy_cut_points)
            top = len(g.entropy_cut_points) + 1
        # ids are >= -1; a token with an id but not valid (non-finite) is a member whose values are
        # 0 and which the counts (Σ valid) leave out
        return GroupIndex.from_ids(ids, max(top, 1))

    def _importance_weights(self, prev, gen, valid, index, sample_mask, inv_gvt, inv_gvs, w_tok, metrics):
        cfg = self.cfg
        diff = prev - gen  # 0 outside the valid tokens
        if index is None:
            w = torch.exp(diff.clamp(max=LOG_RATIO_BOUND))
        else:  # one weight per group: exp(Σ_group (logq − log π_gen)), NeMo-RL's GSPO convention
            w = torch.exp(index.gather(index.sum(diff)).clamp(max=LOG_RATIO_BOUND))
        w = torch.nan_to_num(w, nan=0.0, posinf=0.0, neginf=0.0)
        kind, hi, lo = (cfg.truncated_importance_sampling_type, cfg.truncated_importance_sampling_ratio,
                        cfg.truncated_importance_sampling_ratio_min)
        if kind == "tis":
            lo = 0.0 if lo is None else lo
            metrics["is_oob_ratio"] = (((w > hi) | (w < lo)).to(w.dtype) * w_tok).sum()
            w = w.clamp(lo, hi)
        elif kind == "icepop":
            keep = ((w >= lo) & (w <= hi)).to(w.dtype)
            metrics["is_oob_ratio"] = ((1 - keep) * w_tok).sum()
            w = w * keep
        elif kind == "seq-mask-tis":
            geo = torch.exp(diff.sum(-1) / valid.sum(-1).clamp(min=1))
            keep = ((geo >= lo) & (geo <= hi)).to(w.dtype)
            metrics["is_oob_ratio"] = ((1 - keep) * sample_mask).sum() * inv_gvs
            w = w * keep[:, None]
        return w

    def _kl(self, data, like, logp, gen, valid, sample_mask, w_tok, inv_gvs):
        cfg = self.cfg
        ref = torch.where(valid, _key(data, "reference_policy_logprobs", like).to(like.dtype), 0.0)
        curr = data.get("curr_logprobs_unfiltered", None)
        curr = logp if curr is None else torch.where(valid, curr.to(like.dtype), 0.0)
        if cfg.use_on_policy_kl_approximation:
            w = torch.exp((curr - gen).clamp(max=LOG_RATIO_BOUND))
        else:
            w = torch.exp(curr - curr.detach())
        w = torch.nan_to_num(w, nan=0.0, posinf=0.0, neginf=0.0)
        kl = self.reference_policy_kl_penalty * kl_penalty_per_token(
            curr, ref, cfg.reference_policy_kl_type, cfg.kl_input_clamp_value, cfg.kl_output_clamp_value, w)
        if self.loss_type == LossType.TOKEN_LEVEL:
            return (kl * w_tok).sum()
        n = valid.sum(-1).to(like.dtype).clamp(min=1)
        return ((torch.where(valid, kl, 0.0).sum(-1) / n) * sample_mask).sum() * inv_gvs

    def _metrics(self, m, loss, kl, nll, ratio, ratio_clamped, lo, hi, low, high, valid, mask_f, row_on,
                 sample_mask, inv_gvt, inv_gvs, w_tok, seq_w, group_w, n_row, prev, gen, logp, ent, index,
                 counts, s, lo_g, hi_g, n_groups_row, is_weight):
        """NeMo-RL's metric set (same names, same normalisation) plus the granular ones; every
        token mean is one weighted sum, and ratio statistics of group granularities are taken
        on the ``[B, G]`` group table (a group's tokens share its ratio and bounds)."""
        row_tok = sample_mask * inv_gvt  # [B]

        w_flat = w_tok.view(-1)

        def tok(x):  # Σ_t w_tok·x: a token mean normalised by global_valid_toks
            if not torch.is_tensor(x) or x.dim() == 0:
                return w_tok.sum() * x
            if x.shape == w_tok.shape and x.is_contiguous():
                return torch.dot(x.view(-1), w_flat)
            return (x * w_tok).sum()

        def seq(x_row):  # a per-row value averaged over rows, normalised by global_valid_seqs
            return (x_row * sample_mask).sum() * inv_gvs

        if index is None:  # token granularity: per-token statistics
            live = valid * row_on[:, None]
            m["probs_ratio"] = tok(ratio)
            m["probs_ratio_clamped"] = tok(ratio_clamped)
            if torch.is_tensor(lo) and lo.dim() > 0:
                r_min, r_max, rc_min, rc_max = masked_extrema([ratio, ratio_clamped], live)
            else:  # clamp is monotone: the extrema of the clamped ratios are the clamped extrema
                r_min, r_max = masked_extrema([ratio], live)
                rc_min = torch.where(torch.isinf(r_min), r_min, r_min.clamp(lo, hi))  # keep the ±inf sentinels
                rc_max = torch.where(torch.isinf(r_max), r_max, r_max.clamp(lo, hi))
            bound_lo, bound_hi = tok(lo), tok(hi)
        else:  # group table [B, G]: weight of a group = its token count
            gw = counts * row_tok[:, None]
            rc_g = torch.clamp(s, lo_g, hi_g)
            m["probs_ratio"] = (s * gw).sum()
            m["probs_ratio_clamped"] = (rc_g * gw).sum()
            live_g = counts.clamp(max=1) * row_on[:, None]
            r_min, r_max, rc_min, rc_max = masked_extrema([s, rc_g], live_g)
            bound_lo = (lo_g * gw).sum() if torch.is_tensor(lo_g) else gw.sum() * lo_g
            bound_hi = (hi_g * gw).sum() if torch.is_tensor(hi_g) else gw.sum() * hi_g
        m["loss"] = loss.detach()
        m["num_valid_samples"] = sample_mask.sum()
        m["probs_ratio_min"], m["probs_ratio_max"] = r_min, r_max
        m["probs_ratio_clamped_min"], m["probs_ratio_clamped_max"] = rc_min, rc_max
        coef = self.reference_policy_kl_penalty
        m["kl_penalty"] = kl.detach() / coef if coef else torch.zeros_like(kl)
        diff = prev - gen  # 0 outside the valid tokens
        token_is = self.granular.granularity != "sequence" and is_weight is None
        m.update(prob_error_sums(diff, w_tok, self.cfg.reference_policy_kl_type,
                                 LOG_RATIO_BOUND if token_is else None))
        # GSPO: the mean over responses of one π_old/π_gen weight per response. NeMo-RL's own GSPO
        # mode multiplies a [B, 1] weight by a [B] mask, which broadcasts to [B, B], so its dashboard
        # shows Σ_i w_i (about B × ours), not a mean (docs/nemo-rl.md, "Logged metrics").
        if self.granular.granularity == "sequence":  # one weight per response
            w_row = torch.exp(diff.sum(-1).clamp(max=LOG_RATIO_BOUND))
            if is_weight is not None:
                w_row = (is_weight * valid).amax(-1)
            m["sampling_importance_ratio"] = seq(w_row)
        elif not token_is:
            m["sampling_importance_ratio"] = tok(is_weight)
        m["approx_entropy"] = -tok(torch.exp((logp - gen).clamp(max=LOG_RATIO_BOUND)).mul_(logp))
        m["positive_nll_loss"] = nll.detach()
        # ours
        m["clip_frac_low"] = tok(low)
        m["clip_frac_high"] = tok(high)
        m["clip_bound_low_mean"] = bound_lo
        m["clip_bound_high_mean"] = bound_hi
        # clipped fraction per group, averaged over the row's groups, then over rows: one weighted
        # sum with weight sample_mask/(n_groups·|g|·global_valid_seqs) (per token for token groups)
        if index is None:
            gfrac_w = seq_w if seq_w is not None else valid * (sample_mask * inv_gvs / n_row.clamp(min=1))[:, None]
        else:
            gfrac_w = group_w if group_w is not None else valid * index.gather(
                (sample_mask * inv_gvs / n_groups_row.clamp(min=1))[:, None] / counts.clamp(min=1))
        m["clip_frac_low_groups"] = torch.dot(low.reshape(-1), gfrac_w.reshape(-1))
        m["clip_frac_high_groups"] = torch.dot(high.reshape(-1), gfrac_w.reshape(-1))
        m["groups_per_response"] = seq(n_groups_row)
        m["group_size_mean"] = seq(n_row / n_groups_row.clamp(min=1))
        m["prev_entropy_mean"] = tok(ent) if ent is not None else torch.zeros_like(sample_mask[0])
        nonfinite = ((mask_f.sum(-1) - n_row) * row_on).sum()
        m["nonfinite_tokens"] = nonfinite
        m["nonfinite_token_frac"] = nonfinite * inv_gvt


class SequenceValueLoss:
    """SPPO critic loss (SPPO §3.2; docs/algorithms/math.md §7): BCE-with-logits on V(s_p).

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
        dt = compute_dtype(values.dtype)  # float64 stays float64; bf16/fp16 compute in float32
        rewards = data["rewards"].to(values.device, dt).reshape(-1)
        sample_mask = data["sample_mask"].to(values.device, dt).reshape(-1)
        has_response = token_mask.bool().any(-1)
        idx = first_response_index(token_mask)
        v = values.to(dt).gather(-1, idx[:, None]).squeeze(-1)
        w = sample_mask * has_response.to(dt)
        v = torch.where(w > 0, v, torch.zeros_like(v))  # padded/empty rows stay finite
        bce = sppo_critic_bce(v, rewards)
        loss = safe_divide((bce * w).sum(), global_valid_seqs)
        with torch.no_grad():
            p = torch.sigmoid(v)
            stats = {
                "loss": loss.detach(),
                "bce": loss.detach(),
                "acc": safe_divide((((p > 0.5) == (rewards > 0.5)).to(dt) * w).sum(), global_valid_seqs),
                "brier": safe_divide((((p - rewards) ** 2) * w).sum(), global_valid_seqs),
                "values_mean": safe_divide((p * w).sum(), global_valid_seqs),
                "returns_mean": safe_divide((rewards * w).sum(), global_valid_seqs),
                "num_valid_samples": w.sum(),
            }
            names = list(stats)
            vals = torch.stack([stats[k].to(dt).reshape(()) for k in names]).tolist()
        return loss, dict(zip(names, vals))
