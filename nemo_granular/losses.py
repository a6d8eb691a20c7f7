"""NeMo-RL loss objects: the granular policy loss and the SPPO critic loss.

Both follow NeMo-RL's ``LossFunction`` protocol (``nemo_rl/algorithms/loss/interfaces.py``):
``loss_fn(data=..., global_valid_seqs=..., global_valid_toks=..., next_token_logprobs=...)``
returns ``(loss, metrics)``; per-token data keys are ``[B, S]`` and used as ``[:, 1:]``
against ``next_token_logprobs`` ``[B, S-1]``; every cross-row denominator is a global count,
so the partial results of microbatches (or of single-sequence calls under sequence
packing) add up to the global-batch value — except the optional NLL term on correct
responses, which divides by this microbatch's count as NeMo-RL's does. No collective is ever called.

The policy loss is an adapter: it reads NeMo-RL's batch once (:func:`read_policy_batch`), then runs
the formulas of :mod:`nemo_granular.core.objective` / :mod:`~nemo_granular.core.offpolicy` in
the order of docs/algorithms/math.md into one :class:`~nemo_granular.core.objective.ObjectiveResult`
and reports :mod:`nemo_granular.loss_metrics` from it; its config is the frozen spec of
:mod:`nemo_granular.loss_spec`, resolved when the loss is built.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .config import parse_policy_loss_config
from .core.advantages import first_response_index, sppo_critic_bce
from .core.clipping import (
    ESPO_AUTO_TARGET_EPS,
    calibrate_espo_alpha,
    espo_entropy_clip_bounds,
    sspo_entropy_clip_bounds,
)
from .core.group_index import GroupIndex, RowIndex, make_group_index
from .core.groups import build_delimiter_table, entropy_group_ids, group_ids_for
from .core.linearized_loss import LinearizedLoss
from .core.masks import (
    compute_dtype,
    finite_valid,
    indicator,
    masked_values,
    row_constant,
    safe_divide,
    substitute_nonfinite,
)
from .core.objective import (
    CHECK_HERE,
    COUNT_EPS,
    LOG_RATIO_BOUND,
    ObjectiveResult,
    PenalizedLoss,
    aggregation_weights,
    count_eps_dtype,
    group_ratios,
    grouped_clipped_objective,
    objective_logp_grad,
    plus_count_eps,
    surrogate_terms,
)
from .core.offpolicy import generation_weights, kl_penalty_per_token
from .loss_metrics import metric_kinds, mismatch_metrics, policy_metrics
from .loss_spec import PolicyLossSpec
from .protocol import HostMember, LossInputType, LossType, MetricNormalizer, resolve

__all__ = [
    "GranularPolicyLoss",
    "SequenceValueLoss",
    "PolicyBatch",
    "read_policy_batch",
    "ObjectiveResult",
    "kl_penalty_per_token",
    "LOG_RATIO_BOUND",
]


_EXTREMA = frozenset(("probs_ratio_min", "probs_ratio_max", "probs_ratio_clamped_min", "probs_ratio_clamped_max"))


def _key(
    data: Mapping, name: str, like: torch.Tensor, shift: bool = True, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``data[name][:, 1:]`` checked against ``like``'s shape (the shift convention), on ``like``'s
    device and in ``dtype`` (None: its own)."""
    if name not in data:
        raise _missing(name)
    x = data[name]
    if hasattr(x, "full_tensor"):
        raise ValueError(
            f"data['{name}'] is a DTensor (DTensor context parallelism): precompute "
            "'granular_group_ids' on the driver instead of reading it in the loss"
        )
    x = x[:, 1:] if shift else x
    if tuple(x.shape) != tuple(like.shape):
        raise ValueError(
            f"data['{name}'][:, 1:] has shape {tuple(x.shape)} but next_token_logprobs has shape {tuple(like.shape)}"
        )
    return _on(x, like.device, dtype)


