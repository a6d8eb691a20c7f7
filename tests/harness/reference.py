"""Naive float64 reference of docs/algorithms/math.md §1–§7, written independently of ``nemo_granular.core``.

Everything here is deliberately plain: Python loops over rows, tokens and groups, scalar
float64 torch arithmetic (so autograd gives reference gradients), exact rational cut points.
It is slow and only meant for small test batches. Nothing is imported from the package.

Also here:
- :func:`nemo_clipped_pg_loss`: the *semantics* of NeMo-RL's ``ClippedPGLossFn`` (token level,
  and GSPO mode ``sequence_level_importance_ratios=True, token_level_loss=False``), including
  KL k1/k2/k3 with input/output clamping, dual clip, VAPO NLL and the off-policy IS correction
  (tis / icepop / seq-mask-tis), re-derived from reading
  ``nemo_rl/algorithms/loss/loss_functions.py`` and ``nemo_rl/algorithms/utils.py``.
- :func:`nemo_baseline_and_std_per_prompt` / :func:`nemo_grpo_advantages`: the semantics of
  NeMo-RL's ``calculate_baseline_and_std_per_prompt`` + ``GRPOAdvantageEstimator``.
- :func:`sppo_official_advantages`: the official SPPO code's advantage (verl fork
  ``sustech-nlp/SPPO``, ``compute_sequence_level_advantage``): R = Σ token rewards,
  A = R − σ(v), returns = R.
- :func:`make_batch`: random NeMo-style batches (``[B, S]`` data keys, ``[B, S-1]`` logprobs).
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch

F64 = torch.float64
# NeMo-RL's masked_mean divides by (count + 1e-8); the granular loss forms every token mean so
COUNT_EPS = 1e-8

# ---------------------------------------------------------------------------------- helpers


def _finite(x) -> bool:
    return math.isfinite(float(x.detach()) if torch.is_tensor(x) else float(x))


def _f(x) -> float:
    return float(x.detach()) if torch.is_tensor(x) else float(x)


def _ceil_frac(q: float, n: int) -> int:
    """ceil(q·n) computed exactly (q read as the decimal the user wrote)."""
    return math.ceil(Fraction(str(q)) * n)


def ids_to_tensor(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long)


# ---------------------------------------------------------------------------------- §1 groups


def token_group_ids(mask) -> list[list[int]]:
    out = []
    for row in mask.tolist():
        k, ids = 0, []
        for m in row:
            if m:
                ids.append(k)
                k += 1
            else:
                ids.append(-1)
        out.append(ids)
    return out


def sequence_group_ids(mask) -> list[list[int]]:
    return [[0 if m else -1 for m in row] for row in mask.tolist()]


def segment_group_ids(token_ids, mask, delimiter_ids) -> list[list[int]]:
    """A valid delimiter token closes its segment; masked tokens (prompt, padding) are ignored."""
    delimiter_ids = set(int(d) for d in delimiter_ids)
    out = []
    for toks, row in zip(token_ids.tolist(), mask.tolist()):
        seg, ids = 0, []
        for tok, m in zip(toks, row):
            if not m:
                ids.append(-1)
                continue
            ids.append(seg)
            if tok in delimiter_ids:
                seg += 1
        out.append(ids)
    return out


def entropy_group_ids(entropy, mask, cuts) -> list[list[int]]:
    """Rank valid tokens by entropy (highest first, earlier position first on ties); the token of
    rank r goes to group #{k : r >= ceil(q_k·n)}; empty groups are dropped and ids compacted."""
    cuts = [cuts] if isinstance(cuts, (int, float)) else list(cuts)
    out = []
    for ent, row in zip(entropy.tolist(), mask.tolist()):
        pos = [t for t, m in enumerate(row) if m]
        n = len(pos)
        order = sorted(pos, key=lambda t: (-ent[t], t))
        ks = [_ceil_frac(q, n) for q in cuts]
        raw = {t: sum(1 for k in ks if r >= k) for r, t in enumerate(order)}
        present = sorted(set(raw.values()))
        remap = {g: j for j, g in enumerate(present)}
        out.append([remap[raw[t]] if t in raw else -1 for t in range(len(row))])
    return out


def groups_of_row(ids_row: list[int]) -> list[list[int]]:
    """Positions of each group of one row, by group id."""
    n = max(ids_row) + 1 if ids_row and max(ids_row) >= 0 else 0
    groups = [[] for _ in range(n)]
    for t, g in enumerate(ids_row):
        if g >= 0:
            groups[g].append(t)
    return [g for g in groups if g]


# ---------------------------------------------------------------------------------- §2 ratios


def group_log_ratio_means(logp, logq, ids: list[list[int]]) -> list[dict[int, float]]:
    out = []
    for i, row in enumerate(ids):
        acc: dict[int, list[float]] = {}
        for t, g in enumerate(row):
            if g >= 0:
                acc.setdefault(g, []).append(_f(logp[i, t]) - _f(logq[i, t]))
        out.append({g: sum(v) / len(v) for g, v in acc.items()})
    return out


def token_ratios(logp, logq, ids: list[list[int]], form: str, count_eps: float = 0.0):
    """r_it (float64, with autograd through ``logp``) for every valid token: dict (i, t) -> r.
    The group mean divides by |g| + ``count_eps`` (the loss: NeMo-RL's 1e-8, :data:`COUNT_EPS`)."""
    r = {}
    for i, row in enumerate(ids):
        for grp in groups_of_row(row):
            L = sum(logp[i, t] - logq[i, t] for t in grp) / (len(grp) + count_eps)
            s = torch.exp(L)
            for t in grp:
                if form == "shared":
                    r[(i, t)] = s
                else:
                    r[(i, t)] = s.detach() * torch.exp(logp[i, t] - logp[i, t].detach())
    return r


