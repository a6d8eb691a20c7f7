"""Critic cost of SPPO: prompt-only de-duplicated critic vs the full-sequence critic.

NeMo-RL's value model normally forwards every ``[prompt | response]`` row (get_values) and
trains on it; SPPO's critic only needs V(s_p), which causality makes available from the
prompt + 1 token (``nemo_granular.sppo.critic``). This script measures, on a small random
Qwen3 critic with a per-token value head (CPU, float32):

* FLOPs — analytic (2·params per token + causal attention) and measured with
  ``torch.utils.flop_counter.FlopCounterMode``;
* wall time — get_values (forward, de-duplicated prompts) and one training step
  (forward + backward, one short row per sample);

for a paper-like shape ratio (prompts ≪ responses; the paper uses ≤1k-token prompts and
≤8k-token responses; lengths are scaled down by 8 for the CPU) with N = 1 (SPPO) and N = 4
samples per prompt, and projects the analytic ratio to DeepSeek-R1-Distill-Qwen-1.5B at the
paper's full lengths. Writes the ``critic_cost`` section of docs/benchmarks.md.

    OMP_NUM_THREADS=1 python benchmarks/critic_cost.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import machine, update_section
from nemo_granular.sppo.critic import (
    build_value_query_batch,
    build_value_train_batch,
    prompt_value_columns,
    unique_prompt_index,
)

PAD = 0


def make_model(hidden, layers, vocab, seed=0):
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(hidden // 64, 1),
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=8192,
        num_labels=1,
        pad_token_id=PAD,
        classifier_dropout=0.0,
    )
    return transformers.Qwen3ForTokenClassification(cfg).float()


def analytic_flops(lengths, hidden, layers, inter, n_heads, n_kv, head_dim):
    """Forward FLOPs of a decoder with a scalar head for sequences of the given lengths:
    2·(non-embedding params)·tokens + causal attention 2·layers·n_heads·head_dim·T² (QKᵀ and
    AV, half the T² matrix each). Padding is not counted (packed sequences)."""
    attn_proj = hidden * head_dim * (2 * n_heads + 2 * n_kv)
    mlp = 3 * hidden * inter
    per_token = 2 * (layers * (attn_proj + mlp) + hidden)
    lengths = torch.as_tensor(lengths, dtype=torch.float64)
    return float(per_token * lengths.sum() + 2 * layers * n_heads * head_dim * (lengths**2).sum())


def make_batch(n_prompts, n_per_prompt, p_range, r_range, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows, plen = [], []
    for _ in range(n_prompts):
        p = torch.randint(1, vocab, (int(torch.randint(*p_range, (1,), generator=g)),), generator=g)
        for _ in range(n_per_prompt):
            r = torch.randint(1, vocab, (int(torch.randint(*r_range, (1,), generator=g)),), generator=g)
            rows.append(torch.cat([p, r]))
            plen.append(len(p))
    S = max(len(r) for r in rows)
    ids = torch.full((len(rows), S), PAD, dtype=torch.long)
    tm = torch.zeros(len(rows), S)
    for i, (r, p) in enumerate(zip(rows, plen)):
        ids[i, : len(r)] = r
        tm[i, p : len(r)] = 1
    B = len(rows)
    return {
        "input_ids": ids,
        "input_lengths": torch.tensor([len(r) for r in rows]),
        "token_mask": tm,
        "sample_mask": torch.ones(B),
        "rewards": torch.randint(0, 2, (B,), generator=g).float(),
    }


def _attn(ids, lengths):
    return (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).long()


def _time(fn, reps):
    fn()  # warm-up
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def _counted_flops(fn):
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as fc:
        fn()
    return float(fc.get_total_flops())


def measure(model, data, reps):
    cols = prompt_value_columns(data["token_mask"], data["input_lengths"])
    first, _, _ = unique_prompt_index(data["input_ids"], lengths=cols)
    q = build_value_query_batch(data["input_ids"], cols, first, PAD)
    t = build_value_train_batch(data, cols, PAD)
    ids, lens = data["input_ids"], data["input_lengths"]

    def fwd(i, n):
        with torch.no_grad():
            model(input_ids=i, attention_mask=_attn(i, n))

    def step(i, n):
        model.zero_grad(set_to_none=True)
        model(input_ids=i, attention_mask=_attn(i, n)).logits.sum().backward()

    c = model.config

    def af(L):
        return analytic_flops(
            L,
            c.hidden_size,
            c.num_hidden_layers,
            c.intermediate_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        )

    model.eval()
    res = {
        "rows_full": ids.shape[0],
        "rows_query": q["num_unique"],
        "width_full": ids.shape[1],
        "width_short": q["input_ids"].shape[1],
        "tokens_full": int(lens.sum()),
        "tokens_query": int(q["input_lengths"].sum()),
        "tokens_train_short": int(t["input_lengths"].sum()),
        "analytic_full": af(lens),
        "analytic_query": af(q["input_lengths"]),
        "analytic_train_short": af(t["input_lengths"]),
        "counted_full": _counted_flops(lambda: fwd(ids, lens)),
        "counted_query": _counted_flops(lambda: fwd(q["input_ids"], q["input_lengths"])),
        "t_get_full": _time(lambda: fwd(ids, lens), reps),
        "t_get_query": _time(lambda: fwd(q["input_ids"], q["input_lengths"]), reps),
    }
    model.train()
    res["t_train_full"] = _time(lambda: step(ids, lens), reps)
    res["t_train_short"] = _time(lambda: step(t["input_ids"], t["input_lengths"]), reps)
    model.eval()
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller model / batch (smoke run)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--no-write", action="store_true", help="print only, do not update docs/benchmarks.md")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    hidden, layers, vocab = (128, 2, 512) if args.quick else (192, 3, 1024)
    prompts = 4 if args.quick else 8
    # paper: prompts up to 1024, responses up to 8192 tokens; here / 8
    p_range, r_range = (32, 129), (256, 1025)
    model = make_model(hidden, layers, vocab)
    rows = []
    for n in (1, 4):
        data = make_batch(prompts if n == 1 else max(prompts // 4, 1), n, p_range, r_range, vocab, seed=n)
        rows.append((n, measure(model, data, args.reps)))

    # projection to the paper's 1.5B critic at full lengths (analytic, packed tokens)
    q15 = dict(hidden=1536, layers=28, inter=8960, n_heads=12, n_kv=2, head_dim=128)
    proj = []
    for p_len, r_len in ((1024, 8192), (256, 4096)):
        full = analytic_flops([p_len + r_len], **q15)
        short = analytic_flops([p_len + 1], **q15)
        proj.append((p_len, r_len, full / short))

    lines = [
        "## SPPO critic cost: prompt-only de-duplicated vs full sequence",
        "",
        f"`.venv/bin/python benchmarks/critic_cost.py{' --quick' if args.quick else ''}` — {machine()}.",
        f"Critic: random Qwen3 ({layers} layers, hidden {hidden}, vocab {vocab}) + per-token value head, float32,"
        f" 1 thread. Prompts {p_range[0]}–{p_range[1] - 1} tokens, responses {r_range[0]}–{r_range[1] - 1} tokens"
        " (the paper's ≤1k / ≤8k scaled by 1/8); right-padded batches as NeMo-RL builds them. Median of"
        f" {args.reps} runs after a warm-up.",
        "",
        "| N / prompt | rows full → forwarded | width full → short | tokens full → prompt-only | analytic FLOPs ratio"
        " | FlopCounter ratio (padded) | get_values time full / short | train step (fwd+bwd) full / short |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n, r in rows:
        lines.append(
            f"| {n} | {r['rows_full']} → {r['rows_query']} | {r['width_full']} → {r['width_short']} | "
            f"{r['tokens_full']} → {r['tokens_query']} | {r['analytic_full'] / r['analytic_query']:.1f}× | "
            f"{r['counted_full'] / r['counted_query']:.1f}× | "
            f"{r['t_get_full']:.3f} s / {r['t_get_query']:.3f} s = {r['t_get_full'] / r['t_get_query']:.1f}× | "
            f"{r['t_train_full']:.3f} s / {r['t_train_short']:.3f} s = {r['t_train_full'] / r['t_train_short']:.1f}× |"
        )
    lines += [
        "",
        "Training is not de-duplicated (one short row per sample, see `build_value_train_batch`), so its"
        " ratio is the length ratio alone; get_values also forwards each distinct prompt once.",
        "",
        "Analytic projection, DeepSeek-R1-Distill-Qwen-1.5B critic (28 layers, hidden 1536), one sequence,"
        " full [prompt | response] vs prompt + 1 token:",
        "",
        "| prompt | response | FLOPs ratio |",
        "|---|---|---|",
    ] + [f"| {p} | {r} | {x:.1f}× |" for p, r, x in proj]
    md = "\n".join(lines)
    print(md)
    if not args.no_write:
        update_section("critic_cost", md)
    return rows


if __name__ == "__main__":
    main()
