"""Loss-overhead benchmark: granular losses vs the token-level GRPO loss, and the fused
logprob+entropy pass vs the logprob-only pass.

Part 1 — forward + backward of ``GranularPolicyLoss`` for every preset of
``nemo_granular.config.PRESETS``, given next-token logprobs and π_old entropy (the model is not
part of the measurement), for B rows × S columns with growing S. Reported: median wall time of
the repeats, its ratio to the ``grpo`` preset measured in the same run at the same size, the
time per token (linearity), and memory:
  * on GPU: ``torch.cuda.max_memory_allocated`` during forward+backward minus the memory held
    before the call (peak extra bytes);
  * on CPU: the bytes of the tensors autograd saves for backward (``saved_tensors_hooks``,
    deduplicated by storage) — the memory a loss keeps alive between forward and backward.
    Transient temporaries freed during forward are not counted on CPU.

Part 2 — ``logprobs_and_entropy_from_logits`` (one fused pass) vs ``logprobs_from_logits``
(logprob only) on float32 logits ``[N, V]`` for V ∈ {4096, 32768}: ratio of median times.

Targets (issue "granular-ratio core"): granular losses ≤ 1.5× GRPO and linear in tokens;
entropy+logprob ≤ 1.5× logprob alone on CPU. The script prints the table and writes it to
docs/benchmarks.md (section ``loss_overhead``) with the machine line.

    python benchmarks/loss_overhead.py            # B=64, S ∈ {256, 1024, 4096}
    python benchmarks/loss_overhead.py --quick    # B=16, S ∈ {256, 1024}, fewer repeats
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import machine, update_section
from nemo_granular.config import PRESETS
from nemo_granular.core.entropy import logprobs_and_entropy_from_logits, logprobs_from_logits
from nemo_granular.core.groups import group_ids_for
from nemo_granular.losses import GranularPolicyLoss

VOCAB = 32768
DELIMITER_EVERY = 50  # token ids divisible by 50 are "delimiters": segments of ~50 tokens


def make_batch(B: int, S: int, device, seed: int = 0, adv_layout: str = "row"):
    """A NeMo-RL-style batch: prompt of S/8 tokens, responses of random length, right padding.
    ``adv_layout``: ``row``, one advantage per response on every token of its row, as NeMo-RL's
    advantage estimators give it (``advantages.expand(mask.shape)``, materialized as on a worker);
    ``masked``: that value on the response tokens and 0 elsewhere."""
    if adv_layout not in ("row", "masked"):
        raise ValueError(f"adv_layout must be 'row' or 'masked', got {adv_layout!r}")
    g = torch.Generator().manual_seed(seed)
    prompt = max(1, S // 8)
    lengths = torch.randint(S // 2, S - prompt + 1, (B,), generator=g)
    col = torch.arange(S)[None]
    token_mask = ((col >= prompt) & (col < prompt + lengths[:, None])).float()
    prev = -torch.rand(B, S, generator=g) * 3
    data = {
        "input_ids": torch.randint(0, VOCAB, (B, S), generator=g),
        "token_mask": token_mask,
        "sample_mask": torch.ones(B),
        "advantages": torch.randn(B, 1, generator=g).expand(B, S) * (token_mask if adv_layout == "masked" else 1.0),
        "prev_logprobs": prev * token_mask,
        "generation_logprobs": prev * token_mask,
        "reference_policy_logprobs": prev * token_mask,
        "prev_entropy": torch.rand(B, S, generator=g) * 2.5 * token_mask,
    }
    logp = ((prev + torch.randn(B, S, generator=g) * 0.05) * token_mask)[:, 1:].contiguous()
    data = {k: v.to(device) for k, v in data.items()}
    gvs = data["sample_mask"].sum()
    gvt = (data["token_mask"][:, 1:] * data["sample_mask"][:, None]).sum()
    return data, logp.to(device), gvs, gvt


def make_loss(name: str, **loss_fn) -> GranularPolicyLoss:
    """The preset ``name`` (KL off), with NeMo-RL's ``loss_fn`` keys ``loss_fn`` on top (``metrics_level=...``)."""
    table = torch.zeros(VOCAB, dtype=torch.bool)
    table[::DELIMITER_EVERY] = True
    return GranularPolicyLoss(
        {"granular": {"algorithm": name, "espo": {"vocab_size": VOCAB}}, "reference_policy_kl_penalty": 0.0, **loss_fn},
        delimiter_table=table,
    )


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def fwd_bwd(fn, logp, data, gvs, gvt):
    lp = logp.clone().requires_grad_(True)
    loss, _ = fn(next_token_logprobs=lp, data=data, global_valid_seqs=gvs, global_valid_toks=gvt)
    loss.backward()
    return lp.grad


