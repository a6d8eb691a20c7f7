"""Training–inference mismatch study: how each π_old/π_gen correction level behaves as the mismatch
and the response length grow (docs/algorithms/offpolicy.md, math.md §10).

Everything runs on the embedded trainer's own parts: a randomly initialised Qwen3 policy from
the embedded model config, rollouts sampled by ``rollout.generate`` from the generation engine of
``rl.generation_mismatch`` (``embedded.mismatch.perturbed_copy``: every weight times 1 + σ·ε),
π_old logprobs and entropy from ``old_policy_pass``, and the plugin's ``GranularPolicyLoss`` with
``use_importance_sampling_correction: true`` at each ``is_level`` (and without correction). Per
seed, mismatch σ and response length L, on one batch of B responses to one prompt (a synthetic
reward: the share of the response's tokens in a fixed half of the vocabulary, GRPO-normalised):

* ``w_mean``: the mean π_old/π_gen weight over the correction's units (what NeMo-RL logs as
  ``sampling_importance_ratio``: ~1 is healthy, ≪ 1 down-weights the whole batch);
* ``ess``: effective sample size of the per-response weights, (Σ W_i)² / (B·Σ W_i²), W_i the
  response's mean token weight (1 = every response counts, 1/B = one response carries the batch);
* ``scale``: ‖∇θ loss‖ with the correction / without it (the batch's effective learning rate);
* ``cos_target``: cosine between the corrected gradient and the on-π_old gradient g*, estimated
  from a 2× larger batch sampled from π_old itself (σ = 0) with the same loss;
* ``masked``: share of tokens that ICE-POP at NeMo-RL's reference bounds [0.5, 2] zeroes.

    python benchmarks/offpolicy_study.py          # 3 seeds, σ ∈ {0.02, 0.05, 0.1}, L ∈ {32, 128, 512}, B = 16
    python benchmarks/offpolicy_study.py --quick  # 2 seeds, σ = 0.05, L ∈ {32, 128} → runs/offpolicy_study_quick/

Writes docs/algorithms/offpolicy/{results.json, *.png} and the table of docs/algorithms/offpolicy.md
(between its ``offpolicy-study`` markers). One thread.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nemo_granular.core.groups import group_ids_for  # noqa: E402
from nemo_granular.embedded import models as M  # noqa: E402
from nemo_granular.embedded.config import ModelConfig  # noqa: E402
from nemo_granular.embedded.mismatch import perturbed_copy  # noqa: E402
from nemo_granular.embedded.rollout import generate, next_token_logprobs, old_policy_pass, to_nemo_batch  # noqa: E402
from nemo_granular.losses import GranularPolicyLoss  # noqa: E402

LEVELS = ("none", "token", "group_sum", "group_mean")
PRESETS = {"sequence": "gspo", "segment": "sspo", "entropy_group": "espo"}
TEMPERATURE = 1.0
# a random init is near uniform (H ≈ log|V|): scaled tied embeddings give H ≈ 0.8 nats, q10–q90 0.4–1.3
EMBED_SCALE = 5.0
PROMPT = "Q:3+4+5+6=?\nA:"


def _model(seed: int, L: int, tokenizer):
    torch.manual_seed(seed)
    cfg = ModelConfig(
        hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, max_positions=L + 32
    )
    policy = M.build_policy(cfg, tokenizer)
    with torch.no_grad():  # sharper next-token distributions; EOS never likelier than a typical token, so L holds
        emb = policy.get_input_embeddings().weight
        emb.mul_(EMBED_SCALE)
        emb[tokenizer.eos_token_id] = 0
    return policy


def _batch(engine, policy, tokenizer, B: int, L: int, good: torch.Tensor, gen_seed: int):
    torch.manual_seed(gen_seed)
    gen = generate(
        engine,
        tokenizer,
        [PROMPT] * B,
        max_new_tokens=L,
        temperature=TEMPERATURE,
        greedy=False,
        device=torch.device("cpu"),
    )
    batch = to_nemo_batch(gen, tokenizer.pad_token_id)
    old_policy_pass(policy, batch, TEMPERATURE, 256)
    mask = batch["token_mask"]
    reward = (good[batch["input_ids"]] * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    adv = (reward - reward.mean()) / (reward.std() + 1e-6)  # GRPO, one prompt group
    batch["advantages"] = adv[:, None] * mask
    return batch


def _loss_fn(granularity: str, level: str, vocab: int, tokenizer):
    cfg = {
        "reference_policy_kl_penalty": 0.0,
        "granular": {"algorithm": PRESETS[granularity], "espo": {"alpha": 1.0, "vocab_size": vocab}},
    }
    if level != "none":
        cfg.update(use_importance_sampling_correction=True)
        cfg["granular"]["is_level"] = level
    return GranularPolicyLoss(cfg, tokenizer=tokenizer, vocab_size=vocab)


def _grad(policy, fn, batch, granularity):
    g = fn.granular
    data = {k: v for k, v in batch.items() if torch.is_tensor(v)}
    data["granular_group_ids"] = group_ids_for(
        granularity,
        data["token_mask"] > 0,
        token_ids=data["input_ids"],
        entropy=data["prev_entropy"],
        delimiter_table=fn.delimiter_table,
        entropy_cut_points=g.entropy_cut_points,
    )
    gvs = data["sample_mask"].sum()
    gvt = (data["token_mask"][:, 1:] * data["sample_mask"][:, None]).sum()
    policy.zero_grad(set_to_none=True)
    logp = next_token_logprobs(policy, data, TEMPERATURE)
    loss, metrics = fn(next_token_logprobs=logp, data=data, global_valid_seqs=gvs, global_valid_toks=gvt)
    loss.backward()
    grad = torch.cat([p.grad.reshape(-1) for p in policy.parameters() if p.grad is not None])
    return grad, metrics, data


def _weights(data, level, granularity):
    """Per-response mean token weight W_i, the mean weight over the level's units, and the ICE-POP
    [0.5, 2] masked token share — from the same π_old/π_gen weights the loss uses."""
    from nemo_granular.core.offpolicy import generation_weights
    from nemo_granular.core.scatter_index import ScatterIndex

    valid = data["token_mask"][:, 1:].double()
    q, gen = data["prev_logprobs"][:, 1:].double() * valid, data["generation_logprobs"][:, 1:].double() * valid
    ids = data["granular_group_ids"][:, 1:]
    G = int(ids.max()) + 1
    index = ScatterIndex.from_ids(ids, max(G, 1))
    counts = index.sum(valid)
    lvl = "token" if level == "none" else level
    w = generation_weights(q, gen, valid, level=lvl, index=index, counts=counts).weight * valid
    w_row = w.sum(-1) / valid.sum(-1).clamp(min=1)
    if lvl == "token":
        w_mean = float(w.sum() / valid.sum())
    else:
        present = counts.clamp(max=1)
        w_mean = float((index.sum(w) / counts.clamp(min=1) * present).sum() / present.sum())
    ess = float(w_row.sum() ** 2 / (w_row.numel() * (w_row**2).sum()))
    pop = generation_weights(
        q, gen, valid, level=lvl, index=index, counts=counts, kind="icepop", ratio_max=2.0, ratio_min=0.5
    )
    masked = float(pop.oob_token.sum() / valid.sum())
    return w_mean, ess, masked


def run(seeds, sigmas, lengths, B, out_dir: Path, log=print):
    torch.set_num_threads(1)
    tokenizer = M.build_tokenizer()
    vocab = M.padded_vocab(tokenizer)
    rows = []
    for seed in seeds:
        good = (torch.rand(vocab, generator=torch.Generator().manual_seed(10_000 + seed)) < 0.5).double()
        for L in lengths:
            policy = _model(seed, L, tokenizer)
            policy.eval()
            target_batch = _batch(policy, policy, tokenizer, 2 * B, L, good, gen_seed=seed * 97 + L)
            targets = {}
            for gran in PRESETS:
                fn = _loss_fn(gran, "none", vocab, tokenizer)
                targets[gran] = _grad(policy, fn, target_batch, gran)[0]
            for sigma in sigmas:
                t0 = time.time()
                engine = perturbed_copy(policy, sigma, seed * 1_000_003 + L * 31 + int(sigma * 1e4))
                batch = _batch(engine, policy, tokenizer, B, L, good, gen_seed=seed * 89 + L + 7)
                n_tok = float(batch["token_mask"].sum())
                for gran in PRESETS:
                    base = None
                    for level in LEVELS:
                        fn = _loss_fn(gran, level, vocab, tokenizer)
                        grad, m, data = _grad(policy, fn, batch, gran)
                        base = grad if level == "none" else base
                        w_mean, ess, masked = _weights(data, level, gran)
                        rows.append(
                            dict(
                                seed=seed,
                                sigma=sigma,
                                length=L,
                                granularity=gran,
                                level=level,
                                response_length=n_tok / B,
                                w_mean=w_mean if level != "none" else 1.0,
                                ess=ess if level != "none" else 1.0,
                                masked=masked if level != "none" else 0.0,
                                scale=float(grad.norm() / base.norm()),
                                cos_target=float(torch.nn.functional.cosine_similarity(grad, targets[gran], dim=0)),
                                gen_mismatch_abs_mean=m["gen_mismatch_abs_mean"],
                                gen_kl_k3=m["gen_kl_k3"],
                                gen_mismatch_group_abs_mean=m["gen_mismatch_group_abs_mean"],
                            )
                        )
                log(
                    f"seed {seed} L {L} σ {sigma}: mean response length {n_tok / B:.0f}, "
                    f"mean |δ| {rows[-1]['gen_mismatch_abs_mean']:.4f} ({time.time() - t0:.1f} s)"
                )
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "results.json.tmp"
    tmp.write_text(json.dumps(rows, indent=1))
    tmp.replace(out_dir / "results.json")
    return rows


def _mean_sd(xs):
    xs = [x for x in xs if x == x]
    if not xs:
        return float("nan"), float("nan")
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return m, sd


def summarise(rows):
    """{(granularity, level, σ, L): {metric: (mean, sd over seeds)}}."""
    keys = sorted({(r["granularity"], r["level"], r["sigma"], r["length"]) for r in rows})
    out = {}
    for k in keys:
        sel = [r for r in rows if (r["granularity"], r["level"], r["sigma"], r["length"]) == k]
        out[k] = {
            m: _mean_sd([r[m] for r in sel])
            for m in (
                "w_mean",
                "ess",
                "masked",
                "scale",
                "cos_target",
                "response_length",
                "gen_mismatch_abs_mean",
                "gen_kl_k3",
            )
        }
        out[k]["n"] = len(sel)
    return out


def table(summary) -> str:
    lines = [
        "| groups | level | σ | L (mean) | mean abs δ | mean weight | ESS | ‖g‖/‖g_none‖ | cos(g, g*) | "
        "ICE-POP masked |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (gran, level, sigma, L), s in summary.items():

        def f(m, d=3, s=s):
            mu, sd = s[m]
            return f"{mu:.{d}f} ± {sd:.{d}f}"

        lines.append(
            f"| {gran} | {level} | {sigma} | {L} ({s['response_length'][0]:.0f}) | "
            f"{s['gen_mismatch_abs_mean'][0]:.4f} | {f('w_mean')} | {f('ess')} | {f('scale')} | "
            f"{f('cos_target')} | {f('masked')} |"
        )
    return "\n".join(lines)


def plots(summary, out_dir: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grans = sorted({k[0] for k in summary})
    sigmas = sorted({k[2] for k in summary})
    lengths = sorted({k[3] for k in summary})
    sig = sigmas[len(sigmas) // 2]
    for metric, label, logy in (
        ("w_mean", "mean π_old/π_gen weight", True),
        ("ess", "ESS of response weights", False),
        ("cos_target", "cos(corrected gradient, on-π_old gradient)", False),
        ("scale", "‖g‖ / ‖g uncorrected‖", True),
    ):
        fig, axes = plt.subplots(1, len(grans), figsize=(4 * len(grans), 3.2), sharey=True)
        for ax, gran in zip(axes, grans):
            for level in LEVELS:
                if metric in ("w_mean", "ess") and level == "none":
                    continue
                mu = [summary[(gran, level, sig, L)][metric][0] for L in lengths]
                sd = [summary[(gran, level, sig, L)][metric][1] for L in lengths]
                ax.errorbar(lengths, mu, yerr=sd, marker="o", capsize=3, label=level)
            ax.set_xscale("log", base=2)
            if logy:
                ax.set_yscale("log")
            ax.set_title(f"{gran} ({PRESETS[gran]}), σ = {sig}")
            ax.set_xlabel("max response length L")
        axes[0].set_ylabel(label)
        axes[-1].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / f"{metric}_vs_length.png", dpi=110)
        plt.close(fig)
    # vs mismatch at the longest length
    L = lengths[-1]
    fig, axes = plt.subplots(1, len(grans), figsize=(4 * len(grans), 3.2), sharey=True)
    for ax, gran in zip(axes, grans):
        for level in LEVELS[1:]:
            ax.errorbar(
                sigmas,
                [summary[(gran, level, s, L)]["w_mean"][0] for s in sigmas],
                yerr=[summary[(gran, level, s, L)]["w_mean"][1] for s in sigmas],
                marker="o",
                capsize=3,
                label=level,
            )
        ax.set_yscale("log")
        ax.set_title(f"{gran}, L = {L}")
        ax.set_xlabel("generation mismatch σ")
    axes[0].set_ylabel("mean π_old/π_gen weight")
    axes[-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "w_mean_vs_mismatch.png", dpi=110)
    plt.close(fig)


def write_doc_table(doc: Path, text: str) -> None:
    src = doc.read_text()
    new = re.sub(
        r"(<!-- offpolicy-study:begin[^\n]*-->\n)(?:.*?\n)?(<!-- offpolicy-study:end -->)",
        lambda m: m.group(1) + text + "\n" + m.group(2),
        src,
        flags=re.S,
    )
    tmp = doc.with_name(doc.name + ".tmp")
    tmp.write_text(new)
    tmp.replace(doc)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seeds", type=int, default=None)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument(
        "--out",
        default=None,
        help="results.json and plots (default: docs/algorithms/offpolicy; "
        "--quick: runs/offpolicy_study_quick/, and the doc is left alone)",
    )
    ap.add_argument(
        "--doc", default=None, help="the page whose table is rewritten (default: docs/algorithms/offpolicy.md)"
    )
    ap.add_argument("--from-json", default=None, help="re-render the table and plots from a results.json")
    a = ap.parse_args(argv)
    sigmas = [0.05] if a.quick else [0.02, 0.05, 0.1]
    lengths = [32, 128] if a.quick else [32, 128, 512]
    seeds = list(range(a.seeds or (2 if a.quick else 3)))
    out = Path(a.out or ("runs/offpolicy_study_quick" if a.quick else ROOT / "docs" / "algorithms" / "offpolicy"))
    doc_path = a.doc or (None if a.quick else str(ROOT / "docs" / "algorithms" / "offpolicy.md"))
    if a.from_json:
        rows = json.loads(Path(a.from_json).read_text())
        out.mkdir(parents=True, exist_ok=True)
    else:
        rows = run(seeds, sigmas, lengths, a.batch, out)
    summary = summarise(rows)
    text = table(summary)
    print(text)
    plots(summary, out)
    if doc_path and Path(doc_path).is_file() and "offpolicy-study:begin" in Path(doc_path).read_text():
        write_doc_table(Path(doc_path), text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
