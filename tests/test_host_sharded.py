"""Sharded math against Megatron-core's and NeMo-RL's OWN code, in real gloo processes.

One 4-process gloo pool (``dist_utils.DistPool``); Megatron's ``parallel_state`` lays out the
groups (``initialize_model_parallel`` over gloo):

* TP 2 × DP 2: on every TP group, the project's ``vocab_parallel_logprob`` / ``_entropy`` against
  Megatron's ``tensor_parallel.vocab_parallel_cross_entropy`` and NeMo-RL's
  ``DistributedLogprob``, ``from_parallel_logits_to_logprobs`` (plain and chunked) and
  ``ChunkedDistributedEntropy`` (which returns Σ p log p = −H) — values and gradients
  w.r.t. the local vocabulary shard — and the float64 single-process reference.
* a real tiny Megatron ``GPTModel`` (local layer spec, CPU init) at TP 1 and TP 2 feeding
  ``megatron_entropy``, against the entropy of the TP-gathered logits;
* TP 2 × CP 2 with sequence packing: the project's zig-zag layout equals NeMo-RL's
  ``_get_tokens_on_this_cp_rank`` per packed sequence; NeMo-RL's
  ``from_parallel_logits_to_logprobs_packed_sequences`` and the project's ``megatron_entropy``
  on the SAME shards give the reference log-probs / entropy in token columns.
"""

from __future__ import annotations

import pytest
import torch

from dist_utils import DistPool

pytestmark = [pytest.mark.dist, pytest.mark.nemo_rl]


@pytest.fixture(scope="module")
def pool(nemo_rl_src, megatron_workers):
    p = DistPool(4)
    yield p
    p.close()


