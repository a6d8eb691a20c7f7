"""The policy loss side by side with NeMo-RL's ``ClippedPGLossFn`` as it ships (7ea279ab) and as
its open rewrite has it (NVIDIA-NeMo/RL pull request 3751: ``metrics_level: full | minimal``,
``enable_torch_compile``), forward + backward, in one process, at 1 and 2 CPU threads or on a GPU.

Contenders, on the same NeMo-RL-style batch (``benchmarks/loss_overhead.make_batch``, float32, KL
off), each a ``loss_fn(next_token_logprobs=..., data=..., global_valid_*=...)`` + ``backward()``:
  * NeMo-RL today: ``ClippedPGLossFn`` token level and GSPO mode (``sequence_level_importance_ratios``,
    ``token_level_loss: false``, ε = 3e-4/4e-4), from the checkout named by ``NEMO_RL_SRC``;
  * NeMo-RL next: the same two modes at ``metrics_level`` full and minimal, from the rewrite's
    ``loss_functions.py`` given by ``--nemo-rl-next`` (a file, or a NeMo-RL checkout of the pull
    request's head) — loaded from that path, nothing of it is copied here;
  * ours: ``grpo``, ``gspo``, ``gspo_token``, and ``sspo`` / ``sspo_no_ec`` / ``espo`` with
    ``granular_group_ids`` precomputed (``+ids``, as both hosts pass them), at ``metrics_level``
    full and minimal.
Each of ours is paired with the NeMo-RL mode of the same math (token presets ↔ token level, the
others ↔ GSPO mode) at the same metrics level. Every round runs each contender once in a shuffled
order; ms = median over rounds, × = median over rounds of (time ÷ the paired contender's time in
the same round). ``--clock cpu`` times with the process CPU clock (a machine shared with other jobs:
its scheduling delays then do not count; at 2 threads it sums both threads' work — run it with
``OMP_WAIT_POLICY=PASSIVE``, or OpenMP's spinning threads count their waits as work).

    NEMO_RL_SRC=<NeMo-RL checkout> python benchmarks/loss_vs_nemo_rl.py --nemo-rl-next <rewrite's loss_functions.py>
    NEMO_RL_SRC=... python benchmarks/loss_vs_nemo_rl.py --nemo-rl-next ... --device cuda   # on a GPU
    python benchmarks/loss_vs_nemo_rl.py --quick --no-write                                   # a smoke run

Writes the ``loss_vs_nemo_rl_<device>_<clock>[_t<threads>]`` section of docs/benchmarks.md
(``--no-write``: print only).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import machine, update_section
from loss_overhead import make_batch, make_loss, memory_bytes
from nemo_granular.core.groups import group_ids_for
from peers import load_nemo_rl

OURS = ("grpo", "gspo", "gspo_token", "sspo+ids", "sspo_no_ec+ids", "espo+ids")
# the group presets with their ids computed inside the loss (no granular_group_ids in the batch): timed
# against the same preset with the ids precomputed (issue 35: ESPO's within 2x)
IDS_IN_LOSS = ("sspo", "espo")
LEVELS = ("full", "minimal")
KL_OFF = dict(reference_policy_kl_penalty=0.0)
GSPO_MODE = dict(
    KL_OFF, ratio_clip_min=3e-4, ratio_clip_max=4e-4, token_level_loss=False, sequence_level_importance_ratios=True
)


def load_nemo_rl_next(path: str | None):
    """(ClippedPGLossFn, ClippedPGLossConfig) of the rewrite at ``path`` (its loss_functions.py, or
    a checkout holding nemo_rl/algorithms/loss/loss_functions.py), imported as a module of its own
    next to today's ``nemo_rl`` (whose helpers it imports); or (None, why)."""
    if not path:
        return None, "no --nemo-rl-next (or NEMO_RL_NEXT) given"
    p = Path(path)
    if p.is_dir():
        p = p / "nemo_rl" / "algorithms" / "loss" / "loss_functions.py"
    if not p.is_file():
        return None, f"--nemo-rl-next {path}: no such loss_functions.py"
    spec = importlib.util.spec_from_file_location("nemo_rl_next_loss_functions", p)
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
        mod.ClippedPGLossConfig(metrics_level="minimal", enable_torch_compile=False)
    except Exception as exc:  # noqa: BLE001 - reported in the table, not fatal
        return None, f"loading {p} failed: {type(exc).__name__}: {exc}"
    return (mod.ClippedPGLossFn, mod.ClippedPGLossConfig), None