# ---------------------------------------------------------------------------------- §3 bounds


def fixed_bounds(eps_low, eps_high):
    return 1.0 - eps_low, 1.0 + eps_high


def sspo_bounds(h_mean, alpha, beta, gamma):
    """SSPO eq. 13–15."""
    hi = min(1.0 + alpha + h_mean, gamma)
    lo = max(0.0, min(1.0 - h_mean, beta))
    return lo, hi


def espo_bounds(h_mean, alpha, vocab_size):
    eps = alpha * h_mean / math.log(vocab_size)
    return 1.0 - eps, 1.0 + eps


# ---------------------------------------------------------------------------------- §4 surrogate


def clipped_term(r, A: float, lo: float, hi: float, dual_clip=None):
    """min(r·A, clip(r, lo, hi)·A) (+ dual clip) for one token; returns (c, clipped_low, clipped_high).

    ``r`` is a float64 0-d tensor (gradient flows where the min keeps the unclipped branch)."""
    rv = _f(r)
    if rv < lo:
        clipped = torch.tensor(lo, dtype=F64)
    elif rv > hi:
        clipped = torch.tensor(hi, dtype=F64)
    else:
        clipped = r
    a, b = r * A, clipped * A
    c = a if _f(a) <= _f(b) else b
    if dual_clip is not None and A < 0 and _f(c) < dual_clip * A:
        c = torch.tensor(dual_clip * A, dtype=F64)
    return c, (A < 0 and rv < lo), (A > 0 and rv > hi)


def cispo_term(r, logp_t, A: float, lo: float, hi: float):
    """CISPO for one token: sg[clip(r, lo, hi)]·A·logp; (c, weight clipped low, weight clipped high)."""
    rv = _f(r)
    w = min(max(rv, lo), hi)
    return w * A * logp_t, rv < lo, rv > hi


def reinforce_term(logp_t, A: float, dual_clip=None):
    """REINFORCE for one token: A·logp (dual clip for A < 0, as NeMo-RL applies it)."""
    c = A * logp_t
    if dual_clip is not None and A < 0 and _f(c) < dual_clip * A:
        c = torch.tensor(dual_clip * A, dtype=F64)
    return c, False, False


# ---------------------------------------------------------------------------------- §5 aggregation


def aggregate(
    per_token: dict, ids: list[list[int]], sample_mask, kind: str, gvs: float, gvt: float, count_eps: float = 0.0
):
    """Partial objective of this batch with global denominators ``gvs`` / ``gvt``; every token count
    (global, per response, per group) is taken + ``count_eps`` (the loss: :data:`COUNT_EPS`)."""
    gvs, gvt = gvs + count_eps, gvt + count_eps
    total = torch.zeros((), dtype=F64)
    for i, row in enumerate(ids):
        sm = float(sample_mask[i])
        toks = [t for t, g in enumerate(row) if g >= 0]
        if not toks or sm == 0:
            continue
        if kind == "token_mean":
            total = total + sm * sum(per_token[(i, t)] for t in toks) / gvt
        elif kind == "seq_mean_token_mean":
            total = total + sm * (sum(per_token[(i, t)] for t in toks) / (len(toks) + count_eps)) / gvs
        elif kind == "seq_mean_group_mean":
            grps = groups_of_row(row)
            gm = sum(sum(per_token[(i, t)] for t in g) / (len(g) + count_eps) for g in grps) / len(grps)
            total = total + sm * gm / gvs
        else:
            raise ValueError(kind)
    return total


# ---------------------------------------------------------------------------------- §6 advantages


def prompt_keys(prompt_ids) -> list:
    if prompt_ids.dim() == 1:
        return [int(x) for x in prompt_ids.tolist()]
    return [tuple(int(x) for x in row) for row in prompt_ids.tolist()]


def grpo_advantages(rewards, keys, valid=None, leave_one_out=False, normalize_std=True, eps=1e-6):
    """Spec §6 grpo (unbiased std; std 0 ⇒ no scaling; invalid ⇒ 0; no baseline ⇒ 0)."""
    R = [float(x) for x in rewards]
    B = len(R)
    valid = [True] * B if valid is None else [bool(v) for v in valid]
    out = []
    for i in range(B):
        if not valid[i]:
            out.append(0.0)
            continue
        others = [j for j in range(B) if keys[j] == keys[i] and valid[j] and (j != i or not leave_one_out)]
        if not others:
            out.append(0.0)
            continue
        vals = [R[j] for j in others]
        mean = sum(vals) / len(vals)
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else 0.0
        a = R[i] - mean
        if normalize_std and std > 0:
            a = a / (std + eps)
        out.append(a)
    return torch.tensor(out, dtype=F64)