def memory_bytes(fn, logp, data, gvs, gvt, device) -> int:
    """GPU: peak extra allocated bytes of forward+backward. CPU: bytes saved for backward."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fwd_bwd(fn, logp, data, gvs, gvt)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t

    lp = logp.clone().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = fn(next_token_logprobs=lp, data=data, global_valid_seqs=gvs, global_valid_toks=gvt)
    loss.backward()
    return sum(seen.values())


def bench_losses(B, seq_lens, repeats, device, warmup=2):
    """Repeats are interleaved over the presets (a shuffled order each round), so that load
    changes on a shared machine hit every preset alike; a preset's time is its median."""
    rows = []
    presets = ["grpo"] + [n for n in PRESETS if n != "grpo"]
    # "+ids": group ids precomputed once per rollout, as both hosts pass them (granular_group_ids)
    names = presets + [f"{n}+ids" for n in presets if PRESETS[n]["granularity"] != "token"]
    for S in seq_lens:
        data, logp, gvs, gvt = make_batch(B, S, device)
        ntok = int(gvt.item())
        fns, datas = {}, {}
        for name in names:
            loss = make_loss(name.removesuffix("+ids"))
            fns[name], datas[name] = loss, data
            if name.endswith("+ids"):
                g = loss.granular
                ids = group_ids_for(
                    g.granularity,
                    data["token_mask"] > 0,
                    token_ids=data["input_ids"],
                    entropy=data["prev_entropy"],
                    delimiter_table=loss.delimiter_table,
                    entropy_cut_points=g.entropy_cut_points,
                )
                datas[name] = {**data, "granular_group_ids": ids}
        times = {name: [] for name in names}
        order = random.Random(S)
        for k in range(warmup + repeats):
            names_k = list(names)
            order.shuffle(names_k)  # no preset always runs right after the same other one
            for name in names_k:
                fn = fns[name]
                _sync(device)
                t0 = time.perf_counter()
                fwd_bwd(fn, logp, datas[name], gvs, gvt)
                _sync(device)
                if k >= warmup:
                    times[name].append((time.perf_counter() - t0) * 1e3)
        base_t = statistics.median(times["grpo"])
        base_m = memory_bytes(fns["grpo"], logp, data, gvs, gvt, device)
        for name in names:
            t = statistics.median(times[name])
            m = memory_bytes(fns[name], logp, datas[name], gvs, gvt, device)
            rows.append(
                dict(
                    preset=name,
                    S=S,
                    tokens=ntok,
                    ms=t,
                    x_time=t / base_t,
                    us_per_tok=1e3 * t / ntok,
                    mem_mb=m / 2**20,
                    x_mem=m / max(base_m, 1),
                )
            )
            print(
                f"  S={S:5d} {name:11s} {t:9.2f} ms  x{t / base_t:5.2f}  {1e3 * t / ntok:7.3f} us/tok  "
                f"{m / 2**20:8.2f} MB  x{m / max(base_m, 1):5.2f}",
                flush=True,
            )
    return rows


def bench_entropy(vocabs, positions, repeats, device, warmup=1):
    """Median times of the two passes, their repeats interleaved (same reason as above)."""
    rows = []
    for V in vocabs:
        g = torch.Generator().manual_seed(V)
        z = (torch.randn(positions, V, generator=g) * 3).to(device)
        tgt = torch.randint(0, V, (positions,), generator=g).to(device)
        t_lp, t_both = [], []
        with torch.no_grad():
            for k in range(warmup + repeats):
                for out, call in (
                    (t_lp, partial(logprobs_from_logits, z, tgt)),
                    (t_both, partial(logprobs_and_entropy_from_logits, z, tgt)),
                ):
                    _sync(device)
                    t0 = time.perf_counter()
                    call()
                    _sync(device)
                    if k >= warmup:
                        out.append((time.perf_counter() - t0) * 1e3)
        a, b = statistics.median(t_lp), statistics.median(t_both)
        rows.append(dict(V=V, N=positions, lp_ms=a, both_ms=b, ratio=b / a))
        print(f"  V={V:6d} N={positions}  logprob {a:8.2f} ms  logprob+entropy {b:8.2f} ms  x{b / a:5.2f}", flush=True)
        del z
    return rows