def _ours(name: str, level: str, data, **loss_fn):
    loss = make_loss(name.removesuffix("+ids"), metrics_level=level, **loss_fn)
    if not name.endswith("+ids"):
        return loss, data
    g = loss.granular
    ids = group_ids_for(
        g.granularity,
        data["token_mask"] > 0,
        token_ids=data["input_ids"],
        entropy=data["prev_entropy"],
        delimiter_table=loss.delimiter_table.to(data["input_ids"].device),
        entropy_cut_points=g.entropy_cut_points,
    )
    return loss, {**data, "granular_group_ids": ids}


# make_batch's advantage layouts, as the report names them
ADV_LAYOUTS = {
    "row": "one value per response on every token of its row (NeMo-RL's `advantages.expand(mask.shape)`)",
    "masked": "one value per response on its response tokens, 0 elsewhere",
}


def _peer_mode(name: str) -> str:
    """NeMo-RL's mode of the same math as our preset: token ratios for ``grpo``, else GSPO's."""
    return "token" if name == "grpo" else "GSPO"


def contenders(today, nxt, data, compiled: bool = False):
    """name -> (loss, batch, {column: peer name}); ``compiled``: the `minimal` ones with
    ``enable_torch_compile`` too, NeMo-RL's and ours (each paired with its eager self and with
    the rewrite's compiled mode of the same math)."""
    out = {}
    if today is not None:
        Fn, Cfg, _ = today
        out["NeMo-RL today: token"] = (Fn(Cfg(**KL_OFF)), data, {})
        out["NeMo-RL today: GSPO"] = (Fn(Cfg(**GSPO_MODE)), data, {})
    if nxt is not None:
        Fn, Cfg = nxt
        for level in LEVELS:
            out[f"NeMo-RL next: token {level}"] = (Fn(Cfg(**KL_OFF, metrics_level=level)), data, {})
            out[f"NeMo-RL next: GSPO {level}"] = (Fn(Cfg(**GSPO_MODE, metrics_level=level)), data, {})
    for name in OURS:
        mode = _peer_mode(name)
        for level in LEVELS:
            loss, d = _ours(name, level, data)
            peers = {
                "today": f"NeMo-RL today: {mode}",
                "next": f"NeMo-RL next: {mode} {level}",
                "next_min": f"NeMo-RL next: {mode} minimal",
            }
            out[f"{name} {level}"] = (loss, d, peers)
    for name in IDS_IN_LOSS:
        loss, d = _ours(name, "minimal", data)
        out[f"{name} minimal, ids in the loss"] = (loss, d, {"ids": f"{name}+ids minimal"})
    if compiled and nxt is not None:
        Fn, Cfg = nxt
        out["NeMo-RL next: token minimal compiled"] = (
            Fn(Cfg(**KL_OFF, metrics_level="minimal", enable_torch_compile=True)),
            data,
            {"eager": "NeMo-RL next: token minimal"},
        )
        out["NeMo-RL next: GSPO minimal compiled"] = (
            Fn(Cfg(**GSPO_MODE, metrics_level="minimal", enable_torch_compile=True)),
            data,
            {"eager": "NeMo-RL next: GSPO minimal"},
        )
        for name in OURS:
            mode = _peer_mode(name)
            loss, d = _ours(name, "minimal", data, enable_torch_compile=True)
            out[f"{name} minimal compiled"] = (
                loss,
                d,
                {"eager": f"{name} minimal", "next_min": f"NeMo-RL next: {mode} minimal compiled"},
            )
    return out