def nemo_baseline_and_std_per_prompt(keys, rewards, valid_mask, leave_one_out: bool):
    """Semantics of NeMo-RL's ``calculate_baseline_and_std_per_prompt`` (float64, loops)."""
    R = [float(x) for x in rewards]
    v = [float(x) for x in valid_mask]
    B = len(R)
    base, std = [0.0] * B, [0.0] * B
    for key in dict.fromkeys(keys):
        idx = [j for j in range(B) if keys[j] == key]
        if sum(v[j] for j in idx) <= 1:
            for j in idx:
                base[j] = R[j]
            continue
        nv = sum(v[j] for j in idx) - int(leave_one_out)
        for j in idx:
            pool = [k for k in idx if not (leave_one_out and k == j)]
            b = sum(R[k] * v[k] for k in pool) / nv
            sq = sum(R[k] ** 2 * v[k] for k in pool) / nv
            base[j] = b
            var = (sq - b * b) * (nv / (nv - 1)) if nv != 1 else float("nan")
            std[j] = math.sqrt(var) if var == var and var >= 0 else 0.0
    return torch.tensor(base, dtype=F64), torch.tensor(std, dtype=F64)


def nemo_grpo_advantages(keys, rewards, leave_one_out: bool, normalize_rewards: bool):
    """NeMo-RL ``GRPOAdvantageEstimator`` semantics: all responses valid, A/(std+1e-6) where std>0."""
    base, std = nemo_baseline_and_std_per_prompt(keys, rewards, [1.0] * len(keys), leave_one_out)
    a = torch.tensor([float(x) for x in rewards], dtype=F64) - base
    if normalize_rewards:
        a = torch.where(std > 0, a / (std + 1e-6), a)
    return a


def espo_advantages(rewards, keys, failed, **kw):
    """ESPO §3.5: failed verifications get 0 and leave the prompt's statistics."""
    return grpo_advantages(rewards, keys, valid=[not bool(f) for f in failed], **kw)


def sppo_official_advantages(token_level_rewards, values, response_mask):
    """Official SPPO (``compute_sequence_level_advantage``): R = Σ_t rewards, A = R − σ(v)
    broadcast over the response mask, returns = R. float64, per response loop."""
    adv, ret = [], []
    for i in range(token_level_rewards.shape[0]):
        R = sum(float(x) for x in token_level_rewards[i])
        v = float(values[i])
        a = R - 1.0 / (1.0 + math.exp(-v))
        adv.append([a * float(m) for m in response_mask[i]])
        ret.append(R)
    return torch.tensor(adv, dtype=F64), torch.tensor(ret, dtype=F64)


def bce_with_logits(v: float, R: float) -> float:
    p = 1.0 / (1.0 + math.exp(-v))
    return -(R * math.log(p) + (1 - R) * math.log(1 - p))


# ---------------------------------------------------------------------------------- entropy


def entropy_and_logprob(logits, targets=None):
    """Float64 softmax: H = −Σ p log p (0·log 0 = 0) and log p(target), per position."""
    z = logits.double().reshape(-1, logits.shape[-1])
    H, LP = [], []
    tg = targets.reshape(-1).tolist() if targets is not None else None
    for n in range(z.shape[0]):
        row = z[n]
        m = float(row.max())
        ex = [math.exp(float(x) - m) if float(x) != float("-inf") else 0.0 for x in row]
        s = sum(ex)
        lse = m + math.log(s)
        h = 0.0
        for e, x in zip(ex, row.tolist()):
            if e > 0:
                p = e / s
                h -= p * (x - lse)
        H.append(h)
        if tg is not None:
            LP.append(float(row[tg[n]]) - lse)
    shape = logits.shape[:-1]
    Ht = torch.tensor(H, dtype=F64).reshape(shape)
    return (Ht, torch.tensor(LP, dtype=F64).reshape(shape)) if tg is not None else Ht


# ---------------------------------------------------------------------------------- KL


def kl_token(lp, lp_ref, kl_type="k3", in_clamp=20.0, out_clamp=10.0, w=None):
    """NeMo-RL ``calculate_kl`` semantics for one token (0-d float64 tensors)."""
    logr = lp_ref - lp
    if in_clamp is not None and abs(_f(logr)) > in_clamp:
        logr = torch.tensor(math.copysign(in_clamp, _f(logr)), dtype=F64)
        if w is not None:
            w = w.detach()
    if kl_type == "k1":
        kl = -logr
    elif kl_type == "k2":
        kl = logr * logr / 2
    elif kl_type == "k3":
        kl = torch.exp(logr) - 1 - logr
    else:
        raise ValueError(kl_type)
    if w is not None:
        kl = w * kl
    if out_clamp is not None and abs(_f(kl)) > out_clamp:
        kl = torch.tensor(math.copysign(out_clamp, _f(kl)), dtype=F64)
    return kl


# ---------------------------------------------------------------------------------- batches


DELIMITERS = (3, 7)  # token ids whose text "contains the delimiter" in synthetic batches


def delimiter_table(vocab: int, delimiter_ids=DELIMITERS) -> torch.Tensor:
    t = torch.zeros(vocab, dtype=torch.bool)
    for d in delimiter_ids:
        t[d] = True
    return t


