"""A DTensor policy worker's parameter gradients inside a loop, against a float64 transformers backward.

``cpu_host.hooks._record_dtensor_gradients`` saved, at the first global batch of the first ``Policy.train``
call, every parameter's gradient as NeMo-RL's worker left it before scaling, clipping and the optimizer step
(gathered whole from the DTensor shards), and each rank's count of loss calls that far. At that point the
policy's weights are the checkpoint the run started from, so the reference needs nothing the worker computed:

* the model: the checkpoint loaded by transformers in float64;
* the inputs of each microbatch: its token ids, masks and advantages as the worker received them (the
  rollout's data); π_old log-probs and entropy from the reference's own forward (π_old is π_θ0 here), not
  the worker's ``prev_logprobs``/``prev_entropy``; the global counts from the masks of every DP rank's
  microbatches, compared with the counts the worker's loss was called with;
* the loss: the naive float64 reference (``tests/harness/reference.py``), summed over the global batch's
  microbatches (each once: tensor-parallel peers hold the same one), backpropagated to the parameters.

The worker's gradient is that sum's: NeMo-RL scales each microbatch loss by dp × cp before its backward
(FSDP averages over DP) and zeroes dummy microbatches' losses; a loss whose backward ignored that upstream
factor would give half the gradient at DP 2.
"""

from __future__ import annotations

from pathlib import Path

import torch

import reference as R

from .loss_check import delimiter_ids, next_token_logprobs_entropy, records, reference_kwargs

# prefixes wrappers add to parameter names (torch.compile, activation checkpointing, FSDP1)
_WRAPPERS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def _plain(name: str) -> str:
    for w in _WRAPPERS:
        name = name.replace(w, "")
    return name


def gradient_records(run_dir: Path) -> list[dict]:
    """Every worker's gradient record, by rank."""
    files = sorted((run_dir / "facts.jsonl.grads").glob("*.pt"))
    return sorted((torch.load(f, weights_only=False) for f in files), key=lambda r: r["rank"])


def first_global_batch(run_dir: Path, grad_recs: list[dict]) -> tuple[list[dict], list[dict]]:
    """The loss records of the first train call that reached the recorded gradient: every rank's, and each
    microbatch once (tensor-parallel peers record the same one)."""
    calls = {r["rank"]: r["loss_calls"] for r in grad_recs}
    reached = [rec for rec in records(run_dir)[0] if rec["call"] < calls[rec["rank"]]]
    seen, unique = set(), []
    for rec in reached:
        key = tuple(bytes(rec["data"][k].contiguous().numpy().tobytes()) for k in ("input_ids", "advantages"))
        if key not in seen:
            seen.add(key)
            unique.append(rec)
    return reached, unique


def check_gradients(run_dir: Path, model_dir: Path, temperature: float) -> dict:
    """The float64 reference's parameter gradients vs the worker's; what the comparison covered."""
    from transformers import AutoModelForCausalLM

    grad_recs = gradient_records(run_dir)
    worker = {_plain(k): v for k, v in grad_recs[0]["grads"].items()}
    reached, batch = first_global_batch(run_dir, grad_recs)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float64).eval()
    model.zero_grad(set_to_none=True)
    delims = delimiter_ids(model_dir)
    # the global counts from every microbatch's masks (NeMo-RL: token_mask[:, 1:] x sample_mask, summed over DP)
    gvs = sum(float(r["data"]["sample_mask"].double().sum()) for r in batch)
    gvt = sum(
        float((r["data"]["token_mask"][:, 1:].double() * r["data"]["sample_mask"].double()[:, None]).sum())
        for r in batch
    )
    counts_used = {(r["global_valid_seqs"], r["global_valid_toks"]) for r in reached}
    total = torch.zeros((), dtype=torch.float64)
    pi_old_vs_worker = 0.0
    for rec in batch:
        lp, ent = next_token_logprobs_entropy(model, rec["data"], temperature)  # float64
        data = dict(rec["data"])
        zero = torch.zeros(lp.shape[0], 1, dtype=torch.float64)
        data["prev_logprobs"] = torch.cat([zero, lp.detach()], 1)
        data["prev_entropy"] = torch.cat([zero, ent.detach()], 1)
        if "reference_policy_logprobs" in data:  # the reference policy is the starting checkpoint too
            data["reference_policy_logprobs"] = data["prev_logprobs"]
        mask = rec["data"]["token_mask"][:, 1:] > 0
        pi_old_vs_worker = max(
            pi_old_vs_worker, float((rec["data"]["prev_logprobs"][:, 1:].double() - lp.detach())[mask].abs().max())
        )
        loss, _ = R.granular_loss(lp, data, **reference_kwargs(rec, delims), gvs=gvs, gvt=gvt)
        total = total + loss
    total.backward()
    ref = {_plain(k): p.grad for k, p in model.named_parameters()}
    assert set(ref) == set(worker), sorted(set(ref) ^ set(worker))
    scale = max(float(g.abs().max()) for g in ref.values())
    num = sum(float((worker[k] - ref[k]).pow(2).sum()) for k in ref)
    den = sum(float(ref[k].pow(2).sum()) for k in ref)
    per_param = {k: float((worker[k] - ref[k]).abs().max()) / scale for k in ref}
    return {
        "params": len(ref),
        "microbatches": len(batch),
        "ranks": len(grad_recs),
        "counts_used": sorted(counts_used),
        "counts_reference": (gvs, gvt),
        "loss": float(total),
        "grad_scale": scale,
        "max_rel": max(per_param.values()),
        "worst": max(per_param, key=per_param.get),
        "l2_rel": (num / den) ** 0.5,
        "pi_old_vs_worker": pi_old_vs_worker,
        "dp_group_size": grad_recs[0]["dp_group_size"],
    }