def to_markdown(args, device, loss_rows, ent_rows) -> str:
    mem_kind = (
        "peak extra `torch.cuda.max_memory_allocated` during forward+backward"
        if device.type == "cuda"
        else "bytes of tensors saved for backward (`saved_tensors_hooks`, deduplicated by storage); "
        "temporaries freed during forward are not counted"
    )
    lines = [
        "## Loss overhead (`benchmarks/loss_overhead.py`" + (" --quick" if args.quick else "") + ")",
        "",
        f"Machine: {machine()}; device: {device}.",
        "",
        f"Forward+backward of `GranularPolicyLoss` per preset given logprobs and entropy, B={args.B} rows, "
        f"median of {args.repeats} repeats interleaved over the presets in a shuffled order each round; "
        "×grpo = ratio to the `grpo` preset measured in the same run. "
        f"Memory: {mem_kind}. Synthetic vocabulary {VOCAB} with every {DELIMITER_EVERY}th id a delimiter.",
        "",
        "| preset | S | tokens | ms | ×grpo | µs/token | mem MB | mem ×grpo |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in loss_rows:
        lines.append(
            f"| {r['preset']} | {r['S']} | {r['tokens']} | {r['ms']:.2f} | {r['x_time']:.2f} | "
            f"{r['us_per_tok']:.3f} | {r['mem_mb']:.2f} | {r['x_mem']:.2f} |"
        )
    largest = max(r["S"] for r in loss_rows)
    smallest = min(r["S"] for r in loss_rows)
    own = [r for r in loss_rows if r["preset"] != "grpo" and not r["preset"].endswith("+ids")]
    worst = max((r for r in own if r["S"] == largest), key=lambda r: r["x_time"])
    worst_any = max(own, key=lambda r: r["x_time"])
    lin = {}
    for name in dict.fromkeys(r["preset"] for r in loss_rows):
        a = next(r for r in loss_rows if r["preset"] == name and r["S"] == smallest)
        b = next(r for r in loss_rows if r["preset"] == name and r["S"] == largest)
        lin[name] = b["us_per_tok"] / a["us_per_tok"]
    met = worst["x_time"] <= 1.5
    with_ids = [r for r in loss_rows if r["preset"].endswith("+ids") and r["S"] == largest]
    worst_ids = max(with_ids, key=lambda r: r["x_time"]) if with_ids else None
    lines += [
        "",
        "`<preset>` rows: the loss computes the group ids itself (segment table / entropy ranking per "
        "call). `<preset>+ids` rows: `granular_group_ids` precomputed once per rollout and passed in the "
        "batch — what the embedded trainer and the NeMo-RL driver policy do.",
        "",
        f"Target granular ≤ 1.5× GRPO time: **{'met' if met else 'NOT met'}** at S={largest} "
        f"(worst {worst['preset']} {worst['x_time']:.2f}×); worst over all sizes "
        f"{worst_any['preset']} at S={worst_any['S']}: {worst_any['x_time']:.2f}×."
        + (
            f" With precomputed ids: **{'met' if worst_ids['x_time'] <= 1.5 else 'NOT met'}** at S={largest} "
            f"(worst {worst_ids['preset']} {worst_ids['x_time']:.2f}×)."
            if worst_ids
            else ""
        ),
        "Linearity (µs/token at S=" + str(largest) + " ÷ µs/token at S=" + str(smallest) + "; 1.0 = linear, "
        "< 1 = per-call overhead amortised, > 1 = super-linear): "
        + ", ".join(f"{k} {v:.2f}" for k, v in lin.items())
        + ".",
        "Noise gauge: `sppo` runs exactly the same policy-loss computation as `grpo` (only the advantage "
        "estimator differs), so its ×grpo column shows the run-to-run noise of this machine.",
        "",
        f"Fused logprob+entropy vs logprob-only on float32 logits (median of {args.repeats}):",
        "",
        "| V | positions | logprob ms | logprob+entropy ms | ratio |",
        "|---|---|---|---|---|",
    ]
    for r in ent_rows:
        lines.append(f"| {r['V']} | {r['N']} | {r['lp_ms']:.2f} | {r['both_ms']:.2f} | {r['ratio']:.2f} |")
    worst_e = max(r["ratio"] for r in ent_rows)
    lines += [
        "",
        f"Target entropy+logprob ≤ 1.5× logprob alone: **{'met' if worst_e <= 1.5 else 'NOT met'}** "
        f"(worst {worst_e:.2f}×).",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes and few repeats (about a minute on CPU)")
    ap.add_argument("--B", type=int, default=None, help="rows per batch (default 64, quick 16)")
    ap.add_argument("--seq-lens", type=int, nargs="+", default=None)
    ap.add_argument("--vocabs", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--positions", type=int, default=None, help="positions for the entropy pass (default 4096)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-write", action="store_true", help="print only, do not update docs/benchmarks.md")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.B = args.B or (16 if args.quick else 64)
    args.seq_lens = args.seq_lens or ([256, 1024] if args.quick else [256, 1024, 4096])
    args.positions = args.positions or (2048 if args.quick else 4096)
    args.repeats = args.repeats or (5 if args.quick else 9)
    device = torch.device(args.device)
    print(f"machine: {machine()}  device: {device}")
    print("loss forward+backward:")
    loss_rows = bench_losses(args.B, args.seq_lens, args.repeats, device)
    print("logprob(+entropy) from logits:")
    ent_rows = bench_entropy(args.vocabs, args.positions, args.repeats, device)
    md = to_markdown(args, device, loss_rows, ent_rows)
    print()
    print(md)
    if not args.no_write:
        update_section("loss_overhead", md)
    return md


if __name__ == "__main__":
    main()