def make_batch(
    B=4,
    S=14,
    V=16,
    seed=0,
    *,
    noise=(1e-4, 1e-2, 0.3),
    prompt_max=3,
    per_token_adv=False,
    zero_sample_rows=True,
    entropy_ties=False,
    left_pad=0,
    no_delimiters=False,
    gen_noise=0.05,
):
    """A random NeMo-RL-style batch: (data, next_token_logprobs, gvs, gvt).

    Rows are prompt (mask 0) + response (mask 1) + right padding (mask 0); ``left_pad`` adds that
    many masked columns in front. ``noise`` gives per-row scales of logp − logq so that some rows
    sit inside tight (GSPO) bounds and others are clipped. All floats are float32.
    """
    g = torch.Generator().manual_seed(seed)
    W = S + left_pad
    token_mask = torch.zeros(B, W)
    input_ids = torch.randint(0, V, (B, W), generator=g)
    if no_delimiters:
        for d in DELIMITERS:
            input_ids[input_ids == d] = (d + 1) % V
    for i in range(B):
        p = left_pad + 1 + int(torch.randint(0, prompt_max, (1,), generator=g))
        n = int(torch.randint(1, W - p + 1, (1,), generator=g))
        token_mask[i, p : p + n] = 1
    sample_mask = torch.ones(B)
    if zero_sample_rows and B > 2:
        sample_mask[int(torch.randint(0, B, (1,), generator=g))] = 0.0
    prev = -torch.rand(B, W, generator=g) * 3 - 0.05
    scales = torch.tensor([noise[i % len(noise)] for i in range(B)])[:, None]
    logp = prev + torch.randn(B, W, generator=g) * scales
    gen = prev + torch.randn(B, W, generator=g) * gen_noise
    ref = prev + torch.randn(B, W, generator=g) * 0.2
    if per_token_adv:
        adv = torch.randn(B, W, generator=g)
    else:
        adv = torch.randn(B, 1, generator=g).expand(B, W).clone()
    if entropy_ties:
        ent = torch.randint(0, 4, (B, W), generator=g).float() * 0.5
    else:
        ent = torch.rand(B, W, generator=g) * 2.5
    adv = adv * token_mask
    data = {
        "input_ids": input_ids,
        "input_lengths": (token_mask.cumsum(-1).argmax(-1) + 1),
        "token_mask": token_mask,
        "sample_mask": sample_mask,
        "advantages": adv.float(),
        "prev_logprobs": prev.float() * token_mask,
        "generation_logprobs": gen.float() * token_mask,
        "reference_policy_logprobs": ref.float() * token_mask,
        "prev_entropy": ent.float() * token_mask,
    }
    nt_logp = (logp * token_mask)[:, 1:].float().contiguous()
    gvs = float(sample_mask.sum())
    gvt = float((token_mask[:, 1:] * sample_mask[:, None]).sum())
    return data, nt_logp, gvs, gvt


def row_lengths(data) -> list[int]:
    """Unpadded length of each row: last response column + 1 (what the packing wrapper slices to)."""
    out = []
    for row in data["token_mask"].tolist():
        last = max([t for t, m in enumerate(row) if m], default=0)
        out.append(last + 1)
    return out


# ---------------------------------------------------------------------------------- full losses


def _shifted(data, name):
    return data[name][:, 1:].double()


