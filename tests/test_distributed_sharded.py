"""Sharded math in REAL torch.distributed gloo processes (4 ranks, one process group per module).

Every rank builds the same full float64 logits from a shared seed, takes its shard exactly as
Megatron/DTensor would hand it over (vocabulary slice over TP, 2·CP zig-zag over CP, packed
rows), runs ``nemo_granular.distributed`` and compares values AND gradients with the
single-process computation (``torch.log_softmax`` on the full tensor) — tolerance 1e-6.
"""

from __future__ import annotations

import pytest
import torch

from dist_utils import DistPool

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # ~30-50 s on the shared 2-core machine
TOL = 1e-6


@pytest.fixture(scope="module")
def pool():
    p = DistPool(4)
    yield p
    p.close()


def _ref(logits, targets):
    logp = torch.log_softmax(logits, -1)
    lp = logp.gather(-1, targets[..., None]).squeeze(-1)
    p = logp.exp()
    safe = torch.where(p > 0, logp, torch.zeros_like(logp))  # 0·log 0 = 0 for masked entries
    ent = -(p * safe).sum(-1)
    return lp, ent


def _groups(world, sizes_tp):
    """(tp_group, cp_group, tp_rank, cp_rank) for a TP-major layout rank = cp_rank·TP + tp_rank."""
    import torch.distributed as dist

    rank = dist.get_rank()
    tp = sizes_tp
    cp = world // tp
    tp_groups = [dist.new_group(list(range(c * tp, (c + 1) * tp))) for c in range(cp)]
    cp_groups = [dist.new_group(list(range(t, world, tp))) for t in range(tp)]
    return tp_groups[rank // tp], cp_groups[rank % tp], rank % tp, rank // tp


# ----------------------------------------------------------------------------- rank tasks
def task_vocab_parallel(rank, world, tp, chunk_size):
    from nemo_granular.distributed import (
        vocab_parallel_entropy,
        vocab_parallel_logprob,
        vocab_parallel_logprob_and_entropy,
    )

    tp_group, _, tp_rank, _ = _groups(world, tp)
    gen = torch.Generator().manual_seed(7)
    B, S, V = 3, 5, 24
    full = torch.randn(B, S, V, generator=gen, dtype=torch.float64) * 3
    full[0, 0, 5] = float("-inf")  # a masked vocabulary entry (top-k style)
    tgt = torch.randint(0, V, (B, S), generator=gen)
    w_lp, w_h = (
        torch.randn(B, S, generator=gen, dtype=torch.float64),
        torch.randn(B, S, generator=gen, dtype=torch.float64),
    )
    ref_in = full.clone().requires_grad_(True)
    lp_ref, h_ref = _ref(ref_in, tgt)
    g_ref = torch.autograd.grad((lp_ref * w_lp).sum() + (h_ref * w_h).sum(), ref_in)[0]
    g_ref_lp = torch.autograd.grad((_ref(ref_in, tgt)[0] * w_lp).sum(), ref_in)[0]

    vl = V // tp
    sl = slice(tp_rank * vl, (tp_rank + 1) * vl)
    local = full[..., sl].clone().requires_grad_(True)
    lp, h = vocab_parallel_logprob_and_entropy(local, tgt, tp_group, chunk_size=chunk_size)
    g = torch.autograd.grad((lp * w_lp).sum() + (h * w_h).sum(), local)[0]
    local2 = full[..., sl].clone().requires_grad_(True)
    lp_only = vocab_parallel_logprob(local2, tgt, tp_group, chunk_size=chunk_size)
    g_lp = torch.autograd.grad((lp_only * w_lp).sum(), local2)[0]
    with torch.no_grad():
        h_only = vocab_parallel_entropy(full[..., sl], tp_group, chunk_size=chunk_size)
    return dict(
        lp=(lp - lp_ref).abs().max().item(),
        h=(h - h_ref).abs().max().item(),
        grad=(g - g_ref[..., sl]).abs().max().item(),
        lp_only=(lp_only - lp_ref).abs().max().item(),
        grad_lp_only=(g_lp - g_ref_lp[..., sl]).abs().max().item(),
        h_only=(h_only - h_ref).abs().max().item(),
        finite=bool(torch.isfinite(g).all()),
    )


def _packed_problem(gen, B, S, V, lengths):
    ids = torch.randint(0, V, (B, S), generator=gen)
    logits = torch.randn(B, S, V, generator=gen, dtype=torch.float64) * 2
    w_lp = torch.randn(B, S, generator=gen, dtype=torch.float64)
    w_h = torch.randn(B, S, generator=gen, dtype=torch.float64)
    valid = torch.arange(S)[None, :] < lengths[:, None]
    return ids, logits, w_lp * valid, w_h * valid


def task_cp_tp(rank, world, packed):
    """CP=2 zig-zag × TP=2, packing on/off: the Megatron get_logprobs/LOGIT-loss data path."""
    from nemo_granular.distributed import (
        gather_sequence,
        pack_sequences,
        unpack_sequences,
        vocab_parallel_logprob_and_entropy,
        zigzag_shard,
    )

    tp_group, cp_group, tp_rank, cp_rank = _groups(world, 2)
    cp = 2
    gen = torch.Generator().manual_seed(11)
    V = 16
    vl = V // 2
    sl = slice(tp_rank * vl, (tp_rank + 1) * vl)
    if packed:
        B, S = 3, 9
        lengths = torch.tensor([9, 3, 6])
    else:
        B, S = 1, 12
        lengths = torch.tensor([12])
    ids, logits, w_lp, w_h = _packed_problem(gen, B, S, V, lengths)

    # single-process reference in NeMo-RL's shifted layout: column j = token j (j >= 1)
    ref_in = logits.clone().requires_grad_(True)
    lp_ref, h_ref = _ref(ref_in[:, :-1], ids[:, 1:])
    lp_rows = torch.cat([torch.zeros(B, 1, dtype=torch.float64), lp_ref], 1)
    h_rows = torch.cat([torch.zeros(B, 1, dtype=torch.float64), h_ref], 1)
    loss_ref = (lp_rows * w_lp).sum() + (h_rows * w_h).sum()
    g_ref = torch.autograd.grad(loss_ref, ref_in)[0]

    targets = torch.cat([ids[:, 1:], torch.zeros(B, 1, dtype=torch.long)], 1)  # position t scores token t+1
    if packed:
        pk_logits, _, cu_pad = pack_sequences(logits, lengths, pad_multiple=2 * cp)
        pk_tgt, _, _ = pack_sequences(targets, lengths, pad_multiple=2 * cp)
        pk_grad_ref, _, _ = pack_sequences(g_ref, lengths, pad_multiple=2 * cp)
        pk_logits, pk_tgt, pk_grad_ref = pk_logits[None], pk_tgt[None], pk_grad_ref[None]
    else:
        cu_pad = None
        pk_logits, pk_tgt, pk_grad_ref = logits, targets, g_ref
    local_logits = zigzag_shard(pk_logits, cp_rank, cp, dim=1, cu_seqlens_padded=cu_pad)[..., sl]
    local_logits = local_logits.clone().requires_grad_(True)
    local_tgt = zigzag_shard(pk_tgt, cp_rank, cp, dim=1, cu_seqlens_padded=cu_pad)

    lp_loc, h_loc = vocab_parallel_logprob_and_entropy(local_logits, local_tgt, tp_group, chunk_size=5)
    lp_full = gather_sequence(lp_loc, cp_group, dim=1, cu_seqlens_padded=cu_pad)
    h_full = gather_sequence(h_loc, cp_group, dim=1, cu_seqlens_padded=cu_pad)
    if packed:
        lp_out = unpack_sequences(lp_full, cu_pad, lengths, S, shift=1)
        h_out = unpack_sequences(h_full, cu_pad, lengths, S, shift=1)
    else:
        zero = torch.zeros(B, 1, dtype=torch.float64)
        lp_out = torch.cat([zero, lp_full[:, :-1]], 1)
        h_out = torch.cat([zero, h_full[:, :-1]], 1)
    # every CP rank evaluates the same full-sequence loss; NeMo-RL scales it by 1/CP
    loss = ((lp_out * w_lp).sum() + (h_out * w_h).sum()) / cp
    g = torch.autograd.grad(loss, local_logits)[0]
    g_expect = zigzag_shard(pk_grad_ref, cp_rank, cp, dim=1, cu_seqlens_padded=cu_pad)[..., sl]
    valid = torch.arange(S)[None, :] < lengths[:, None]
    valid[:, 0] = False
    return dict(
        lp=((lp_out - lp_rows).abs() * valid).max().item(),
        h=((h_out - h_rows).abs() * valid).max().item(),
        col0=max(lp_out[:, 0].abs().max().item(), h_out[:, 0].abs().max().item()),
        loss=abs(loss.item() * cp - loss_ref.item()),
        grad=(g - g_expect).abs().max().item(),
    )


def task_seq_index(rank, world):
    """DTensor CP: shards of a permuted sequence + ``seq_index`` → original order (with grad)."""
    from nemo_granular.distributed import gather_sequence, seq_index_gather_index

    _, cp_group, _, cp_rank = _groups(world, 2)
    gen = torch.Generator().manual_seed(3)
    S = 8
    x = torch.randn(2, S, generator=gen, dtype=torch.float64)
    seq_index = torch.randperm(S, generator=gen)  # gathered element j is original position seq_index[j]
    permuted = x[:, seq_index]
    local = permuted[:, cp_rank * 4 : (cp_rank + 1) * 4].clone().requires_grad_(True)
    full = gather_sequence(local, cp_group, dim=1, index=seq_index_gather_index(seq_index))
    w = torch.arange(S, dtype=torch.float64)
    g = torch.autograd.grad((full * w).sum(), local)[0]
    expect_g = w[seq_index][cp_rank * 4 : (cp_rank + 1) * 4].expand(2, 4) * 2  # 2 CP ranks, summed
    return dict(val=(full - x).abs().max().item(), grad=(g - expect_g).abs().max().item())


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("tp,chunk", [(2, None), (4, 4)])
def test_vocab_parallel_matches_single_process(pool, tp, chunk):
    for r in pool.run(task_vocab_parallel, tp, chunk):
        assert r["finite"]
        for k in ("lp", "h", "grad", "lp_only", "grad_lp_only", "h_only"):
            assert r[k] <= TOL, (k, r)


@pytest.mark.parametrize("packed", [False, True])
def test_cp2_zigzag_tp2_matches_single_process(pool, packed):
    for r in pool.run(task_cp_tp, packed):
        for k in ("lp", "h", "col0", "loss", "grad"):
            assert r[k] <= TOL, (k, r)


def test_dtensor_seq_index_gather(pool):
    for r in pool.run(task_seq_index):
        assert r["val"] <= TOL and r["grad"] <= TOL, r


# ----------------------------------------------------------------------------- the worker/loss glue on gloo
def _token_columns(h_ref_rows, lengths):
    """Reference entropy in NeMo-RL's token columns: column j = H(logits at j−1), 0 elsewhere."""
    B, S = h_ref_rows.shape
    out = torch.zeros(B, S, dtype=h_ref_rows.dtype)
    out[:, 1:] = h_ref_rows[:, :-1]
    return out * (torch.arange(S)[None, :] < lengths[:, None])


def task_worker_entropy(rank, world):
    """megatron_entropy (packed, CP=2 zig-zag × TP=2) and dtensor_entropy (CP=2 seq_index × TP=2)."""
    from nemo_granular.distributed import pack_sequences, zigzag_shard
    from nemo_granular.nemo_rl.workers import dtensor_entropy, megatron_entropy

    tp_group, cp_group, tp_rank, cp_rank = _groups(world, 2)
    gen = torch.Generator().manual_seed(5)
    B, S, V = 3, 10, 8
    lengths = torch.tensor([10, 4, 7])
    logits = torch.randn(B, S, V, generator=gen, dtype=torch.float64)
    expect = _token_columns(_ref(logits, torch.zeros(B, S, dtype=torch.long))[1], lengths)
    sl = slice(tp_rank * 4, (tp_rank + 1) * 4)
    # Megatron packed: [1, T/CP, V/TP]
    pk, _, cu_pad = pack_sequences(logits, lengths, pad_multiple=4)
    local = zigzag_shard(pk[None], cp_rank, 2, dim=1, cu_seqlens_padded=cu_pad)[..., sl]
    mega = megatron_entropy(
        local,
        input_lengths=lengths,
        seq_len=S,
        cu_seqlens_padded=cu_pad,
        tp_group=tp_group,
        cp_group=cp_group,
        chunk_size=3,
    )
    # DTensor CP: torch's load balancer permutes; seq_index[j] = original position of gathered element j
    seq_index = torch.randperm(S, generator=gen)
    local_dt = logits[:, seq_index][:, cp_rank * 5 : (cp_rank + 1) * 5, sl]
    dt = dtensor_entropy(
        local_dt,
        input_lengths=lengths,
        seq_len=S,
        tp_group=tp_group,
        cp_group=cp_group,
        seq_index_local=seq_index[cp_rank * 5 : (cp_rank + 1) * 5][None],
    )
    return dict(mega=(mega - expect).abs().max().item(), dt=(dt - expect).abs().max().item())


def task_fallback_loss(rank, world, packed, correction=False):
    """CurrentLogitsEntropyLoss on sharded training logits == GranularPolicyLoss on full logprobs
    with prev_entropy = H(current logits): loss and gradient w.r.t. the logits. ``correction``: with
    NeMo-RL's π_old/π_gen correction at the entropy groups' geometric mean and seq-mask-tis on them
    (docs/algorithms/math.md §10), whose terms must not change under TP/CP sharding or packing."""
    from nemo_granular.distributed import zigzag_shard
    from nemo_granular.losses import GranularPolicyLoss
    from nemo_granular.nemo_rl.fallback import CurrentLogitsEntropyLoss

    tp_group, cp_group, tp_rank, cp_rank = _groups(world, 2)
    gen = torch.Generator().manual_seed(21)
    B, S, V = 2, 8, 10
    vl = V // 2
    sl = slice(tp_rank * vl, (tp_rank + 1) * vl)
    ids = torch.randint(0, V, (B, S), generator=gen)
    logits = torch.randn(B, S, V, generator=gen, dtype=torch.float64)
    token_mask = torch.zeros(B, S)
    token_mask[:, 3:] = 1
    data = {
        "input_ids": ids,
        "token_mask": token_mask,
        "sample_mask": torch.ones(B),
        "advantages": torch.randn(B, 1, generator=gen).expand(B, S).contiguous(),
        "prev_logprobs": -torch.rand(B, S, generator=gen) * 2,
        "input_lengths": torch.full((B,), S),
    }
    cfg = {"reference_policy_kl_penalty": 0.0, "granular": {"algorithm": "espo", "espo": {"vocab_size": V}}}
    if correction:
        data["generation_logprobs"] = data["prev_logprobs"] + 0.3 * torch.randn(B, S, generator=gen)
        cfg.update(
            use_importance_sampling_correction=True,
            truncated_importance_sampling_type="seq-mask-tis",
            truncated_importance_sampling_ratio=1.1,
            truncated_importance_sampling_ratio_min=0.9,
        )
        cfg["granular"]["is_level"] = "group_mean"
    gvs, gvt = torch.tensor(2.0), token_mask[:, 1:].sum()

    ref_in = logits.clone().requires_grad_(True)
    lp_ref, h_ref = _ref(ref_in[:, :-1], ids[:, 1:])
    ref_data = dict(data, prev_entropy=torch.cat([torch.zeros(B, 1, dtype=torch.float64), h_ref.detach()], 1))
    ref_loss, ref_m = GranularPolicyLoss(cfg)(
        next_token_logprobs=lp_ref, data=ref_data, global_valid_seqs=gvs, global_valid_toks=gvt
    )
    g_ref = torch.autograd.grad(ref_loss, ref_in)[0]

    loss_fn = CurrentLogitsEntropyLoss(cfg)
    if packed:  # per-sequence packing-wrapper call: one row, logits CP-sharded (zig-zag) and vocab-sharded
        total, grads = 0.0, []
        for i in range(B):
            row = {k: v[i : i + 1] for k, v in data.items()}
            local = zigzag_shard(logits[i : i + 1], cp_rank, 2, dim=1)[..., sl].clone().requires_grad_(True)
            loss, _ = loss_fn(local, row, gvs, gvt, process_groups=(tp_group, cp_group))
            (g,) = torch.autograd.grad(loss / 2, local)  # NeMo-RL divides by CP
            total += loss.item()
            grads.append((g - zigzag_shard(g_ref[i : i + 1], cp_rank, 2, dim=1)[..., sl]).abs().max().item())
        return dict(loss=abs(total - ref_loss.item()), grad=max(grads))
    if cp_rank != 0:  # CP = 1 here: only the first TP pair participates in the loss
        return dict(loss=0.0, grad=0.0)
    local = logits[..., sl].clone().requires_grad_(True)
    loss, m = loss_fn(local, data, gvs, gvt, process_groups=(tp_group, None))
    (g,) = torch.autograd.grad(loss, local)
    out = dict(
        loss=abs(loss.item() - ref_loss.item()),
        grad=(g - g_ref[..., sl]).abs().max().item(),
        metric=abs(m["clip_bound_high_mean"] - ref_m["clip_bound_high_mean"]),
    )
    if correction:  # the correction acts here: some groups masked, the weights not all 1
        out.update(
            oob=abs(m["is_oob_ratio"] - ref_m["is_oob_ratio"]),
            acts=float(not (0 < ref_m["is_oob_group_frac"] < 1 and ref_m["sampling_importance_ratio"] != 1)),
        )
    return out


def test_worker_entropy_postprocessing_megatron_packed_and_dtensor_cp(pool):
    for r in pool.run(task_worker_entropy):
        assert r["mega"] <= TOL and r["dt"] <= TOL, r


@pytest.mark.parametrize("packed,correction", [(False, False), (True, False), (False, True), (True, True)])
def test_fallback_loss_on_sharded_logits(pool, packed, correction):
    for r in pool.run(task_fallback_loss, packed, correction):
        for v in r.values():
            assert v <= 1e-5, r
