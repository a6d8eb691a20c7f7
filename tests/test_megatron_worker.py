"""NeMo-RL's real Megatron policy worker, with the plugin's extension, on CPU against HF transformers.

World: NeMo-RL (``nemo_rl_src``) with its pinned Megatron-LM / Megatron-Bridge sources. Each layout
is one spawned gloo world (``tests/harness/megatron_cpu/world.py``) in which every rank constructs
``GranularMegatronPolicyWorkerImpl`` through ``MegatronPolicyWorkerImpl.__init__`` — HF → Megatron
import by Megatron-Bridge, DDP + distributed optimizer, reference model — from a tiny HF Qwen3 /
Qwen3-MoE checkpoint and a shipped example config with model size, paths and cluster shrunk,
float32, sequence packing as the layout says (CPU stand-ins: ``tests/harness/cpu_stand_ins`` and
``tests/harness/megatron_cpu/standins.py``, listed in ``docs/nemo-rl.md`` §7). NeMo-RL's own ``Policy``
code shards the batch and re-assembles the results (``cases.Driver``).

``a3b_shape`` is the layout of ``espo_qwen3_30b_a3b_megatron.yaml`` at toy size: TP × PP × CP × EP
all 2 (8 ranks, the fewest with every dimension > 1) with sequence parallelism, packing, router
replay and a ``logprob_chunk_size`` that splits every packed microbatch into several chunks. Its
batches carry ``routed_experts`` as a rollout hands them to NeMo-RL (``megatron_cpu.routes``: a
third of the routes differ from the router's own top-k choice), and the transformers reference
routes each token to those same experts (``reference.routing``).

Against an independent float64 forward/backward of the same checkpoint by transformers:
weights as loaded (mapped back with the test's own layout mapping), ``get_logprobs_with_entropy``
(log-probs and entropy), one ``train`` step with the granular loss (loss, gradient norm, every
gradient, the AdamW update; the reference's loss is the naive float64 one of ``tests/harness/reference.py``
with the loss's settings, π_old from the float64 forward) and the log-probs after the step.
"""

from __future__ import annotations

import contextlib
import pickle

import pytest
import torch

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.nemo_rl]

B, S = 8, 32
PROMPT = torch.tensor([5, 4, 6, 3, 7, 4, 5, 6])  # prompt lengths: the rest of each sequence is the response
TOL_FWD = 2e-5  # float32 Megatron vs float64 HF, 2-4 layers: measured ≤ 5e-6
LAYOUTS = {
    # name: (world, model, config file, parallel sizes, sequence packing, other policy overrides)
    # TP 2, PP 2 and CP 2 with packing each had a layout of their own; a3b_shape holds all three (and EP,
    # SP, router replay, logprob chunking) in one world, and each layout costs a Megatron world on CI's
    # two cores (1.5–2.5 min each), so those three went (issue #32: CI time)
    "tp1": (1, "dense", "sspo_qwen2.5_math_1.5b.yaml", {}, False, {}),
    # EP without router replay (Megatron's own routing; a3b_shape replays a rollout's routes), with the
    # GSPO side of the 30B-A3B pair: each algorithm's shipped Megatron config runs at least once here.
    # TP 2 with sequence parallelism (as every shipped Megatron config with TP > 1 runs; the norms:
    # cpu_stand_ins) had a layout of its own, with gspo_qwen2.5_math_1.5b.yaml; a3b_shape holds it (#32)
    "ep2_moe": (2, "moe", "gspo_qwen3_30b_a3b_megatron.yaml", {"ep": 2}, False, {"router_replay": {"enabled": False}}),
    # the 30B-A3B config's shape (TP 4 × PP 2 × CP 2 × EP 8 with sequence parallelism, packing, router
    # replay and logprob chunking) at toy size: every dimension 2, DP 1 and expert-DP 2 as EP 2 leaves
    # it (shipped: DP 4, expert-DP 4); chunks of 5 tokens split each CP rank's packed sequence
    "a3b_shape": (
        8,
        "moe4",
        "espo_qwen3_30b_a3b_megatron.yaml",
        {"tp": 2, "pp": 2, "cp": 2, "ep": 2, "sp": True},
        True,
        {"logprob_chunk_size": 5},
    ),
}