def granular_loss(
    logp,
    data,
    *,
    granularity,
    ratio,
    clip,
    aggregation,
    eps_low=0.2,
    eps_high=0.2,
    sspo=(0.0, 0.8, 1.75),
    espo_alpha=1.0,
    vocab_size=None,
    cuts=(0.2,),
    delimiter_ids=DELIMITERS,
    gvs,
    gvt,
    dual_clip=None,
    kl=None,
    surrogate="clipped",
    count_eps=COUNT_EPS,
    offpolicy=None,
):
    """Spec §1–§5 for a NeMo-style batch, float64: returns (loss, metrics).

    Every mean over tokens (group log-ratio, per-response and per-group means, the global token
    and sequence counts) divides by count + ``count_eps``, NeMo-RL's ``masked_mean`` regulariser
    (docs/algorithms/math.md, Notation).

    ``offpolicy`` = dict(level, kind, hi, lo): each c_it is multiplied by the π_old/π_gen weight of
    :func:`offpolicy_weights` (math.md §10); ``metrics["offpolicy"]`` then holds its diagnostics.

    ``logp`` is a float64 ``[B, S-1]`` leaf (gradient reference). Non-finite tokens (logp, logq,
    advantage or, when used, entropy) are excluded. ``kl`` = dict(coef, type, in_clamp, out_clamp).
    ``surrogate``: clipped | cispo | reinforce (§4); REINFORCE's "ratio" metrics are of logp, as
    NeMo-RL reports them.
    """
    B, T = logp.shape
    tm = data["token_mask"][:, 1:]
    sm = data["sample_mask"].double().reshape(-1)
    adv, logq = _shifted(data, "advantages"), _shifted(data, "prev_logprobs")
    ent = _shifted(data, "prev_entropy") if "prev_entropy" in data else None
    uses_entropy = granularity == "entropy_group" or clip != "fixed"
    valid = torch.zeros(B, T, dtype=torch.bool)
    for i in range(B):
        for t in range(T):
            ok = bool(tm[i, t] > 0) and _finite(logp[i, t]) and _finite(logq[i, t]) and _finite(adv[i, t])
            if uses_entropy:
                ok = ok and _finite(ent[i, t])
            valid[i, t] = ok
    if granularity == "token":
        ids = token_group_ids(valid)
    elif granularity == "sequence":
        ids = sequence_group_ids(valid)
    elif granularity == "segment":
        ids = segment_group_ids(data["input_ids"][:, 1:], valid, delimiter_ids)
    else:
        ids = entropy_group_ids(ent, valid, list(cuts))
    # token groups are no mean (NeMo-RL's exp(logp − logq)); their per-group mean is the token mean
    r = token_ratios(logp, logq, ids, ratio, count_eps if granularity != "token" else 0.0)
    if granularity == "token" and aggregation == "seq_mean_group_mean":
        aggregation = "seq_mean_token_mean"
    c, lows, highs, los, his = {}, {}, {}, {}, {}
    for i, row in enumerate(ids):
        for grp in groups_of_row(row):
            if clip == "fixed":
                lo, hi = fixed_bounds(eps_low, eps_high)
            else:
                hm = sum(float(ent[i, t]) for t in grp) / len(grp)
                lo, hi = sspo_bounds(hm, *sspo) if clip == "sspo_entropy" else espo_bounds(hm, espo_alpha, vocab_size)
            for t in grp:
                if surrogate == "cispo":
                    term = cispo_term(r[(i, t)], logp[i, t], float(adv[i, t]), lo, hi)
                elif surrogate == "reinforce":
                    term = reinforce_term(logp[i, t], float(adv[i, t]), dual_clip)
                    r[(i, t)] = logp[i, t]
                else:
                    term = clipped_term(r[(i, t)], float(adv[i, t]), lo, hi, dual_clip)
                c[(i, t)], lows[(i, t)], highs[(i, t)] = term
                los[(i, t)], his[(i, t)] = lo, hi
    if offpolicy is not None:
        w_is, oob, share = offpolicy_weights(data, ids, granularity, **offpolicy, count_eps=count_eps)
        c = {k: v * w_is[k] for k, v in c.items()}
    loss = -aggregate(c, ids, sm, aggregation, gvs, gvt, count_eps)
    if kl is not None and kl.get("coef", 0):
        ref = _shifted(data, "reference_policy_logprobs")
        per = {}
        for i, row in enumerate(ids):
            for t, gid in enumerate(row):
                if gid >= 0:
                    w = torch.exp(logp[i, t] - logp[i, t].detach())
                    per[(i, t)] = kl["coef"] * kl_token(
                        logp[i, t],
                        ref[i, t],
                        kl.get("type", "k3"),
                        kl.get("in_clamp", 20.0),
                        kl.get("out_clamp", 10.0),
                        w,
                    )
        kind = "token_mean" if aggregation == "token_mean" else "seq_mean_token_mean"
        loss = loss + aggregate(per, ids, sm, kind, gvs, gvt, count_eps)
    # metrics
    gvs, gvt = gvs + count_eps, gvt + count_eps
    m = {
        "clip_frac_low": 0.0,
        "clip_frac_high": 0.0,
        "probs_ratio": 0.0,
        "groups_per_response": 0.0,
        "group_size_mean": 0.0,
        "clip_bound_low_mean": 0.0,
        "clip_bound_high_mean": 0.0,
    }
    rmin, rmax = float("inf"), float("-inf")
    for i, row in enumerate(ids):
        s = float(sm[i])
        grps = groups_of_row(row)
        n = sum(len(g_) for g_ in grps)
        m["groups_per_response"] += s * len(grps) / gvs
        m["group_size_mean"] += s * (n / len(grps) if grps else 0.0) / gvs
        for grp in grps:
            for t in grp:
                m["clip_frac_low"] += s * lows[(i, t)] / gvt
                m["clip_frac_high"] += s * highs[(i, t)] / gvt
                m["probs_ratio"] += s * _f(r[(i, t)]) / gvt
                m["clip_bound_low_mean"] += s * los[(i, t)] / gvt
                m["clip_bound_high_mean"] += s * his[(i, t)] / gvt
                if s != 0:
                    rmin, rmax = min(rmin, _f(r[(i, t)])), max(rmax, _f(r[(i, t)]))
    m["probs_ratio_min"], m["probs_ratio_max"] = rmin, rmax
    m["nonfinite_tokens"] = float(
        sum(1 for i in range(B) for t in range(T) if tm[i, t] > 0 and not valid[i, t] and sm[i] != 0)
    )
    if offpolicy is not None:
        m["offpolicy"] = mismatch_metrics(data, ids, sm, gvs, gvt, w_is, oob, share, granularity, count_eps)
    return loss, m


def offpolicy_weights(data, ids, granularity, level, kind=None, hi=None, lo=None, count_eps=0.0):
    """math.md §10 with loops: the π_old/π_gen weight of every valid token after truncation, whether it
    was truncated or masked, and per row the share of the ratio's groups touched (dicts / list).

    level token: exp(δ_t); group_sum: exp(Σ_g δ); group_mean: exp(mean_g δ). tis clamps and icepop
    zeroes each weight outside [lo, hi]; seq-mask-tis zeroes every group (the whole row for token
    groups) whose exp(mean δ) is outside [lo, hi]. Means divide by count + ``count_eps``."""
    q, gen = _shifted(data, "prev_logprobs"), _shifted(data, "generation_logprobs")
    w, oob, share = {}, {}, []
    for i, row in enumerate(ids):
        grps = groups_of_row(row)
        d = {t: float(q[i, t]) - float(gen[i, t]) for grp in grps for t in grp}
        for grp in grps:
            s_ = sum(d[t] for t in grp)
            for t in grp:
                if level == "token" or granularity == "token":
                    w[(i, t)] = math.exp(d[t])
                else:
                    w[(i, t)] = math.exp(s_ if level == "group_sum" else s_ / (len(grp) + count_eps))
                oob[(i, t)] = False
        toks = [t for grp in grps for t in grp]
        if kind in ("tis", "icepop"):
            low = (0.0 if lo is None else lo) if kind == "tis" else lo
            for t in toks:
                if not low <= w[(i, t)] <= hi:
                    oob[(i, t)] = True
                    w[(i, t)] = min(max(w[(i, t)], low), hi) if kind == "tis" else 0.0
        elif kind == "seq-mask-tis":
            for unit in [toks] if granularity == "token" and toks else grps:
                if not lo <= math.exp(sum(d[t] for t in unit) / (len(unit) + count_eps)) <= hi:
                    for t in unit:
                        oob[(i, t)], w[(i, t)] = True, 0.0
        share.append(sum(1 for grp in grps if any(oob[(i, t)] for t in grp)) / len(grps) if grps else 0.0)
    return w, oob, share


