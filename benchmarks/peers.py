"""Side by side with the peers, in one process: the policy loss against NeMo-RL's own
``ClippedPGLossFn``, and the π_old logprob+entropy pass against plain ``log_softmax`` + gather,
NeMo-RL's, verl's and TRL's helpers.

Part 1 — forward + backward given next-token logprobs (the model is not part of it), float32,
B rows × S columns, NeMo-RL-style batches (``benchmarks/loss_overhead.make_batch``):
  * NeMo-RL ``ClippedPGLossFn`` token level (``token_level_loss=True``) and GSPO mode
    (``sequence_level_importance_ratios=True, token_level_loss=False``, ε = 3e-4/4e-4), KL off in
    both (the presets' default), from the checkout named by ``NEMO_RL_SRC``;
  * every preset of ours; ``+ids`` = group ids precomputed once per rollout, as both hosts do.
  Each of ours is paired with the NeMo-RL loss of the same math (grpo/sppo ↔ token level, the
  sequence/segment/entropy presets ↔ GSPO mode, their closest host loss). Reported: median of
  interleaved repeats (shuffled order each round), ratio to the paired NeMo-RL loss, µs/token
  (linearity), peak extra resident memory of one call (Linux ``VmHWM`` after a reset) and the
  bytes autograd saves for backward.
Part 2 — π_old pass (no grad) on float32 logits ``[N, V]``: plain ``log_softmax`` + gather (the
  baseline), our logprob-only and fused logprob+entropy passes, NeMo-RL's
  ``ChunkedDistributedEntropy`` + ``ChunkedDistributedLogprob`` (a one-process gloo group), verl's
  ``entropy_from_logits_with_chunking`` + ``logprobs_from_logits_v2`` and TRL's
  ``entropy_from_logits`` + ``selective_log_softmax`` when their source is on ``PEERS_PATH``
  (an unpacked ``pip download --no-deps`` wheel; nothing of theirs is copied here). Reported:
  median time, ratio to the baseline, peak extra memory, max |H − H_float64|.

Targets (issue 14): grpo/gspo ≤ 1.0× NeMo-RL's loss of the same math; sspo/espo with ids ≤ 1.3×
NeMo-RL's GSPO; logprob+entropy ≤ 1.2× plain log_softmax+gather with peak extra memory ≤ one
chunk. Writes the ``peers`` section of docs/benchmarks.md.

    NEMO_RL_SRC=<NeMo-RL checkout> python benchmarks/peers.py            # the documented run
    python benchmarks/peers.py --quick --no-write                         # a smoke run
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import random
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import machine, update_section  # noqa: E402
from loss_overhead import make_batch, make_loss, memory_bytes  # noqa: E402
from nemo_granular.config import PRESETS  # noqa: E402
from nemo_granular.core.entropy import logprobs_and_entropy_from_logits, logprobs_from_logits  # noqa: E402
from nemo_granular.core.groups import group_ids_for  # noqa: E402

TOKEN_PEER, GSPO_PEER = "NeMo-RL token-level", "NeMo-RL GSPO"


# ----------------------------------------------------------------------------- peers
def load_nemo_rl():
    """(ClippedPGLossFn, ClippedPGLossConfig, model_utils) from ``NEMO_RL_SRC``, or (None, why)."""
    src = os.environ.get("NEMO_RL_SRC")
    if not src:
        return None, "NEMO_RL_SRC is unset (point it at a NeMo-RL checkout; see scripts/nemo_rl_env.sh)"
    if not (Path(src) / "nemo_rl").is_dir():
        return None, f"NEMO_RL_SRC={src} has no nemo_rl/ package"
    shim = ROOT / "tests" / "harness" / "host_shims" / "typing_shim" / "sitecustomize.py"  # Python < 3.12 typing names
    exec(compile(shim.read_text(), str(shim), "exec"), {})
    sys.path.insert(0, str(Path(src).resolve()))
    try:
        from nemo_rl.algorithms.loss.loss_functions import ClippedPGLossConfig, ClippedPGLossFn
        from nemo_rl.distributed import model_utils
    except Exception as exc:  # noqa: BLE001 - reported in the table, not fatal
        return None, f"importing NeMo-RL from {src} failed: {type(exc).__name__}: {exc}"
    return (ClippedPGLossFn, ClippedPGLossConfig, model_utils), None


def _load_functions(path: Path, names: tuple[str, ...], env: dict) -> dict:
    """The named top-level functions of a peer's source file, executed from that file (their
    module-level imports — accelerate, tensordict, ... — are not needed by these helpers and not
    installed here, so only the function definitions are compiled, with ``env`` as globals)."""
    import ast

    tree = ast.parse(path.read_text(), str(path))
    keep = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    missing = set(names) - {n.name for n in keep}
    if missing:
        raise ImportError(f"{path.name} has no {sorted(missing)}")
    namespace = {"torch": torch, "F": torch.nn.functional, **env}
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(path), "exec"), namespace)
    return {n: namespace[n] for n in names}


def load_verl_trl():
    """verl's / TRL's entropy helpers from their sources on ``PEERS_PATH`` (folders holding
    ``verl/`` or ``trl/`` unpacked from their wheels), or the reason each is absent. CPU paths:
    TRL's Triton kernel is off (``is_triton_available`` → False), as on a machine without it."""
    found, why = {}, {}
    roots = [Path(p) for p in os.environ.get("PEERS_PATH", "").split(os.pathsep) if p]
    for key, rel, names, env in (
        (
            "verl",
            "verl/utils/torch_functional.py",
            ("entropy_from_logits_with_chunking", "logprobs_from_logits_v2"),
            {},
        ),
        (
            "trl",
            "trl/trainer/utils.py",
            ("selective_log_softmax", "entropy_from_logits", "selective_log_softmax_and_entropy"),
            {"is_triton_available": lambda: False},
        ),
    ):
        path = next((r / rel for r in roots if (r / rel).is_file()), None)
        if path is None:
            why[key] = f"no {key} source on PEERS_PATH (unpack `pip download --no-deps {key}` there)"
            continue
        try:
            found[key] = _load_functions(path, names, env)
        except Exception as exc:  # noqa: BLE001 - reported in the table, not fatal
            why[key] = f"loading {rel} failed: {type(exc).__name__}: {exc}"
    return found, why