@pytest.fixture(scope="module")
def tiny(nemo_rl_src, megatron_workers, tmp_path_factory):
    from megatron_cpu import models

    root = tmp_path_factory.mktemp("megatron_worker")
    return {
        "root": root,
        "dense": models.write(root / "dense"),
        "moe": models.write(root / "moe", moe=True),
        "moe4": models.write(root / "moe4", moe=True, layers=4),
    }


def _batch(seed: int = 0):
    from megatron_cpu.models import DELIMITER, VOCAB

    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([32, 20, 27, 9, 31, 14, 24, 18])
    cols = torch.arange(S)[None, :]
    ids = torch.randint(4, VOCAB, (B, S), generator=g)
    ids[(torch.rand(B, S, generator=g) < 0.2) & (cols >= PROMPT[:, None])] = DELIMITER
    ids[cols >= lengths[:, None]] = 0
    token_mask = ((cols >= PROMPT[:, None]) & (cols < lengths[:, None])).float()
    return ids, lengths, token_mask, g


def _train_data(ids, lengths, token_mask, g, lp, ent, loss_cfg, table):
    """A GRPO training batch as ``GranularPolicy.train`` hands it to the workers (π_old ≠ current
    weights so the clipping acts)."""
    from nemo_granular.nemo_rl.policy import add_granular_keys

    noise = lambda s: s * torch.randn(B, S, generator=g, dtype=torch.float64) * token_mask  # noqa: E731
    prev = (lp + noise(0.3)).clamp(max=-1e-3) * token_mask
    data = {
        "input_ids": ids,
        "input_lengths": lengths,
        "token_mask": token_mask,
        "sample_mask": torch.tensor([1.0, 1, 1, 0, 1, 1, 1, 1]),
        "prev_logprobs": prev.float(),
        "generation_logprobs": (prev + noise(0.05)).float(),
        "reference_policy_logprobs": (prev + noise(0.2)).float(),
        "advantages": torch.randn(B, 1, generator=g) * token_mask,
    }
    add_granular_keys(data, loss_cfg, ent.float(), table)
    return data


def _spacing(w: torch.Tensor) -> torch.Tensor:
    """Distance from each float32 weight to the next float32 away from zero (float64)."""
    w = w.detach().float().abs()
    return (torch.nextafter(w, torch.full_like(w, float("inf"))) - w).double()


def _worst(got: dict, want: dict) -> tuple[float, str]:
    return max((_max(got[k], w), k) for k, w in want.items())


def _max(a, b, mask=None) -> float:
    d = (a.double() - b.double()).abs()
    return float(d[mask].max() if mask is not None else d.max())