def _ref(logits, targets):
    logp = torch.log_softmax(logits.double(), -1)
    return logp.gather(-1, targets[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _import_megatron():
    """megatron.core before the Transformer Engine placeholder (spawned ranks inherit the parent's
    sys.path, placeholder included): the same order as the ``megatron_workers`` fixture."""
    import sys

    stub = [p for p in sys.path if p.endswith("te_stub")]
    for p in stub:
        sys.path.remove(p)
    try:
        import megatron.core.models.gpt
        import megatron.core.parallel_state
        import megatron.core.tensor_parallel  # noqa: F401
    finally:
        sys.path.extend(stub)


def _init_megatron(tp, cp):
    _import_megatron()
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    return ps


# ----------------------------------------------------------------------------- rank tasks
def task_tp_dp(rank, world):
    _import_megatron()
    from megatron.core import tensor_parallel
    from nemo_rl.distributed import model_utils as mu

    from nemo_granular.distributed import vocab_parallel_entropy, vocab_parallel_logprob

    ps = _init_megatron(2, 1)
    tp_group, tp_rank = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()
    dp_rank = ps.get_data_parallel_rank()
    B, S, V = 2, 7, 16
    g = torch.Generator().manual_seed(100 + dp_rank)  # same full tensor on both ranks of a TP group
    full = torch.randn(B, S, V, generator=g, dtype=torch.float64) * 2
    ids = torch.randint(0, V, (B, S), generator=g)
    w = torch.randn(B, S, generator=g, dtype=torch.float64)
    lo, hi = tp_rank * V // 2, (tp_rank + 1) * V // 2
    out = {}

    def grad_of(fn, dtype):
        x = full[..., lo:hi].to(dtype).clone().requires_grad_(True)
        y = fn(x)
        (gx,) = torch.autograd.grad(y, x)
        return y.detach().double(), gx.double()

    # reference (float64, full vocabulary): values and the local slice of the gradients
    xf = full.clone().requires_grad_(True)
    rlp, rent = _ref(xf, ids)
    (g_lp,) = torch.autograd.grad((w * rlp).sum(), xf, retain_graph=True)
    (g_ent,) = torch.autograd.grad((w * rent).sum(), xf)
    ref = {"lp": (rlp.detach(), g_lp[..., lo:hi]), "ent": (rent.detach(), g_ent[..., lo:hi])}

    for dtype in (torch.float64, torch.float32):
        k = str(dtype)[-2:]
        out[f"ours_lp_{k}"] = grad_of(lambda x: (w.to(x.dtype) * vocab_parallel_logprob(x, ids, tp_group)).sum(), dtype)
        out[f"ours_ent_{k}"] = grad_of(lambda x: (w.to(x.dtype) * vocab_parallel_entropy(x, tp_group, 3)).sum(), dtype)
    out["ours_lp_values"] = vocab_parallel_logprob(full[..., lo:hi].float(), ids, tp_group).double()
    out["ours_ent_values"] = vocab_parallel_entropy(full[..., lo:hi].float(), tp_group).double()
    # Megatron: cross entropy = −log p(target)
    out["megatron_lp"] = grad_of(
        lambda x: -(w.float() * tensor_parallel.vocab_parallel_cross_entropy(x, ids)).sum(), torch.float32
    )
    out["megatron_lp_values"] = -tensor_parallel.vocab_parallel_cross_entropy(full[..., lo:hi].float(), ids).double()
    # NeMo-RL
    out["nemo_lp"] = grad_of(
        lambda x: (w.float() * mu.DistributedLogprob.apply(x, ids, lo, hi, tp_group, False)).sum(), torch.float32
    )
    for chunk in (None, 3):
        out[f"nemo_next_{chunk}"] = mu.from_parallel_logits_to_logprobs(
            full[..., lo:hi].float(), ids, lo, hi, tp_group, inference_only=True, chunk_size=chunk
        ).double()
    out["nemo_negent"] = grad_of(
        lambda x: (w.float() * mu.ChunkedDistributedEntropy.apply(x, 3, tp_group, False)).sum(), torch.float32
    )
    out["nemo_negent_values"] = mu.ChunkedDistributedEntropy.apply(full[..., lo:hi].float(), 3, tp_group, True).double()
    out["ours_next"] = vocab_parallel_logprob(full[:, :-1, lo:hi].float(), ids[:, 1:], tp_group).double()
    out = {k: tuple(t.detach() for t in v) if isinstance(v, tuple) else v.detach() for k, v in out.items()}
    return {
        "ref": ref,
        "out": out,
        "ref_lp": rlp.detach(),
        "ref_ent": rent.detach(),
        "tp_rank": tp_rank,
        "dp_rank": dp_rank,
    }


def task_cp_packed(rank, world):
    _import_megatron()
    from nemo_rl.distributed import model_utils as mu

    from nemo_granular.distributed import zigzag_shard
    from nemo_granular.nemo_rl.workers import megatron_entropy

    ps = _init_megatron(2, 2)
    tp_group, tp_rank = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()
    cp_group, cp_rank = ps.get_context_parallel_group(), ps.get_context_parallel_rank()
    V, S = 12, 11
    lengths = torch.tensor([11, 5, 8])
    padded = (lengths + 3) // 4 * 4  # multiple of 2·CP, as NeMo-RL's packing pads
    cu = torch.nn.functional.pad(padded.cumsum(0), (1, 0)).int()
    T = int(cu[-1])
    g = torch.Generator().manual_seed(7)
    packed = torch.randn(1, T, V, generator=g, dtype=torch.float64) * 2
    target = torch.randint(0, V, (1, T), generator=g)
    lo, hi = tp_rank * V // 2, (tp_rank + 1) * V // 2

    # NeMo-RL's layout: per sequence, _get_tokens_on_this_cp_rank of its padded slot
    nemo_local = torch.cat(
        [
            mu._get_tokens_on_this_cp_rank(packed[:, int(cu[i]) : int(cu[i + 1])], cp_rank, 2)
            for i in range(len(lengths))
        ],
        1,
    )
    ours_local = zigzag_shard(packed, cp_rank, 2, dim=1, cu_seqlens_padded=cu)
    local = nemo_local[..., lo:hi].float()
    lp = mu.from_parallel_logits_to_logprobs_packed_sequences(
        local, target, cu, S, lo, hi, tp_group, inference_only=True, cp_group=cp_group
    )
    ent = megatron_entropy(
        local, input_lengths=lengths, seq_len=S, cu_seqlens_padded=cu, tp_group=tp_group, cp_group=cp_group
    )
    # reference per sequence: logits at position t score the token at t+1
    ref_lp = torch.zeros(len(lengths), S - 1, dtype=torch.float64)
    ref_ent = torch.zeros(len(lengths), S, dtype=torch.float64)
    for i, L in enumerate(lengths.tolist()):
        seq = packed[0, int(cu[i]) : int(cu[i]) + L]
        tg = target[0, int(cu[i]) : int(cu[i]) + L]
        r_lp, r_ent = _ref(seq[:-1], tg[1:])
        ref_lp[i, : L - 1] = r_lp
        ref_ent[i, 1:L] = r_ent
    return {
        "same_layout": torch.equal(nemo_local, ours_local),
        "lp": lp.double(),
        "ent": ent.double(),
        "ref_lp": ref_lp,
        "ref_ent": ref_ent,
        "lengths": lengths,
    }


def task_gpt_model(rank, world, tp):
    """A real tiny Megatron GPTModel (local layer spec, CPU init) feeding ``megatron_entropy``.

    CPU shims, in this task only: ``torch.cuda.current_device`` → "cpu" (rotary embedding /
    mappings ask for it) and the CUDA RNG tracker's ``fork()`` → no-op (dropout is 0)."""
    import contextlib

    import torch.distributed as dist

    ps = _init_megatron(tp, 1)
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from nemo_granular.nemo_rl.workers import megatron_entropy

    tracker = tensor_parallel.random.get_cuda_rng_tracker()
    saved = torch.cuda.current_device, tracker.fork
    torch.cuda.current_device = lambda: "cpu"
    tracker.fork = lambda *a, **k: contextlib.nullcontext()
    try:
        torch.manual_seed(0)
        cfg = TransformerConfig(
            num_layers=1,
            hidden_size=16,
            num_attention_heads=2,
            use_cpu_initialization=True,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            tensor_model_parallel_size=tp,
            params_dtype=torch.float32,
        )
        V, B, S = 32, 3, 8
        model = GPTModel(
            config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=V, max_sequence_length=16
        )
        g = torch.Generator().manual_seed(11 + ps.get_data_parallel_rank())
        ids = torch.randint(0, V, (B, S), generator=g)
        lengths = torch.tensor([8, 5, 7])
        mask = torch.ones(S, S, dtype=torch.bool).triu(1)[None, None]
        with torch.no_grad():
            local = model(input_ids=ids, position_ids=torch.arange(S)[None].expand(B, S), attention_mask=mask)
    finally:
        torch.cuda.current_device, tracker.fork = saved
    tp_group = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(parts, local.contiguous(), group=tp_group)
    full = torch.cat(parts, -1).double()
    ent = megatron_entropy(local, input_lengths=lengths, seq_len=S, tp_group=tp_group)
    logp = torch.log_softmax(full, -1)
    h = -(logp.exp() * logp).sum(-1)
    ref = torch.zeros(B, S, dtype=torch.float64)
    for i, L in enumerate(lengths.tolist()):
        ref[i, 1:L] = h[i, : L - 1]
    return {"local_vocab": local.shape[-1], "ent": ent.double(), "ref": ref}


# ----------------------------------------------------------------------------- tests
def test_tp2_dp2_against_megatron_and_nemo_rl(pool):
    results = pool.run(task_tp_dp)
    assert sorted((r["tp_rank"], r["dp_rank"]) for r in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert (
        not torch.allclose(results[0]["ref_lp"], results[2]["ref_lp"]) or results[0]["dp_rank"] == results[2]["dp_rank"]
    ), "DP ranks must hold different data"
    for r in results:
        o, (rlp, g_lp), (rent, g_ent) = r["out"], r["ref"]["lp"], r["ref"]["ent"]
        # the project's functions against the float64 reference (float64 tight, float32 loose)
        for k, tol in (("64", 1e-12), ("32", 2e-5)):
            torch.testing.assert_close(o[f"ours_lp_{k}"][1], g_lp, rtol=tol, atol=tol)
            torch.testing.assert_close(o[f"ours_ent_{k}"][1], g_ent, rtol=tol, atol=tol)
        torch.testing.assert_close(o["ours_lp_values"], rlp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(o["ours_ent_values"], rent, rtol=1e-5, atol=1e-5)
        # ... and against the peers on identical float32 shards: values and gradients
        tol = dict(rtol=2e-5, atol=2e-6)
        torch.testing.assert_close(o["megatron_lp_values"], o["ours_lp_values"], **tol)
        torch.testing.assert_close(o["megatron_lp"][1], o["ours_lp_32"][1], **tol)
        torch.testing.assert_close(o["nemo_lp"][1], o["ours_lp_32"][1], **tol)
        torch.testing.assert_close(o["nemo_lp"][0], o["ours_lp_32"][0], **tol)
        for chunk in (None, 3):
            torch.testing.assert_close(o[f"nemo_next_{chunk}"], o["ours_next"], **tol)
        torch.testing.assert_close(-o["nemo_negent_values"], o["ours_ent_values"], **tol)
        torch.testing.assert_close(-o["nemo_negent"][1], o["ours_ent_32"][1], **tol)
        assert o["ours_ent_32"][1].abs().sum() > 0


def test_cp2_tp2_packed_against_nemo_rl(pool):
    for r in pool.run(task_cp_packed):
        assert r["same_layout"], "the project's zig-zag shard differs from NeMo-RL's _get_tokens_on_this_cp_rank"
        valid = torch.zeros_like(r["ref_lp"], dtype=torch.bool)
        for i, L in enumerate(r["lengths"].tolist()):
            valid[i, : L - 1] = True
        torch.testing.assert_close(r["lp"][valid], r["ref_lp"][valid], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r["ent"], r["ref_ent"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_entropy_fed_by_a_real_gpt_model(pool, tp):
    for r in pool.run(task_gpt_model, tp):
        assert r["local_vocab"] == 32 // tp
        assert r["ref"].abs().sum() > 0
        torch.testing.assert_close(r["ent"], r["ref"], rtol=1e-5, atol=1e-5)