def mismatch_metrics(data, ids, sm, gvs, gvt, w_is, oob, share, granularity="group", count_eps=0.0):
    """math.md §10.3 with loops (global denominators gvt / gvs; rows with sample_mask 0 count 0);
    token means divide by count + ``count_eps`` (token groups: the row's mean of |δ|)."""
    q, gen = _shifted(data, "prev_logprobs"), _shifted(data, "generation_logprobs")
    m = dict.fromkeys(
        (
            "gen_mismatch_abs_mean",
            "gen_kl_k3",
            "gen_mismatch_group_abs_mean",
            "is_oob_token_frac",
            "is_oob_group_frac",
            "sampling_importance_ratio_tokens",
        ),
        0.0,
    )
    for i, row in enumerate(ids):
        s = float(sm[i])
        grps = groups_of_row(row)
        if not grps or s == 0:
            continue
        d = {t: float(q[i, t]) - float(gen[i, t]) for grp in grps for t in grp}
        for t, dt in d.items():
            m["gen_mismatch_abs_mean"] += s * abs(dt) / gvt
            m["gen_kl_k3"] += s * (math.exp(dt) - 1 - dt) / gvt
            m["is_oob_token_frac"] += s * float(oob[(i, t)]) / gvt
            m["sampling_importance_ratio_tokens"] += s * w_is[(i, t)] / gvt
        if granularity == "token":
            m["gen_mismatch_group_abs_mean"] += s * sum(abs(dt) for dt in d.values()) / (len(d) + count_eps) / gvs
        else:
            m["gen_mismatch_group_abs_mean"] += (
                s * sum(abs(sum(d[t] for t in g) / (len(g) + count_eps)) for g in grps) / len(grps) / gvs
            )
        m["is_oob_group_frac"] += s * share[i] / gvs
    return m


PRESET_SPECS = {
    # docs/algorithms/math.md §8, written out here independently of nemo_granular.config.PRESETS
    "grpo": dict(
        granularity="token", ratio="shared", clip="fixed", aggregation="token_mean", eps=(0.2, 0.2), surrogate="clipped"
    ),
    "gspo": dict(
        granularity="sequence",
        ratio="shared",
        clip="fixed",
        aggregation="seq_mean_token_mean",
        eps=(3e-4, 4e-4),
        surrogate="clipped",
    ),
    "gspo_token": dict(
        granularity="sequence",
        ratio="token_decomposed",
        clip="fixed",
        aggregation="seq_mean_token_mean",
        eps=(3e-4, 4e-4),
        surrogate="clipped",
    ),
    "sspo": dict(
        granularity="segment",
        ratio="shared",
        clip="sspo_entropy",
        aggregation="seq_mean_token_mean",
        eps=(0.2, 0.2),
        surrogate="clipped",
    ),
    "sspo_no_ec": dict(
        granularity="segment",
        ratio="shared",
        clip="fixed",
        aggregation="seq_mean_token_mean",
        eps=(0.2, 0.2),
        surrogate="clipped",
    ),
    "espo": dict(
        granularity="entropy_group",
        ratio="token_decomposed",
        clip="espo_entropy",
        aggregation="seq_mean_group_mean",
        eps=(0.2, 0.2),
        surrogate="clipped",
    ),
    "sppo": dict(
        granularity="token", ratio="shared", clip="fixed", aggregation="token_mean", eps=(0.2, 0.2), surrogate="clipped"
    ),
    "cispo": dict(
        granularity="token", ratio="shared", clip="fixed", aggregation="token_mean", eps=(0.2, 0.2), surrogate="cispo"
    ),
    "reinforce": dict(
        granularity="token",
        ratio="shared",
        clip="fixed",
        aggregation="token_mean",
        eps=(0.2, 0.2),
        surrogate="reinforce",
    ),
}


def preset_loss(name, logp, data, *, gvs, gvt, vocab_size=16, **over):
    spec = dict(PRESET_SPECS[name])
    eps_low, eps_high = spec.pop("eps")
    spec.update(over)
    spec.setdefault("eps_low", eps_low)
    spec.setdefault("eps_high", eps_high)
    return granular_loss(logp, data, vocab_size=vocab_size, gvs=gvs, gvt=gvt, **spec)