def _run_layout(name: str, tiny) -> dict:
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    from megatron_cpu import cases, reference, world
    from megatron_cpu.models import DELIMITER, VOCAB
    from megatron_cpu.routes import rollout_routes
    from nemo_granular.losses import GranularPolicyLoss
    from nemo_granular.nemo_rl.run_state import espo_alpha_for_step

    n, model, config, sizes, packing, extra = LAYOUTS[name]
    model_dir = str(tiny[model])
    overrides = cases.merge(
        cases.tiny_overrides(model_dir, packing=packing, precision="float32", seq_len=S, gbs=B, mbs=2, **sizes), extra
    )
    full, policy = cases.load_config(config, overrides)
    hf = reference.load_hf(model_dir)
    ids, lengths, token_mask, g = _batch()
    routes = None
    if (policy.get("router_replay") or {}).get("enabled"):
        routes = rollout_routes(hf, ids, lengths, PROMPT)

    def routed(model):  # transformers routes every token to the rollout's experts, as R3 replays them
        return contextlib.nullcontext() if routes is None else reference.routing(model, reference.replay(routes))

    with torch.no_grad(), routed(hf):
        lp, ent = reference.logprobs_entropy(reference.logits(hf, ids, lengths), ids, lengths)
    table = torch.zeros(VOCAB, dtype=torch.bool)
    table[DELIMITER] = True
    data = _train_data(ids, lengths, token_mask, g, lp, ent, full["loss_fn"], table)
    logprob_data = {"input_ids": ids, "input_lengths": lengths}
    if routes is not None:
        data["routed_experts"] = logprob_data["routed_experts"] = routes

    loss_fn = GranularPolicyLoss(full["loss_fn"], delimiter_table=table, vocab_size=VOCAB)
    # espo.alpha: auto (the shipped ESPO configs) is set from the first π_old pass, as the NeMo-RL driver does
    alpha = espo_alpha_for_step(loss_fn, data, {})

    driver = cases.Driver(policy, n)
    spec = {
        "config": config,
        "overrides": overrides,
        "delimiter_table": table,
        "vocab_size": VOCAB,
        "espo_alpha": alpha,
        "gbs": B,
        "mbs": 2,
        "train_shards": pickle.dumps(driver.train_shards(BatchedDataDict(data), B)),
        "logprob_shards": pickle.dumps(driver.logprob_shards(BatchedDataDict(logprob_data))),
    }
    # one Megatron checkpoint per model: the first layout imports it from HF, the others load it
    env = {
        "NRL_MEGATRON_CHECKPOINT_DIR": str(tiny["root"] / "mcore"),
        "HOME": str(tiny["root"] / "home"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TORCHDYNAMO_DISABLE": "1",
    }
    ranks = world.run_world(n, cases.run_layout, spec, env=env, preload=True)

    m = policy["megatron_cfg"]["optimizer"]
    frozen = (
        {k for k in dict(hf.named_parameters()) if k.endswith("mlp.gate.weight")}
        if policy["megatron_cfg"]["freeze_moe_router"]
        else set()
    )
    (lr,) = {tuple(x["lr"]) for x in ranks}
    assert len(lr) == 1, lr  # one learning rate for every parameter group
    # the float64 reference loss (tests/harness/reference.py, written from math.md) with the loss's settings and
    # the ESPO α the driver set, not the package's loss in float64
    from cpu_host.loss_check import reference_loss

    with routed(hf):
        ref = reference.train_step(hf, data, reference_loss(loss_fn, (DELIMITER,)), frozen=frozen)
    adamw = {"clip": m["clip_grad"], "lr": lr[0], "weight_decay": m["weight_decay"], "eps": m["adam_eps"]}
    return {
        "ranks": ranks,
        "driver": driver,
        "hf": hf,
        "ref": ref,
        "lp": lp,
        "ent": ent,
        "ids": ids,
        "lengths": lengths,
        "frozen": frozen,
        "model_dir": model_dir,
        "adamw": adamw,
        "routed": routed,
        "routes": routes,
        "chunk_size": policy.get("logprob_chunk_size"),
        "small_chunks": "logprob_chunk_size" in extra,
    }


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_megatron_worker_equals_hf(name, tiny):
    from megatron_cpu import mapping, reference

    r = _run_layout(name, tiny)
    ranks, ref, hf = r["ranks"], r["ref"], r["hf"]
    report: dict[str, float] = {}  # max differences, printed at the end (docs/nemo-rl.md §7)
    assert all(not x["te_takers"] for x in ranks), [x["te_takers"] for x in ranks]
    if r["chunk_size"]:
        # logprob_chunk_size reached NeMo-RL's log-prob (π_old pass and loss) and the plugin's entropy
        calls = [c for x in ranks for c in x["chunking"] if c[2] is not None]
        assert {c[2] for c in calls} == {r["chunk_size"]}, calls
        if r["small_chunks"]:  # set below the sequence lengths: both split their sequences into chunks
            for kind in ("logprob", "entropy"):
                assert max((t for k, t, _ in calls if k == kind), default=0) > r["chunk_size"], (kind, calls)

    # weights Megatron-Bridge loaded = the HF checkpoint, exactly
    loaded = mapping.assemble([x["weights"] for x in ranks], hf.config)
    hf_sd = {k: v.detach() for k, v in hf.named_parameters()}
    assert set(loaded) == set(hf_sd)
    for k, v in loaded.items():
        torch.testing.assert_close(v, hf_sd[k].double(), rtol=0, atol=0, msg=f"{name}: loaded {k}")

    # log-probs and entropy: one answer per DP rank (every TP/CP/PP replica the same), in order
    inside = torch.arange(S)[None, :] < r["lengths"][:, None]
    heads = {}
    for x in ranks:
        c = x["coords"]
        key = c["dp"]
        if key in heads:
            for k in ("logprobs", "entropy", "logprobs_after"):
                torch.testing.assert_close(x[k], heads[key][k], rtol=0, atol=0, msg=f"{name}: replica {c} {k}")
        else:
            heads[key] = x
    per_dp = [heads[d] for d in sorted(heads)]
    got_lp = r["driver"].gather(per_dp, "logprobs")
    got_ent = r["driver"].gather(per_dp, "entropy")
    report["logprobs"] = _max(got_lp, r["lp"], inside)
    report["entropy"] = _max(got_ent, r["ent"])
    assert report["logprobs"] < TOL_FWD and report["entropy"] < TOL_FWD, report
    if r["routes"] is not None:
        # the routes decide the answer: with the router's own top-k (a worker that ignored them)
        # the log-probs would be this far off
        with torch.no_grad():
            own, _ = reference.logprobs_entropy(reference.logits(hf, r["ids"], r["lengths"]), r["ids"], r["lengths"])
        report["own_routing"] = _max(own, r["lp"], inside)
        assert report["own_routing"] > 1e3 * TOL_FWD, report

    # one train step: loss, gradient norm, gradients, update
    metrics = ranks[0]["metrics"]
    report["loss"] = _max(metrics["global_loss"].reshape(()), ref["loss"])
    report["grad_norm"] = _max(metrics["grad_norm"].reshape(()), ref["grad_norm"])
    assert report["loss"] < 1e-5 * max(1.0, abs(float(ref["loss"]))), report
    assert report["grad_norm"] < 1e-5 * float(ref["grad_norm"]), report
    grads = mapping.assemble([x["grads"] for x in ranks], hf.config)
    assert set(grads) == set(ref["grads"]), set(grads) ^ set(ref["grads"])
    scale = max(float(g.abs().max()) for g in ref["grads"].values())
    report["grads"], worst = _worst(grads, ref["grads"])
    assert report["grads"] < 2e-5 * scale, (worst, report)
    update = mapping.assemble([x["update"] for x in ranks], hf.config)
    for k in r["frozen"]:
        assert float(update[k].abs().max()) == 0.0, f"{name}: frozen {k} changed"
    # the step AdamW makes from those (checked) gradients; Adam divides by |g|, so an element
    # whose gradient is near eps is as sensitive as the gradient's last digits and the update is
    # taken from Megatron's own gradients. float32 arithmetic: the step is computed to about one
    # spacing of its own float32 grid and the new weight rounded to the weight's grid, so the
    # difference is measured in units of the two spacings (steps are 1e-7..5e-6, weights ~0.5)
    want = reference.adamw_first_step(
        hf_sd, {k: grads[k] for k in ref["grads"]}, float(metrics["grad_norm"].reshape(())), **r["adamw"]
    )
    report["update"], _ = _worst(update, want)
    ulps = {k: ((update[k] - u).abs() / (_spacing(hf_sd[k]) + _spacing(u))).max().item() for k, u in want.items()}
    worst = max(ulps, key=ulps.get)
    report["update_ulps"] = ulps[worst]
    assert ulps[worst] <= 2.0, (worst, report)

    # log-probs after the step = HF with the updated weights (the next forward gathers the shards)
    moved = reference.load_hf(r["model_dir"])
    with torch.no_grad(), r["routed"](moved):
        for k, p in moved.named_parameters():
            p.add_(update[k].to(p.dtype))
        lp_after, _ = reference.logprobs_entropy(
            reference.logits(moved, r["ids"], r["lengths"]), r["ids"], r["lengths"]
        )
    report["logprobs_after"] = _max(r["driver"].gather(per_dp, "logprobs_after"), lp_after, inside)
    assert report["logprobs_after"] < TOL_FWD, report
    report["init_s"] = max(x["init_s"] for x in ranks)
    print(f"\n{name}: " + ", ".join(f"{k}={v:.2e}" for k, v in report.items()))