def _call(fn, logp, data, gvs, gvt, device):
    lp = logp.clone().requires_grad_(True)
    loss, _ = fn(next_token_logprobs=lp, data=data, global_valid_seqs=gvs, global_valid_toks=gvt)
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench(today, nxt, args, device):
    rows = []
    threads = args.threads if device.type == "cpu" else [torch.get_num_threads()]
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    for nt in threads:
        torch.set_num_threads(nt)
        for S in args.seq_lens:
            data, logp, gvs, gvt = make_batch(args.B, S, device, adv_layout=args.adv_layout)
            cont = contenders(today, nxt, data, args.compile)
            first = {}  # the first call of each (a compiled one compiles then), in seconds
            for name, (fn, d, _) in cont.items():
                t0 = time.perf_counter()
                _call(fn, logp, d, gvs, gvt, device)
                first[name] = time.perf_counter() - t0
            times = {k: [] for k in cont}
            order = random.Random(S * 10 + nt)
            for k in range(args.warmup + args.repeats):
                names = list(cont)
                order.shuffle(names)
                for name in names:
                    fn, d, _ = cont[name]
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    t0 = clock()
                    _call(fn, logp, d, gvs, gvt, device)
                    if k >= args.warmup:
                        times[name].append((clock() - t0) * 1e3)
            ntok = int(gvt.item())
            for name, (fn, d, peers) in cont.items():
                xs = {
                    col: statistics.median(a / b for a, b in zip(times[name], times[p]))
                    for col, p in peers.items()
                    if p in times
                }
                mem = memory_bytes(fn, logp, d, gvs, gvt, device) / 2**20
                row = dict(name=name, S=S, threads=nt, tokens=ntok, ms=statistics.median(times[name]), mem=mem, **xs)
                row["first_s"] = first[name]
                rows.append(row)
                cols = "  ".join(
                    f"x{row[c]:.2f} vs {c}" for c in ("today", "next", "next_min", "eager", "ids") if c in row
                )
                print(f"  threads={nt} S={S:5d} {name:28s} {row['ms']:8.2f} ms  mem {mem:7.2f} MB  {cols}", flush=True)
    return rows


def _x(r, col):
    return f"{r[col]:.2f}" if col in r else "–"