def nemo_clipped_pg_loss(logp, data, cfg: dict, gvs: float, gvt: float):
    """Semantics of NeMo-RL's ``ClippedPGLossFn.__call__`` (float64, loops), returns (loss, metrics).

    Supports token level (``token_level_loss=True``), per-sequence loss (``False``) and GSPO mode
    (``sequence_level_importance_ratios=True, token_level_loss=False``); KL k1/k2/k3 with clamps
    and on-policy approximation; dual clip; IS correction tis / icepop / seq-mask-tis; VAPO NLL;
    CISPO (``use_cispo``), REINFORCE (``disable_ppo_ratio``: the "ratio" is the logprob) and
    ``force_on_policy_ratio`` (ratio exp(logp − sg[logp]), unclamped, checked first).
    """
    B, T = logp.shape
    eps_lo, eps_hi = cfg.get("ratio_clip_min", 0.2), cfg.get("ratio_clip_max", 0.2)
    C = cfg.get("ratio_clip_c")
    coef = 0.0 if cfg.get("use_kl_in_reward") else cfg.get("reference_policy_kl_penalty", 0.01)
    kl_type = cfg.get("reference_policy_kl_type", "k3")
    token_level = cfg.get("token_level_loss", True)
    seq_level = cfg.get("sequence_level_importance_ratios", False)
    tm = data["token_mask"][:, 1:].double()
    sm = data["sample_mask"].double().reshape(-1)
    A = _shifted(data, "advantages")
    q = logp.detach().clone() if cfg.get("force_on_policy_ratio") else _shifted(data, "prev_logprobs")
    gen = _shifted(data, "generation_logprobs")
    mask = [[float(tm[i, t]) * float(sm[i]) for t in range(T)] for i in range(B)]

    def tok_mean(fn):
        return sum(fn(i, t) * mask[i][t] for i in range(B) for t in range(T) if mask[i][t]) / (gvt + 1e-8)

    def row_tok_mean(i, fn):
        n = sum(float(tm[i, t]) for t in range(T))
        return sum(fn(i, t) * float(tm[i, t]) for t in range(T) if tm[i, t]) / (n + 1e-8)

    def seq_agg(fn):
        return sum(row_tok_mean(i, fn) * float(sm[i]) for i in range(B) if sm[i]) / (gvs + 1e-8)

    agg = tok_mean if token_level else seq_agg

    # ratios
    ratio = {}
    for i in range(B):
        if cfg.get("force_on_policy_ratio"):
            for t in range(T):
                ratio[(i, t)] = torch.exp(logp[i, t] - logp[i, t].detach())
        elif cfg.get("disable_ppo_ratio"):
            for t in range(T):
                ratio[(i, t)] = logp[i, t]
        elif seq_level:
            n = sum(float(tm[i, t]) for t in range(T))
            L = sum((logp[i, t] - q[i, t]) * float(tm[i, t]) for t in range(T) if tm[i, t]) / (n + 1e-8)
            s = torch.exp(L) if n else torch.ones((), dtype=F64)
            for t in range(T):
                ratio[(i, t)] = s
        else:
            for t in range(T):
                ratio[(i, t)] = torch.exp(logp[i, t] - q[i, t])
    if cfg.get("force_on_policy_ratio") or cfg.get("disable_ppo_ratio"):
        clamped = dict(ratio)
    else:
        clamped = {k: v.clamp(1 - eps_lo, 1 + eps_hi) for k, v in ratio.items()}
    clip_loss = {}
    for (i, t), r in ratio.items():
        a = float(A[i, t])
        if cfg.get("use_cispo"):
            cl = -a * clamped[(i, t)].detach() * logp[i, t]
        else:
            l1, l2 = -a * r, -a * clamped[(i, t)]
            cl = l1 if _f(l1) >= _f(l2) else l2
        if C is not None and a < 0 and _f(cl) > -a * C:
            cl = torch.tensor(-a * C, dtype=F64)
        clip_loss[(i, t)] = cl

    # IS weights
    is_w, metrics = {}, {}
    if seq_level:
        for i in range(B):
            w = math.exp(sum((float(q[i, t]) - float(gen[i, t])) * mask[i][t] for t in range(T)))
            for t in range(T):
                is_w[(i, t)] = w
    else:
        for i in range(B):
            for t in range(T):
                is_w[(i, t)] = math.exp(float(q[i, t]) - float(gen[i, t]))
    kind = cfg.get("truncated_importance_sampling_type")
    hi_t, lo_t = cfg.get("truncated_importance_sampling_ratio"), cfg.get("truncated_importance_sampling_ratio_min")
    if hi_t is not None:
        if kind == "tis":
            lo_ = 0.0 if lo_t is None else lo_t
            metrics["is_oob_ratio"] = tok_mean(lambda i, t: float(is_w[(i, t)] > hi_t or is_w[(i, t)] < lo_))
            is_w = {k: min(max(w, lo_), hi_t) for k, w in is_w.items()}
        elif kind == "icepop":
            metrics["is_oob_ratio"] = tok_mean(lambda i, t: float(not lo_t <= is_w[(i, t)] <= hi_t))
            is_w = {k: (w if lo_t <= w <= hi_t else 0.0) for k, w in is_w.items()}
        elif kind == "seq-mask-tis":
            keep = []
            for i in range(B):
                n = sum(float(tm[i, t]) for t in range(T))
                geo = math.exp(
                    sum((float(q[i, t]) - float(gen[i, t])) * float(tm[i, t]) for t in range(T)) / (n + 1e-8)
                )
                keep.append(1.0 if lo_t <= geo <= hi_t else 0.0)
            metrics["is_oob_ratio"] = sum((1 - keep[i]) * float(sm[i]) for i in range(B)) / (gvs + 1e-8)
            is_w = {(i, t): w * keep[i] for (i, t), w in is_w.items()}
    use_is = cfg.get("use_importance_sampling_correction", False)
    loss = agg(lambda i, t: (is_w[(i, t)] if use_is else 1.0) * clip_loss[(i, t)])

    if coef != 0:
        ref = _shifted(data, "reference_policy_logprobs")

        def kl_fn(i, t):
            if cfg.get("use_on_policy_kl_approximation"):
                w = torch.exp(logp[i, t] - gen[i, t])
            else:
                w = torch.exp(logp[i, t] - logp[i, t].detach())
            return coef * kl_token(
                logp[i, t],
                ref[i, t],
                kl_type,
                cfg.get("kl_input_clamp_value", 20.0),
                cfg.get("kl_output_clamp_value", 10.0),
                w,
            )

        kl = agg(kl_fn)
        loss = loss + kl
        metrics["kl_penalty"] = _f(kl) / coef
    nll_w = cfg.get("positive_example_nll_weight", 0.0)
    if nll_w > 0 and "rewards" in data:
        corr = [[mask[i][t] * float(float(data["rewards"][i]) > 0) for t in range(T)] for i in range(B)]
        n = sum(sum(r_) for r_ in corr)
        if n > 0:
            nll = sum(-logp[i, t] * corr[i][t] for i in range(B) for t in range(T) if corr[i][t]) / (n + 1e-8)
            loss = loss + nll_w * nll
            metrics["positive_nll_loss"] = _f(nll)

    live = [(i, t) for i in range(B) for t in range(T) if mask[i][t]]
    metrics["probs_ratio"] = float(tok_mean(lambda i, t: _f(ratio[(i, t)])))
    metrics["probs_ratio_clamped"] = float(tok_mean(lambda i, t: _f(clamped[(i, t)])))
    metrics["probs_ratio_min"] = min((_f(ratio[k]) for k in live), default=float("inf"))
    metrics["probs_ratio_max"] = max((_f(ratio[k]) for k in live), default=float("-inf"))
    metrics["probs_ratio_clamped_min"] = min((_f(clamped[k]) for k in live), default=float("inf"))
    metrics["probs_ratio_clamped_max"] = max((_f(clamped[k]) for k in live), default=float("-inf"))
    metrics["token_mult_prob_error"] = tok_mean(lambda i, t: math.exp(abs(float(gen[i, t]) - float(q[i, t]))))

    def kl_f(a, b):  # calculate_kl(logprobs=a, logprobs_reference=b) without clamps, as a float
        return float(kl_token(torch.tensor(a, dtype=F64), torch.tensor(b, dtype=F64), kl_type, None, None))

    metrics["gen_kl_error"] = tok_mean(lambda i, t: kl_f(float(gen[i, t]), float(q[i, t])))
    metrics["policy_kl_error"] = tok_mean(lambda i, t: kl_f(float(q[i, t]), float(gen[i, t])))

    def js(i, t):
        p, g_ = float(q[i, t]), float(gen[i, t])
        lm = math.log(0.5 * math.exp(p) + 0.5 * math.exp(g_))
        return 0.5 * (math.exp(p - lm) - (p - lm) - 1) + 0.5 * (math.exp(g_ - lm) - (g_ - lm) - 1)

    metrics["js_divergence_error"] = tok_mean(js)
    metrics["approx_entropy"] = -tok_mean(lambda i, t: math.exp(_f(logp[i, t]) - float(gen[i, t])) * _f(logp[i, t]))
    if not seq_level:
        metrics["sampling_importance_ratio"] = tok_mean(lambda i, t: is_w[(i, t)])
    metrics["num_valid_samples"] = float(sm.sum())
    metrics["loss"] = _f(loss)
    return loss, metrics