def _on(x: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """x on ``device`` in ``dtype`` (None: its own); x itself when it is already (a ``to`` that does
    nothing still costs a dispatch, and the loss reads a dozen keys a call)."""
    if x.device == device and (dtype is None or x.dtype == dtype):
        return x
    return x.to(device, dtype)


def _missing(name: str) -> KeyError:
    return KeyError(f"data['{name}'] is missing (required by the granular loss)")


def _count(x, like: torch.Tensor) -> torch.Tensor:
    """A global count (tensor or number) as NeMo-RL's ``masked_mean`` divides by it: count + 1e-8 formed
    in the count's own dtype (:func:`~nemo_granular.core.objective.count_eps_dtype`: float32 for a float32
    or integer count, where the 1e-8 vanishes; Python's float64 for a number), then a 0-d tensor of
    ``like``'s dtype (docs/algorithms/math.md, Notation)."""
    if not torch.is_tensor(x):
        return torch.tensor(float(x) + COUNT_EPS, dtype=like.dtype, device=like.device)
    return (x.reshape(()).to(like.device) + COUNT_EPS).to(like.dtype)  # in torch.result_type(x, 1e-8)


def _inverse_counts(global_valid_toks, global_valid_seqs, like: torch.Tensor):
    """(1 / :func:`_count` of ``global_valid_toks``, of ``global_valid_seqs``): for two one-element counts
    of one dtype (NeMo-RL's), both in the same few ops (the same values: each op is elementwise)."""
    gvt, gvs = global_valid_toks, global_valid_seqs
    if torch.is_tensor(gvt) and torch.is_tensor(gvs) and gvt.dtype == gvs.dtype and gvt.numel() == 1 == gvs.numel():
        both = _on(torch.stack([gvt.reshape(()), gvs.reshape(())]), like.device)
        inv = _on(both + COUNT_EPS, like.device, like.dtype).reciprocal_()
        return inv.unbind()
    return 1 / _count(gvt, like), 1 / _count(gvs, like)


@dataclass
class PolicyBatch:
    """One loss call's batch, shifted to ``next_token_logprobs``' columns, in the compute dtype;
    every per-token value is 0 outside the valid tokens (masked and finite) — except in the
    optimistic read (``assume_finite``), where the values are as given (see there), and the keys
    only the penalties and the group plan read (``ref_logp``, ``curr_logp``, ``group_ids``,
    ``token_ids``: as given, masked where they are used). The loss reads ``data`` only here."""

    logp: torch.Tensor  # log π_θ, detached
    prev: torch.Tensor  # log π_old
    adv: torch.Tensor
    gen: torch.Tensor  # log π_gen (π_old where absent, or non-finite and unused)
    ent: torch.Tensor | None  # π_old entropy
    mask: torch.Tensor  # token_mask, 0/1
    valid: torch.Tensor  # mask without the non-finite tokens
    sample_mask: torch.Tensor  # [B]
    inv_gvt: torch.Tensor  # 1 / (global_valid_toks + 1e-8)
    inv_gvs: torch.Tensor  # 1 / (global_valid_seqs + 1e-8)
    count_dtype: torch.dtype | None = None  # where per-row/group token counts take + 1e-8: token_mask's (NeMo-RL's)
    group_ids: torch.Tensor | None = None  # granular_group_ids (int32 or int64), when given and the groups are not rows
    token_ids: torch.Tensor | None = None  # input_ids, for segment groups cut here (no group ids given)
    ref_logp: torch.Tensor | None = None  # log π_ref (reference_policy_logprobs), when β ≠ 0
    curr_logp: torch.Tensor | None = None  # curr_logprobs_unfiltered (NeMo-RL's KL input), when β ≠ 0 and given
    rewards: torch.Tensor | None = None  # [B], when the NLL term is on and the rewards are given
    nll_count_dtype: torch.dtype | None = None  # where Σ correct + 1e-8 is formed (NeMo-RL's correct_mask dtype)
    # computed on first use (the group path of the loss needs none of them)
    _n_row: torch.Tensor | None = None
    _w_tok: torch.Tensor | None = None
    _row_on: torch.Tensor | None = None

    @property
    def row_on(self) -> torch.Tensor:
        """sample_mask != 0 as 0/1, [B] (only the full metrics and the careful read's count need it)."""
        if self._row_on is None:
            self._row_on = indicator(torch.ne, self.sample_mask, 0, self.sample_mask)
        return self._row_on

    @property
    def n_row(self) -> torch.Tensor:
        """Valid tokens per row, [B]."""
        if self._n_row is None:
            self._n_row = self.valid.sum(-1)
        return self._n_row

    @n_row.setter
    def n_row(self, value: torch.Tensor) -> None:
        self._n_row = value

    @property
    def w_tok(self) -> torch.Tensor:
        """valid·sample_mask/global_valid_toks: NeMo-RL's token-mean weight, [B, T]."""
        if self._w_tok is None:
            self._w_tok = self.valid * (self.sample_mask * self.inv_gvt)[:, None]
        return self._w_tok


def read_policy_batch(
    next_token_logprobs: torch.Tensor,
    data: Mapping,
    global_valid_seqs,
    global_valid_toks,
    cfg: PolicyLossSpec,
    assume_finite: bool = False,
) -> PolicyBatch:
    """The batch keys of :data:`nemo_granular.batch_schema.POLICY_BATCH` (every one the loss ``cfg``
    uses; no other key of ``data`` is read) as a :class:`PolicyBatch`. NaN/inf
    tokens (in logp, π_old logp, advantage, and π_gen logp / entropy where they are used) leave the
    valid mask (math.md, Notation). ``assume_finite``: skip the finiteness test (the caller checks
    its results instead: a non-finite input anywhere makes them non-finite, and it calls again without)."""
    lp_in, g = next_token_logprobs, cfg.granular
    if lp_in.dim() != 2:
        raise ValueError(f"next_token_logprobs must be [B, S-1], got shape {tuple(lp_in.shape)}")
    dt = compute_dtype(lp_in.dtype)  # float64 stays float64; bf16/fp16 compute in float32
    L = _on(lp_in.detach(), lp_in.device, dt)
    token_mask = _key(data, "token_mask", L)
    sm = _on(data["sample_mask"], L.device, dt)
    sm = sm if sm.dim() == 1 else sm.reshape(-1)
    if sm.shape[0] != L.shape[0]:
        raise ValueError(
            f"data['sample_mask'] has shape {tuple(data['sample_mask'].shape)} but "
            f"next_token_logprobs has {L.shape[0]} rows"
        )
    A = _key(data, "advantages", L, dtype=dt)
    Q = L if cfg.force_on_policy_ratio else _key(data, "prev_logprobs", L, dtype=dt)
    G = _key(data, "generation_logprobs", L, dtype=dt) if "generation_logprobs" in data else None
    H = _key(data, "prev_entropy", L, dtype=dt) if "prev_entropy" in data else None
    if g.needs_entropy and H is None:
        raise KeyError(
            f"data['prev_entropy'] is missing: algorithm {g.algorithm!r} (clip={g.clip}, "
            f"granularity={g.granularity}) needs the π_old entropy"
        )

    # the two scalars first: a small op right after a [B, T] pass costs several times more on CPU
    inv_gvt, inv_gvs = _inverse_counts(global_valid_toks, global_valid_seqs, L)
    mask_f = indicator(torch.gt, token_mask, 0, L)
    present = [x for x in (L, Q, A, G, H) if x is not None]
    if assume_finite:
        # values as given (finite is checked on the results): every use is weighted by a weight
        # that is 0 outside the valid tokens, or sums over group members only; the row sums of
        # π_old − π_gen (importance sampling; GSPO's full metrics) and of the entropy
        # (sequence groups) need them masked
        valid, logp, adv = mask_f, L, A
        masked_pg = cfg.use_importance_sampling_correction or (
            cfg.metrics_level == "full" and g.granularity == "sequence"
        )
        prev = Q * mask_f if masked_pg else Q
        gen = prev
        if G is not None:
            gen = G * mask_f if masked_pg else G
        ent = H
        if H is not None and g.granularity == "sequence":
            ent = H * mask_f
    elif bool(torch.isfinite(torch.stack([x.sum() for x in present])).all()):  # one sync; the usual case
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
    group_ids, token_ids = _group_keys(data, g.granularity, L)
    ref_logp, curr_logp, rewards, nll_count_dtype = _penalty_keys(data, cfg, token_mask.dtype, L)
    return PolicyBatch(
        logp=logp,
        prev=prev,
        adv=adv,
        gen=gen,
        ent=ent,
        mask=mask_f,
        valid=valid,
        sample_mask=sm,
        inv_gvt=inv_gvt,
        inv_gvs=inv_gvs,
        count_dtype=count_eps_dtype(token_mask),
        group_ids=group_ids,
        token_ids=token_ids,
        ref_logp=ref_logp,
        curr_logp=curr_logp,
        rewards=rewards,
        nll_count_dtype=nll_count_dtype,
    )


def _group_keys(data: Mapping, granularity: str, like: torch.Tensor):
    """(group ids, token ids) for the group plan: ``granular_group_ids`` (segment / entropy groups), else
    ``input_ids`` for segment groups cut in the loss; token and sequence groups read neither."""
    if granularity in ("token", "sequence"):
        return None, None
    if "granular_group_ids" in data:
        ids = _key(data, "granular_group_ids", like)  # int32 as the hosts send them (int64 read too)
        return (ids if ids.dtype in (torch.int32, torch.int64) else ids.long()), None
    if granularity == "segment" and "input_ids" in data:
        return None, _key(data, "input_ids", like)
    return None, None


def _penalty_keys(data: Mapping, cfg: PolicyLossSpec, token_mask_dtype: torch.dtype, like: torch.Tensor):
    """(π_ref, ``curr_logprobs_unfiltered``, rewards, the NLL count's dtype) for the penalties: the first
    two when β ≠ 0, the last two when the NLL term is on (None otherwise)."""
    ref_logp = curr_logp = rewards = nll_count_dtype = None
    if cfg.kl_coef != 0:
        ref_logp = _key(data, "reference_policy_logprobs", like, dtype=like.dtype)
        curr = data.get("curr_logprobs_unfiltered", None)
        curr_logp = None if curr is None else curr.to(like.dtype)
    if cfg.positive_example_nll_weight > 0 and "rewards" in data:
        rewards = data["rewards"].to(like.device, like.dtype).reshape(-1)
        # NeMo-RL: Σ correct_mask + 1e-8 in correct_mask's dtype (token_mask·sample_mask·float32)
        nll_count_dtype = torch.promote_types(
            torch.promote_types(token_mask_dtype, data["sample_mask"].dtype), torch.float32
        )
    return ref_logp, curr_logp, rewards, nll_count_dtype


class GranularPolicyLoss:
    """Clipped policy-gradient loss with granular importance ratios (docs/algorithms/math.md §1–§5).

    loss = −Agg_i,t[ c_it ] + β·KL,   c_it = min(r_it·A_it, clip(r_it, lo_ig, hi_ig)·A_it)

    (or CISPO's sg[clip(r)]·A·logp, or REINFORCE's A·logp), with
    r_it = exp(mean_{u∈g(i,t)} (logp_iu − logq_iu)) per token group g (token: GRPO;
    sequence: GSPO; segment: SSPO; entropy group: ESPO), in the `shared` or
    `token_decomposed` form; [lo, hi] fixed or entropy-adaptive per group; Agg one of
    token_mean / seq_mean_token_mean / seq_mean_group_mean (global normalisation).

    Batch keys (read once per call, :func:`read_policy_batch`): the ones declared in
    :data:`nemo_granular.batch_schema.POLICY_BATCH` — their shapes, dtypes, and when each is read
    or required. Group ids are computed here when absent (segment: from ``input_ids`` and the
    delimiter table; entropy_group: from ``prev_entropy``).

    Config: NeMo-RL's ``loss_fn`` keys with ``granular:`` (see :mod:`nemo_granular.config`).
    ``loss_type``, ``input_type`` and ``metric_normalizations`` are NeMo-RL's own enum members
    whenever NeMo-RL's loss module is loaded (:mod:`nemo_granular.protocol`).
    """

    input_type = HostMember(LossInputType.LOGPROB)

    def __init__(
        self,
        cfg,
        use_fused_linear_logprobs: bool = False,
        *,
        tokenizer=None,
        delimiter_table: torch.Tensor | None = None,
        vocab_size: int | None = None,
    ):
        self.cfg: PolicyLossSpec = parse_policy_loss_config(cfg)  # resolved once, frozen
        self.use_fused_linear_logprobs = use_fused_linear_logprobs
        self.reference_policy_kl_penalty = self.cfg.kl_coef
        self.vocab_size = self.granular.espo.vocab_size or vocab_size
        self.delimiter_table = delimiter_table.bool().cpu() if delimiter_table is not None else None
        if tokenizer is not None and self.delimiter_table is None and self.granular.granularity == "segment":
            self.set_tokenizer(tokenizer, vocab_size)
        self._loss_type = LossType.TOKEN_LEVEL if self.cfg.token_level else LossType.SEQUENCE_LEVEL
        self._metric_kinds = {
            k: MetricNormalizer(v)
            for k, v in metric_kinds(
                self.cfg.token_level,
                self.granular.granularity,
                self.cfg.truncated_importance_sampling_type,
                self.cfg.metrics_level,
                self.cfg.use_importance_sampling_correction,
                self.granular.is_level,
            ).items()
        }
        self.metrics_level = self.cfg.metrics_level
        self.enable_torch_compile = self.cfg.enable_torch_compile
        # compiled lazily on the worker, after Ray has serialised the loss (as NeMo-RL does)
        self._compiled_objective = None

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_compiled_objective"] = None  # a compiled function does not pickle; recompiled where used
        return state

    @property
    def granular(self):
        """The resolved ``loss_fn.granular`` (:class:`~nemo_granular.loss_spec.GranularSpec`)."""
        return self.cfg.granular

    @property
    def loss_type(self):
        return resolve(self._loss_type)

    @property
    def metric_normalizations(self) -> dict:
        """Per metric, the global denominator it is normalised by (NeMo-RL's ``MetricNormalizer``)."""
        return {k: resolve(v) for k, v in self._metric_kinds.items()}

    def set_tokenizer(self, tokenizer, vocab_size: int | None = None) -> None:
        """Build the delimiter lookup table (segment granularity) once from ``tokenizer``."""
        self.delimiter_table = build_delimiter_table(tokenizer, self.granular.segment_delimiters, vocab_size)

    # ------------------------------------------------------------------ ESPO's α: auto
    @property
    def espo_alpha_pending(self) -> bool:
        """``espo.alpha: auto`` with the `espo_entropy` clip, not set yet from a π_old pass."""
        return self.granular.clip == "espo_entropy" and self.granular.espo.alpha == "auto"

    def calibrate_espo_alpha(
        self, prev_entropy: torch.Tensor, mask: torch.Tensor, target_eps: float = ESPO_AUTO_TARGET_EPS
    ) -> float:
        """Set α = target_eps·log|V|/H̄₀ (docs/algorithms/espo.md), H̄₀ the mean of the π_old entropy
        ``prev_entropy`` over the valid response tokens ``mask`` (same shape), and return it."""
        ent = prev_entropy.detach()
        valid = (mask.detach().to(ent.device) > 0) & torch.isfinite(ent)
        if not bool(valid.any()):
            raise ValueError("loss_fn.granular.espo.alpha: auto needs a rollout with response tokens to set α")
        if self.vocab_size is None:
            raise ValueError("loss_fn.granular.espo.vocab_size is unset and no model vocabulary size was given")
        mean_h = ent[valid].mean().item()
        alpha = calibrate_espo_alpha(mean_h, self.vocab_size, target_eps)
        self.set_espo_alpha(alpha)
        return alpha

    def set_espo_alpha(self, alpha: float) -> None:
        """Use ``alpha`` (a resumed run restores the α of its first rollout)."""
        self.cfg = self.cfg.with_espo_alpha(alpha)

    def __call__(
        self, next_token_logprobs: torch.Tensor, data: Mapping, global_valid_seqs, global_valid_toks, **kwargs
    ) -> tuple[torch.Tensor, dict]:
        # The workers call the loss inside the model's autocast (bf16 training): the loss computes in
        # its own dtype (compute_dtype), never in autocast's, whose bf16 matmuls would round the group
        # sums of the log-ratios (NeMo-RL's loss has no matmul; ours sums groups with one)
        with torch.autocast(next_token_logprobs.device.type, enabled=False):
            # First on the batch as it comes: a non-finite input anywhere (valid or masked) turns the
            # objective or a metric non-finite, and only then is the batch read again with the
            # non-finite tokens taken out of the valid mask (saves one pass per input key per call)
            loss, metrics, probes = self._call(next_token_logprobs, data, global_valid_seqs, global_valid_toks, True)
            # (the ratio extrema are ±inf by design when the call has no valid token)
            if not (
                all(math.isfinite(v) or (k in _EXTREMA and not math.isnan(v)) for k, v in metrics.items())
                and all(math.isfinite(v) for v in probes)
            ):
                loss, metrics, _ = self._call(next_token_logprobs, data, global_valid_seqs, global_valid_toks, False)
        return loss, metrics

    def _call(self, next_token_logprobs, data, global_valid_seqs, global_valid_toks, assume_finite: bool):
        cfg, g = self.cfg, self.granular
        b = read_policy_batch(next_token_logprobs, data, global_valid_seqs, global_valid_toks, cfg, assume_finite)
        index = None if g.granularity == "token" else self._index(b)
        if g.clip == "espo_entropy":
            self._check_espo_ready()
        objective, row_adv = self._objective, CHECK_HERE
        if self.enable_torch_compile:
            objective = self._compiled()
            if self._grouped(index):
                # the plan's data-dependent sizes and the advantage check sync with the host: done here,
                # so the compiled objective is one graph
                index.prepare()
                row_adv = row_constant(b.adv, b.valid)
        result: ObjectiveResult = objective(b, index, row_adv)
        loss = LinearizedLoss.apply(next_token_logprobs, -result.objective, result.grad, -1.0)
        penalized = self._penalties(loss, next_token_logprobs, b)
        with torch.no_grad():
            metrics = policy_metrics(b, result, penalized, cfg)
            # ours, diagnostics: at `minimal` only with the correction on (loss_metrics.MISMATCH_METRICS)
            if cfg.metrics_level == "full" or result.correction is not None:
                k3 = metrics.get("gen_kl_error") if cfg.reference_policy_kl_type == "k3" else None
                metrics.update(mismatch_metrics(b, result.ratios, result.correction, k3))
            names = list(metrics)
            # inputs whose ±inf a clamp or a truncation could hide from every metric: their sums
            terms = result.terms  # grouped: its probe covers ℓ, A (and H when summed) of every token
            probes = [terms.probe if result.grouped else result.ratios.log_ratio.sum()]
            if cfg.use_importance_sampling_correction:
                probes.append((b.prev - b.gen).sum())
            if g.needs_entropy and not (result.grouped and terms.entropy_sum is not None):
                probes.append(b.ent.sum())
            values = torch.stack([metrics[k] for k in names] + probes).tolist()  # one sync
        return penalized.loss, dict(zip(names, values[: len(names)])), values[len(names) :]

    def _objective(self, b: PolicyBatch, index, row_adv=CHECK_HERE) -> ObjectiveResult:
        """The tensor-only part (docs/algorithms/math.md §2–§5, off-policy weights §10): the objective
        J = Σ W·c, its gradient with respect to the logprobs, and what the metrics read. This is what
        ``enable_torch_compile`` compiles (``row_adv``: the grouped path's advantage check, made
        before it)."""
        cfg, g = self.cfg, self.granular
        if self._grouped(index):
            return self._grouped_objective(b, index, row_adv)
        ratios = group_ratios(b.logp, b.prev, b.valid, index, b.n_row, b.count_dtype)  # §2
        # clipped surrogate with per-group bounds: clip(s_g, lo_g, hi_g) on the group table, one gather
        group_clip = index is not None and g.clip != "fixed" and g.surrogate == "clipped"
        bounds, group_bounds = self._bounds(b, ratios, per_token=not group_clip)  # §3
        rc = None
        if group_clip:
            rc = index.gather(torch.clamp(ratios.group_ratio, *group_bounds))
            bounds = group_bounds  # the metrics read the group tables
        terms = surrogate_terms(g.surrogate, ratios.ratio, b.logp, b.adv, *bounds, cfg.ratio_clip_c, rc)  # §4
        if g.aggregation == "token_mean":  # §5
            weights = b.w_tok
        else:
            weights = aggregation_weights(
                g.aggregation,
                b.valid,
                b.sample_mask,
                b.inv_gvt,
                b.inv_gvs,
                b.n_row,
                index,
                ratios.counts,
                ratios.n_groups_row,
                b.count_dtype,
            )
        per_group_mean = g.aggregation == "seq_mean_group_mean" or (index is None and g.aggregation != "token_mean")
        fraction_weights = weights if per_group_mean else None
        corr = is_oob_ratio = None
        if cfg.use_importance_sampling_correction:  # off-policy correction π_old/π_gen (detached), §10
            corr, is_oob_ratio = self._importance_weights(b, ratios)
            weights = weights * corr.weight
        objective = (
            torch.dot(weights.reshape(-1), terms.value.reshape(-1))
            if weights.shape == terms.value.shape
            else (weights * terms.value).sum()
        )
        grad = objective_logp_grad(weights, terms, ratios, g.ratio, b.valid, b.count_dtype)
        return ObjectiveResult(
            objective, grad, ratios, terms, bounds, group_bounds, fraction_weights, corr, is_oob_ratio
        )

    def _grouped(self, index: GroupIndex | None) -> bool:
        """The clipped surrogate on an index of several groups per row, without per-token weights beyond
        the aggregation's: computed per group (:func:`~nemo_granular.core.objective.grouped_clipped_objective`)."""
        return (
            index is not None
            and not index.one_group_per_row
            and self.granular.surrogate == "clipped"
            and self.cfg.ratio_clip_c is None
            and not self.cfg.use_importance_sampling_correction
        )

    def _grouped_objective(self, b: PolicyBatch, index, row_adv=CHECK_HERE) -> ObjectiveResult:
        """:meth:`_objective` for :meth:`_grouped` (docs/algorithms/math.md §2–§5, per group)."""
        g = self.granular
        bounds = (1.0 - self.cfg.eps_low, 1.0 + self.cfg.eps_high) if g.clip == "fixed" else self._entropy_bounds
        objective, grad, ratios, group_bounds, clip, omega = grouped_clipped_objective(
            b.logp,
            b.prev,
            b.adv,
            b.valid,
            b.ent,
            index,
            g.ratio,
            bounds,
            g.aggregation,
            b.sample_mask,
            b.inv_gvt,
            b.inv_gvs,
            b.count_dtype,
            row_adv,
        )
        b.n_row = ratios.counts.sum(-1)  # the members are the valid tokens
        fraction_weights = omega if g.aggregation == "seq_mean_group_mean" else None
        return ObjectiveResult(objective, grad, ratios, clip, group_bounds, group_bounds, fraction_weights)

    def _compiled(self):
        """:meth:`_objective` under ``torch.compile``, built on first use (NeMo-RL's settings for its
        actor objective: dynamic shapes, ``max-autotune-no-cudagraphs``)."""
        if self._compiled_objective is None:
            self._compiled_objective = torch.compile(self._objective, dynamic=True, mode="max-autotune-no-cudagraphs")
        return self._compiled_objective

    # ------------------------------------------------------------------ the steps
    def _index(self, b: PolicyBatch) -> GroupIndex:
        """The :class:`~nemo_granular.core.group_index.GroupIndex` of the configured groups, whose members
        are the valid tokens (one group per row: no scatter)."""
        g, like = self.granular, b.logp
        if g.granularity == "sequence":
            return RowIndex(b.valid)
        if b.group_ids is not None:
            # the plans work on the ids as floats (small integers: exact below 2^24), so the range is
            # read on that copy (a contiguous float min/max costs ~1/4 of one on the int64 slice)
            ids = b.group_ids.to(like.dtype)
            lo, hi = torch.stack(torch.aminmax(ids)).tolist() if ids.numel() else (0.0, 0.0)  # one sync
            if hi >= like.shape[1] or lo < -1:
                bad = b.group_ids[(b.group_ids < -1) | (b.group_ids >= like.shape[1])][0]  # the id as given
                raise ValueError(
                    f"data['granular_group_ids'] holds id {int(bad)} outside "
                    f"-1..{like.shape[1] - 1} (ids must be per-row local, 0..G-1, -1 outside groups)"
                )
            top = int(hi) + 1  # the table needs only the ids in use
        elif g.granularity == "segment":
            if self.delimiter_table is None:
                raise ValueError(
                    "granular.granularity 'segment' needs a tokenizer (GranularPolicyLoss(..., "
                    "tokenizer=...)) or precomputed data['granular_group_ids']"
                )
            if b.token_ids is None:
                raise _missing("input_ids")
            ids = group_ids_for("segment", b.mask > 0, token_ids=b.token_ids, delimiter_table=self.delimiter_table)
            top = int(ids.max()) + 1 if ids.numel() else 1
        else:  # entropy_group: at most len(cut points) + 1 groups
            # ranked among the valid tokens, whose entropies are finite (read_policy_batch; the
            # dispatcher's own finiteness test would be two passes more); ids as floats, as the plans take them
            ids = entropy_group_ids(b.ent, b.valid > 0, g.entropy_cut_points, dtype=like.dtype)
            top = len(g.entropy_cut_points) + 1
        # ids are >= -1; the members of a group are its valid tokens (a token with an id but not
        # valid — masked, or non-finite — goes to no group)
        return make_group_index(ids, max(top, 1), like.dtype, member=b.valid)

    def _bounds(self, b: PolicyBatch, ratios, per_token: bool = True):
        """([lo, hi] per token, [lo, hi] per group): numbers for `fixed` (clamp broadcasts them),
        else from each unit's mean π_old entropy (docs/algorithms/math.md §3); ``per_token``
        False: the group tables only (None per token)."""
        g = self.granular
        if g.clip == "fixed":
            fixed = (1.0 - self.cfg.eps_low, 1.0 + self.cfg.eps_high)
            return fixed, fixed
        if ratios.index is None:
            return self._entropy_bounds(b.ent), None
        idx = ratios.index
        lo_g, hi_g = self._entropy_bounds(idx.sum(b.ent) / ratios.counts.clamp(min=1))
        if not per_token:
            return None, (lo_g, hi_g)
        return (idx.gather(lo_g), idx.gather(hi_g)), (lo_g, hi_g)

    def _entropy_bounds(self, mean_entropy):
        g = self.granular
        if g.clip == "sspo_entropy":
            return sspo_entropy_clip_bounds(mean_entropy, g.sspo.alpha, g.sspo.beta, g.sspo.gamma)
        return espo_entropy_clip_bounds(mean_entropy, g.espo.alpha, self.vocab_size)

    def _check_espo_ready(self) -> None:
        if self.vocab_size is None:
            raise ValueError("loss_fn.granular.espo.vocab_size is unset and no model vocabulary size was given")
        if self.espo_alpha_pending:
            raise ValueError(
                "loss_fn.granular.espo.alpha is 'auto' but no π_old pass has set it: call "
                "GranularPolicyLoss.calibrate_espo_alpha on the first rollout (the trainers do)"
            )

    def _importance_weights(self, b: PolicyBatch, ratios):
        """π_old/π_gen at ``is_level``, truncated as configured on the ratio's groups (math.md §10), and
        ``is_oob_ratio`` (NeMo-RL's: token share, or for seq-mask-tis the masked-unit share; None without
        a truncation)."""
        cfg = self.cfg
        kind = cfg.truncated_importance_sampling_type
        index = ratios.index
        mask_index, mask_counts = (index, ratios.counts) if index is not None else (RowIndex(b.valid), b.n_row[:, None])
        corr = generation_weights(
            b.prev,
            b.gen,
            b.valid,
            level=self.granular.is_level,
            index=index,
            counts=ratios.counts,
            kind=kind,
            ratio_max=cfg.truncated_importance_sampling_ratio,
            ratio_min=cfg.truncated_importance_sampling_ratio_min,
            mask_index=mask_index,
            mask_counts=mask_counts,
            count_dtype=b.count_dtype,
        )
        if kind == "seq-mask-tis":
            n_units = corr.unit_counts.clamp(max=1).sum(-1).clamp(min=1)
            return corr, (corr.oob_unit.sum(-1) / n_units * b.sample_mask).sum() * b.inv_gvs
        if kind is not None:
            return corr, (corr.oob_token * b.w_tok).sum()
        return corr, None

    def _penalties(self, loss, next_token_logprobs, b: PolicyBatch) -> PenalizedLoss:
        """loss + β·KL (aggregated like NeMo-RL's loss type) + w·NLL, VAPO's NLL on correct responses:

        NLL = −Σ_it logp_it·correct_it / (Σ correct + 1e-8),  correct_it = valid_it·sample_mask_i·[R_i > 0]
        (this microbatch's count, as NeMo-RL's)."""
        cfg = self.cfg
        zero = torch.zeros((), dtype=b.logp.dtype, device=b.logp.device)
        kl = nll = zero
        use_nll = cfg.positive_example_nll_weight > 0 and b.rewards is not None
        if self.reference_policy_kl_penalty == 0 and not use_nll:
            return PenalizedLoss(loss, kl, nll)
        valid = b.valid > 0
        logp = torch.where(valid, next_token_logprobs.to(b.logp.dtype), 0.0)  # autograd path for these terms
        if self.reference_policy_kl_penalty != 0:
            kl = self._kl(logp, b)
            loss = loss + kl
        if use_nll:
            correct = b.valid * b.sample_mask[:, None] * (b.rewards > 0).to(b.logp.dtype)[:, None]
            nll = -(logp * correct).sum() / plus_count_eps(correct.sum(), b.nll_count_dtype)
            loss = loss + cfg.positive_example_nll_weight * nll
        return PenalizedLoss(loss, kl, nll)

    def _kl(self, logp, b: PolicyBatch):
        """β·Agg[w·KL_k(π_θ ‖ π_ref)] (NeMo-RL's ``calculate_kl`` with its clamps; w = π_θ/π_gen under
        ``use_on_policy_kl_approximation``, else 1 with its gradient)."""
        cfg = self.cfg
        valid = b.valid > 0
        ref = torch.where(valid, b.ref_logp, 0.0)
        curr = logp if b.curr_logp is None else torch.where(valid, b.curr_logp, 0.0)
        if cfg.use_on_policy_kl_approximation:
            w = torch.exp((curr - b.gen).clamp(max=LOG_RATIO_BOUND))
        else:
            w = torch.exp(curr - curr.detach())
        w = torch.nan_to_num(w, nan=0.0, posinf=0.0, neginf=0.0)
        kl = self.reference_policy_kl_penalty * kl_penalty_per_token(
            curr, ref, cfg.reference_policy_kl_type, cfg.kl_input_clamp_value, cfg.kl_output_clamp_value, w
        )
        # NeMo-RL has two loss types: a token mean, or per response then over responses
        level = "token_mean" if cfg.token_level else "seq_mean_token_mean"
        weights = (
            b.w_tok
            if cfg.token_level
            else aggregation_weights(
                level, b.valid, b.sample_mask, b.inv_gvt, b.inv_gvs, b.n_row, count_dtype=b.count_dtype
            )
        )
        return (kl * weights).sum()


class SequenceValueLoss:
    """SPPO critic loss (SPPO §3.2; docs/algorithms/math.md §7): BCE-with-logits on V(s_p).

    NeMo-RL hands a value loss ``logits`` = the critic's values ``[B, S]`` (or ``[B, S, 1]``),
    already right-shifted by one: column t holds the head output at position t−1. The value
    of the prompt, read at the last prompt token, therefore sits at the first response column
    (the first 1 of ``token_mask``). loss = Σ_i sample_mask_i · BCE(v_i, R_i) / global_valid_seqs,
    R_i = ``data['rewards']`` ∈ {0, 1}.
    """

    input_type = HostMember(LossInputType.LOGIT)
    loss_type = HostMember(LossType.SEQUENCE_LEVEL)

    def __init__(self, cfg=None):
        self.cfg = dict(cfg or {})

    @property
    def metric_normalizations(self) -> dict:
        per_seq = resolve(MetricNormalizer.SEQUENCES)
        return {
            "loss": per_seq,
            "bce": per_seq,
            "acc": per_seq,
            "brier": per_seq,
            "values_mean": per_seq,
            "returns_mean": per_seq,
            "num_valid_samples": resolve(MetricNormalizer.NONE),
        }

    def __call__(
        self, logits: torch.Tensor, data: Mapping, global_valid_seqs, global_valid_toks, **kwargs
    ) -> tuple[torch.Tensor, dict]:
        values = logits.squeeze(-1) if logits.dim() == 3 else logits
        if values.dim() != 2:
            raise ValueError(f"value logits must be [B, S] or [B, S, 1], got shape {tuple(logits.shape)}")
        token_mask = data["token_mask"].to(values.device)
        if token_mask.shape[1] < values.shape[1] or token_mask.shape[0] != values.shape[0]:
            raise ValueError(
                f"data['token_mask'] has shape {tuple(token_mask.shape)} but the values have "
                f"shape {tuple(values.shape)}"
            )
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