# ----------------------------------------------------------------------------- memory
_LIBC = ctypes.CDLL("libc.so.6") if sys.platform.startswith("linux") else None


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def peak_extra_bytes(call) -> int | None:
    """Peak resident memory of ``call()`` above the resident memory before it (Linux: freed
    memory is returned with malloc_trim, the high-water mark reset through clear_refs)."""
    if _LIBC is None:
        return None
    gc.collect()
    _LIBC.malloc_trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return None
    base = _status_kb("VmRSS:")
    call()
    return max(0, _status_kb("VmHWM:") - base) * 1024


# ----------------------------------------------------------------------------- part 1
def fwd_bwd(fn, logp, data, gvs, gvt):
    lp = logp.clone().requires_grad_(True)
    loss, _ = fn(next_token_logprobs=lp, data=data, global_valid_seqs=gvs, global_valid_toks=gvt)
    loss.backward()
    return lp.grad


def loss_contenders(nemo, data):
    """name -> (loss object, batch, NeMo-RL peer name or None)."""
    out = {}
    if nemo is not None:
        Fn, Cfg, _ = nemo
        out[TOKEN_PEER] = (Fn(Cfg(reference_policy_kl_penalty=0.0)), data, None)
        out[GSPO_PEER] = (
            Fn(
                Cfg(
                    reference_policy_kl_penalty=0.0,
                    ratio_clip_min=3e-4,
                    ratio_clip_max=4e-4,
                    token_level_loss=False,
                    sequence_level_importance_ratios=True,
                )
            ),
            data,
            None,
        )
    for name, spec in PRESETS.items():
        peer = TOKEN_PEER if spec["granularity"] == "token" else GSPO_PEER
        loss = make_loss(name)
        out[name] = (loss, data, peer)
        if spec["granularity"] in ("segment", "entropy_group"):
            g = loss.granular
            ids = group_ids_for(
                g.granularity,
                data["token_mask"] > 0,
                token_ids=data["input_ids"],
                entropy=data["prev_entropy"],
                delimiter_table=loss.delimiter_table,
                entropy_cut_points=g.entropy_cut_points,
            )
            out[f"{name}+ids"] = (loss, {**data, "granular_group_ids": ids}, peer)
    return out