def to_markdown(args, device, rows, why) -> str:
    mem_kind = (
        "peak extra `torch.cuda.max_memory_allocated` of forward+backward"
        if device.type == "cuda"
        else "bytes autograd saves for backward"
    )
    L = [
        f"## Against NeMo-RL's loss, today's and the rewrite (`benchmarks/loss_vs_nemo_rl.py`"
        f"{' --quick' if args.quick else ''})",
        "",
        f"Machine: {machine()}; device: {device}; clock: {args.clock}"
        + (" (process CPU time: the machine was shared with other jobs)" if args.clock == "cpu" else "")
        + ".",
        f"NeMo-RL today: `NEMO_RL_SRC` ({why.get('today') or 'loaded'}); NeMo-RL next: pull request 3751's "
        f"`loss_functions.py` ({why.get('next') or 'loaded'}).",
        "",
        f"B={args.B}, float32, KL off, advantages {ADV_LAYOUTS[args.adv_layout]}; {args.repeats} rounds, "
        "each contender once per round in a shuffled order. "
        "× today = time ÷ today's `ClippedPGLossFn` of the same math (it has only `full` metrics); × next = "
        "÷ the rewrite of the same math at the same `metrics_level`; × next min = ÷ the rewrite's fastest mode "
        f"(`minimal`) of the same math. mem = {mem_kind}.",
        "",
    ]
    tgt = [
        "| target: ours ≤ NeMo-RL's fastest mode of the same math (`minimal`) | threads | S | × next min | |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        if r["name"].endswith(" minimal") and not r["name"].startswith("NeMo-RL") and "next_min" in r:
            tgt.append(
                f"| {r['name']} | {r['threads']} | {r['S']} | {r['next_min']:.3f} | "
                f"{'met' if r['next_min'] <= 1.0 else '**not met**'} |"
            )
    if len(tgt) > 2:
        L += tgt + [""]
    in_loss = [r for r in rows if "ids" in r]
    if in_loss:
        L += [
            "| ids computed in the loss ÷ precomputed (`minimal`) | threads | S | × | target ≤ 2× (ESPO) |",
            "|---|---|---|---|---|",
        ]
        for r in in_loss:
            met = ("met" if r["ids"] <= 2.0 else "**not met**") if r["name"].startswith("espo") else "–"
            L.append(f"| {r['name']} | {r['threads']} | {r['S']} | {r['ids']:.3f} | {met} |")
        L.append("")
    extra = " × eager | first call s |" if args.compile else ""
    L += [
        "| threads | S | tokens | loss | ms | × today | × next | × next min | mem MB |" + extra,
        "|---|---|---|---|---|---|---|---|---|" + ("---|---|" if args.compile else ""),
    ]
    for r in rows:
        L.append(
            f"| {r['threads']} | {r['S']} | {r['tokens']} | {r['name']} | {r['ms']:.2f} | {_x(r, 'today')} | "
            f"{_x(r, 'next')} | {_x(r, 'next_min')} | {r['mem']:.2f} |"
            + (f" {_x(r, 'eager')} | {r['first_s']:.1f} |" if args.compile else "")
        )
    if args.compile:
        L += [
            "",
            "Compiled: `enable_torch_compile: true` (torch.compile, inductor, NeMo-RL's arguments); × next min "
            "of a compiled loss = ÷ the rewrite's compiled `minimal` of the same math; × eager = ÷ the same loss "
            "uncompiled; first call = its first forward + backward, compilation included (torch's on-disk "
            "inductor cache shortens it in a later process).",
        ]
    return "\n".join(L) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--nemo-rl-next",
        default=os.environ.get("NEMO_RL_NEXT"),
        help="the rewrite's loss_functions.py (or a checkout of pull request 3751's head)",
    )
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--quick", action="store_true", help="small sizes, few rounds (a smoke run)")
    ap.add_argument("--B", type=int, default=64)
    ap.add_argument("--seq-lens", type=int, nargs="+", default=None)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="CPU threads (ignored on cuda)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--no-write", action="store_true", help="print only, do not update docs/benchmarks.md")
    ap.add_argument(
        "--adv-layout",
        choices=tuple(ADV_LAYOUTS),
        default="row",
        help="the advantages' layout: " + "; ".join(f"{k}: {v}" for k, v in ADV_LAYOUTS.items()),
    )
    ap.add_argument(
        "--compile",
        action="store_true",
        help="also the minimal losses with enable_torch_compile (torch.compile with inductor; minutes to compile)",
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.B = min(args.B, 16)
    args.seq_lens = args.seq_lens or ([256] if args.quick else [1024, 4096])
    args.repeats = args.repeats or (3 if args.quick else 15)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device is visible")
    if device.type == "cuda":
        args.clock = "wall"
    today, why_today = load_nemo_rl()
    nxt, why_next = load_nemo_rl_next(args.nemo_rl_next) if today is not None else (None, why_today)
    why = {"today": why_today, "next": why_next}
    for k, v in why.items():
        if v:
            print(f"NeMo-RL {k}: skipped ({v})")
    print(f"machine: {machine()}  device: {device}  clock: {args.clock}")
    t0 = time.time()
    rows = bench(today, nxt, args, device)
    md = to_markdown(args, device, rows, why) + f"\nTotal {time.time() - t0:.0f} s.\n"
    print()
    print(md)
    if not args.no_write:  # one section per device, clock and thread counts
        threads = "" if device.type == "cuda" else "_t" + "-".join(map(str, args.threads))
        layout = "" if args.adv_layout == "row" else f"_adv_{args.adv_layout}"
        compiled = "_compile" if args.compile else ""
        update_section(f"loss_vs_nemo_rl_{device.type}_{args.clock}{threads}{compiled}{layout}", md)
    return md


if __name__ == "__main__":
    main()