# ---------------------------------------------------------------------------------- test helpers


def run_loss(fn, logp, data, gvs, gvt):
    """Call a NeMo-RL-style LOGPROB loss on a float32 copy of ``logp``: (loss f64, grad f64, metrics)."""
    lp = logp.detach().clone().float().requires_grad_(True)
    loss, metrics = fn(
        next_token_logprobs=lp,
        data=data,
        global_valid_seqs=torch.tensor(float(gvs)),
        global_valid_toks=torch.tensor(float(gvt)),
    )
    loss.backward()
    grad = lp.grad if lp.grad is not None else torch.zeros_like(lp)
    return loss.detach().double(), grad.double(), metrics


def run_ref(ref_fn, logp, *args, **kw):
    """Call a reference loss on a float64 leaf copy of ``logp``: (loss, grad, metrics)."""
    lp = logp.detach().clone().double().requires_grad_(True)
    loss, metrics = ref_fn(lp, *args, **kw)
    if torch.is_tensor(loss) and loss.requires_grad:
        loss.backward()
    grad = lp.grad if lp.grad is not None else torch.zeros_like(lp)
    return torch.as_tensor(loss, dtype=F64).detach(), grad, metrics


def assert_close(actual, expected, rtol=1e-6, atol=1e-7, what=""):
    """|a − e| <= atol + rtol·max|e| elementwise (float64 comparison)."""
    a = actual.detach().to(F64) if torch.is_tensor(actual) else torch.as_tensor(actual, dtype=F64)
    e = expected.detach().to(F64) if torch.is_tensor(expected) else torch.as_tensor(expected, dtype=F64)
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    scale = float(e.abs().max()) if e.numel() else 0.0
    err = float((a - e).abs().max()) if e.numel() else 0.0
    assert err <= atol + rtol * scale, f"{what}: max abs err {err:.3g} (scale {scale:.3g})\n{a}\n{e}"