def bench_losses(nemo, B, seq_lens, threads, repeats, warmup=2):
    """Each round runs every contender once in a shuffled order; a contender's ratio to its
    NeMo-RL peer is the median over rounds of (its time ÷ the peer's time in the same round),
    which a load change on a shared machine shifts far less than a ratio of medians. Small
    sizes get more rounds (the same total time as the largest)."""
    rows = []
    for nt in threads:
        torch.set_num_threads(nt)
        for S in seq_lens if nt == threads[0] else [max(seq_lens)]:  # more threads: the largest size only
            data, logp, gvs, gvt = make_batch(B, S, torch.device("cpu"))
            ntok = int(gvt.item())
            cont = loss_contenders(nemo, data)
            rounds = repeats * max(1, max(seq_lens) // S) if S < max(seq_lens) else repeats
            times = {k: [] for k in cont}
            order = random.Random(S * 10 + nt)
            for k in range(warmup + rounds):
                names = list(cont)
                order.shuffle(names)
                for name in names:
                    fn, d, _ = cont[name]
                    t0 = time.perf_counter()
                    fwd_bwd(fn, logp, d, gvs, gvt)
                    if k >= warmup:
                        times[name].append((time.perf_counter() - t0) * 1e3)
            med = {k: statistics.median(v) for k, v in times.items()}
            for name, (fn, d, peer) in cont.items():
                peak = peak_extra_bytes(partial(fwd_bwd, fn, logp, d, gvs, gvt))
                saved = memory_bytes(fn, logp, d, gvs, gvt, torch.device("cpu"))
                x_peer = statistics.median(a / b for a, b in zip(times[name], times[peer])) if peer in times else None
                row = dict(
                    name=name,
                    peer=peer,
                    S=S,
                    threads=nt,
                    tokens=ntok,
                    ms=med[name],
                    rounds=rounds,
                    us_tok=1e3 * med[name] / ntok,
                    peak_mb=None if peak is None else peak / 2**20,
                    saved_mb=saved / 2**20,
                    x_peer=x_peer,
                )
                rows.append(row)
                x = f"x{x_peer:.2f} vs {peer}" if x_peer is not None else ""
                print(
                    f"  threads={nt} S={S:5d} {name:22s} {med[name]:8.2f} ms {row['us_tok']:7.3f} us/tok "
                    f"peak {row['peak_mb'] or 0:7.1f} MB saved {row['saved_mb']:6.2f} MB  {x}",
                    flush=True,
                )
    torch.set_num_threads(threads[0])
    return rows


# ----------------------------------------------------------------------------- part 2
def _gloo_group():
    import torch.distributed as dist

    if not dist.is_initialized():
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    return dist.group.WORLD


def entropy_contenders(nemo, peers, chunk):
    """name -> callable(z [N, V], targets [N]) -> (logp, H or None)."""

    def plain(z, t):
        return torch.log_softmax(z, -1).gather(-1, t[:, None]).squeeze(-1), None

    out = {
        "log_softmax+gather (baseline)": plain,
        "ours: logprob only": lambda z, t: (logprobs_from_logits(z, t, chunk), None),
        "ours: logprob+entropy": lambda z, t: logprobs_and_entropy_from_logits(z, t, chunk),
    }
    if nemo is not None:
        mu = nemo[2]
        group = _gloo_group()

        def nemo_fn(z, t):
            V = z.shape[-1]
            H = -mu.ChunkedDistributedEntropy.apply(z[None], chunk, group, True)[0]  # it returns Σ p·log p
            lp = mu.ChunkedDistributedLogprob.apply(z[None], t[None], 0, V, chunk, group, True)[0]
            return lp, H

        out["NeMo-RL: ChunkedDistributedEntropy + ChunkedDistributedLogprob"] = nemo_fn
    if "verl" in peers:
        v = peers["verl"]
        out["verl: entropy_from_logits_with_chunking + logprobs_from_logits_v2"] = lambda z, t: (
            v["logprobs_from_logits_v2"](z, t),
            v["entropy_from_logits_with_chunking"](z, chunk),
        )
    if "trl" in peers:
        f = peers["trl"]["selective_log_softmax_and_entropy"]
        out["TRL: selective_log_softmax_and_entropy"] = lambda z, t: f(z, t, entropy_requires_grad=False)
    return out


def _reference_entropy(z):
    zd = z.double()
    return -(torch.softmax(zd, -1) * torch.log_softmax(zd, -1)).sum(-1)


def bench_entropy(nemo, peers, vocabs, positions, chunk, threads, repeats, warmup=1):
    rows = []
    for nt in threads:
        torch.set_num_threads(nt)
        for V in vocabs if nt == threads[0] else [max(vocabs)]:  # more threads: the largest vocabulary only
            g = torch.Generator().manual_seed(V)
            z = torch.randn(positions, V, generator=g) * 3
            tgt = torch.randint(0, V, (positions,), generator=g)
            cont = entropy_contenders(nemo, peers, chunk)
            times = {k: [] for k in cont}
            with torch.no_grad():
                for k in range(warmup + repeats):
                    for name, fn in cont.items():  # the baseline first in every round
                        t0 = time.perf_counter()
                        fn(z, tgt)
                        if k >= warmup:
                            times[name].append((time.perf_counter() - t0) * 1e3)
                ref_rows = slice(0, min(positions, 256))
                H_ref = _reference_entropy(z[ref_rows])
                base_t = times["log_softmax+gather (baseline)"]
                for name, fn in cont.items():
                    peak = peak_extra_bytes(partial(fn, z, tgt))
                    _, H = fn(z[ref_rows], tgt[ref_rows])
                    err = None if H is None else float((H.double() - H_ref).abs().max())
                    t = statistics.median(times[name])
                    x_base = statistics.median(a / b for a, b in zip(times[name], base_t))
                    rows.append(
                        dict(
                            name=name,
                            V=V,
                            N=positions,
                            threads=nt,
                            ms=t,
                            x_base=x_base,
                            peak_mb=None if peak is None else peak / 2**20,
                            err=err,
                        )
                    )
                    print(
                        f"  threads={nt} V={V:6d} N={positions} {name:70s} {t:9.2f} ms x{x_base:5.2f} "
                        f"peak {rows[-1]['peak_mb'] or 0:8.1f} MB err {err if err is not None else '-'}",
                        flush=True,
                    )
            del z
    torch.set_num_threads(threads[0])
    return rows


# ----------------------------------------------------------------------------- report
def _fmt(x, spec=".2f", none="–"):
    return none if x is None else format(x, spec)


def to_markdown(args, nemo_why, peer_why, loss_rows, ent_rows) -> str:
    L = [
        f"## Side by side with the peers (`benchmarks/peers.py`{' --quick' if args.quick else ''})",
        "",
        f"Machine: {machine()}; CPU only (no GPU was lent to this session, so there are no GPU numbers). "
        "The 2-core machine was shared with other jobs while this ran: read the ratios (each contender "
        "interleaved with its peer in the same process), not the absolute times.",
        "",
    ]
    largest = max(args.seq_lens)
    if nemo_why:
        L += [f"**NeMo-RL column skipped**: {nemo_why}.", ""]

    # targets
    def worst(names, nt=1):
        rs = [
            r
            for r in loss_rows
            if r["name"] in names and r["S"] == largest and r["threads"] == nt and r["x_peer"] is not None
        ]
        return max(rs, key=lambda r: r["x_peer"]) if rs else None

    tgt = []
    if not nemo_why:
        for label, names, limit in (
            ("`grpo` vs NeMo-RL token-level", ["grpo"], 1.0),
            ("`gspo` vs NeMo-RL GSPO", ["gspo"], 1.0),
            ("`sspo`/`espo` (ids precomputed) vs NeMo-RL GSPO", ["sspo+ids", "sspo_no_ec+ids", "espo+ids"], 1.3),
        ):
            for nt in args.threads:
                w = worst(names, nt)
                if w:
                    tgt.append(
                        f"| {label}, {nt} thread{'s' if nt > 1 else ''}, S={largest} | ≤ {limit}× | "
                        f"{w['x_peer']:.2f}× ({w['name']}) | "
                        f"{'met' if w['x_peer'] <= limit else '**not met**'} |"
                    )
    ents = [r for r in ent_rows if r["name"] == "ours: logprob+entropy"]
    for r in ents:
        chunk_mb = args.chunk * r["V"] * 4 / 2**20
        ok = r["x_base"] <= 1.2 and (r["peak_mb"] is None or r["peak_mb"] <= chunk_mb * 1.05)
        tgt.append(
            f"| logprob+entropy vs log_softmax+gather, V={r['V']}, {r['threads']} thread"
            f"{'s' if r['threads'] > 1 else ''} | ≤ 1.2×, peak ≤ one chunk ({chunk_mb:.0f} MB) | "
            f"{r['x_base']:.2f}×, peak {_fmt(r['peak_mb'], '.1f')} MB | {'met' if ok else '**not met**'} |"
        )
    L += ["| target | limit | measured | |", "|---|---|---|---|", *tgt, ""]
    L += [
        f"### Policy loss, forward + backward (B={args.B}, float32, KL off)",
        "",
        f"Rounds: {args.repeats} at the largest S, proportionally more at smaller S; every round runs each "
        "contender once in a shuffled order. ms = median over rounds; × peer = median over rounds of "
        "(time ÷ the time of the NeMo-RL loss of the same math in the same round). peak = extra resident "
        "memory of one call; saved = bytes autograd keeps for backward. `sppo` runs exactly `grpo`'s "
        "computation (only its advantage estimator differs): the spread between the two rows is this "
        "machine's noise.",
        "",
        "| threads | S | tokens | loss | ms | × peer | µs/token | peak MB | saved MB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in loss_rows:
        peer = f"{r['x_peer']:.2f} ({'tok' if r['peer'] == TOKEN_PEER else 'GSPO'})" if r["x_peer"] is not None else "–"
        L.append(
            f"| {r['threads']} | {r['S']} | {r['tokens']} | {r['name']} | {r['ms']:.2f} | {peer} | "
            f"{r['us_tok']:.3f} | {_fmt(r['peak_mb'], '.1f')} | {r['saved_mb']:.2f} |"
        )
    small = min(args.seq_lens)
    lin = []
    for name in dict.fromkeys(r["name"] for r in loss_rows):
        a = [r for r in loss_rows if r["name"] == name and r["S"] == small and r["threads"] == args.threads[0]]
        b = [r for r in loss_rows if r["name"] == name and r["S"] == largest and r["threads"] == args.threads[0]]
        if a and b:
            lin.append(f"{name} {b[0]['us_tok'] / a[0]['us_tok']:.2f}")
    L += [
        "",
        f"Linearity (µs/token at S={largest} ÷ at S={small}, {args.threads[0]} thread; 1 = linear, < 1 = "
        "per-call overhead amortised): " + ", ".join(lin) + ".",
        "",
    ]
    L += [
        f"### π_old pass: logprob (+ entropy) from float32 logits (no grad, chunk {args.chunk} positions, "
        f"{args.entropy_repeats} rounds; × = median over rounds of time ÷ the baseline's time in the same round)",
        "",
    ]
    for k, v in peer_why.items():
        L.append(f"*{k} skipped*: {v}.")
    L += [
        "",
        "| threads | V | positions | helper | ms | × log_softmax+gather | peak MB | max abs err of H vs float64 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in ent_rows:
        L.append(
            f"| {r['threads']} | {r['V']} | {r['N']} | {r['name']} | {r['ms']:.2f} | {r['x_base']:.2f} | "
            f"{_fmt(r['peak_mb'], '.1f')} | {_fmt(r['err'], '.2e')} |"
        )
    return "\n".join(L) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, few repeats (a smoke run)")
    ap.add_argument("--B", type=int, default=64)
    ap.add_argument("--seq-lens", type=int, nargs="+", default=None)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--entropy-repeats", type=int, default=None, help="rounds of the π_old pass (default 5)")
    ap.add_argument("--vocabs", type=int, nargs="+", default=None)
    ap.add_argument("--positions", type=int, default=None)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--no-write", action="store_true", help="print only, do not update docs/benchmarks.md")
    ap.add_argument("--skip-entropy", action="store_true")
    ap.add_argument("--skip-loss", action="store_true")
    args = ap.parse_args(argv)
    args.seq_lens = args.seq_lens or ([256, 1024] if args.quick else [256, 1024, 4096])
    args.repeats = args.repeats or (3 if args.quick else 11)
    args.entropy_repeats = args.entropy_repeats or (3 if args.quick else 5)
    args.vocabs = args.vocabs or ([4096] if args.quick else [4096, 32768])
    args.positions = args.positions or (512 if args.quick else 2048)
    if args.quick:
        args.B = min(args.B, 16)
    torch.set_num_threads(args.threads[0])
    nemo, nemo_why = load_nemo_rl()
    peers, peer_why = load_verl_trl()
    if nemo_why:
        print(f"NeMo-RL column skipped: {nemo_why}")
        peer_why = {"NeMo-RL": nemo_why, **peer_why}
    print(f"machine: {machine()}")
    t0 = time.time()
    loss_rows = [] if args.skip_loss else bench_losses(nemo, args.B, args.seq_lens, args.threads, args.repeats)
    ent_rows = (
        []
        if args.skip_entropy
        else bench_entropy(nemo, peers, args.vocabs, args.positions, args.chunk, args.threads, args.entropy_repeats)
    )
    md = to_markdown(args, nemo_why, peer_why, loss_rows, ent_rows)
    md += f"\nTotal {time.time() - t0:.0f} s.\n"
    print()
    print(md)
    if not args.no_write:
        update_section("peers", md)
    return md


if __name__ == "__main__":
    main()
