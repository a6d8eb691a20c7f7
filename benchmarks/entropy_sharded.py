"""Fused logprob+entropy vs logprob alone, from vocabulary-sharded logits (gloo, CPU).

For TP = 1, 2, 4 this spawns TP real torch.distributed (gloo) processes; every rank holds
``[positions, V/TP]`` float32 logits and runs, under ``torch.no_grad()`` (the π_old pass),

- ``vocab_parallel_logprob``               (one MAX + one SUM all-reduce per chunk), and
- ``vocab_parallel_logprob_and_entropy``   (the same two all-reduces, one extra fused pass),

interleaved, ``--repeats`` times each; it reports the median wall time per call (max over
ranks), the ratio fused / logprob-only (target ≤ 1.2), and the peak extra resident memory
of each call on rank 0 (Linux ``VmHWM`` after resetting it through ``/proc/self/clear_refs``,
minus ``VmRSS`` before the call). Result → ``docs/benchmarks.md`` section ``entropy_sharded``.

    OMP_NUM_THREADS=1 python benchmarks/entropy_sharded.py [--positions 2048 --vocab 16384 --chunk 512]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _mem(key: str) -> int:
    with open("/proc/self/status") as fh:
        return int(re.search(rf"{key}:\s+(\d+) kB", fh.read()).group(1)) * 1024


def _peak_extra(fn) -> float:
    """MiB of resident memory above the pre-call level at the call's peak (Linux/glibc only).

    ``malloc_trim(0)`` first hands the allocator's cached free pages back to the OS, so a
    call that reuses memory freed by the previous call is still charged for it."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return float("nan")
    base = _mem("VmRSS")
    fn()
    return max(_mem("VmHWM") - base, 0) / 2**20


def _rank_main(rank: int, world: int, init_file: str, out_dir: str, args) -> None:
    import torch.distributed as dist

    from nemo_granular.distributed import vocab_parallel_logprob, vocab_parallel_logprob_and_entropy

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    group = dist.group.WORLD if world > 1 else None
    gen = torch.Generator().manual_seed(0)
    v_local = args.vocab // world
    logits = torch.randn(args.positions, v_local, generator=gen)
    target = torch.randint(0, args.vocab, (args.positions,), generator=gen)
    calls = {
        "logprob": lambda: vocab_parallel_logprob(logits, target, group, chunk_size=args.chunk),
        "fused": lambda: vocab_parallel_logprob_and_entropy(logits, target, group, chunk_size=args.chunk),
    }
    times = {k: [] for k in calls}
    peaks = {}
    with torch.no_grad():
        for k, fn in calls.items():  # warm-up + memory
            fn()
            peaks[k] = _peak_extra(fn)
        for _ in range(args.repeats):
            for k, fn in calls.items():
                dist.barrier() if world > 1 else None
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
        # sanity: the fused logprobs are the logprob-only ones
        a = calls["logprob"]()
        b = calls["fused"]()[0]
        assert torch.allclose(a, b, atol=1e-5), "fused and logprob-only disagree"
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump({"times": times, "peaks": peaks}, fh)
    dist.barrier() if world > 1 else None
    dist.destroy_process_group()


def run_tp(tp: int, args) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-entropy-") as tmp:
        mp.spawn(_rank_main, args=(tp, os.path.join(tmp, "rdzv"), tmp, args), nprocs=tp, join=True)
        ranks = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(tp)]
    med = {k: max(statistics.median(r["times"][k]) for r in ranks) for k in ("logprob", "fused")}
    best = {k: max(min(r["times"][k]) for r in ranks) for k in ("logprob", "fused")}
    return {
        "tp": tp,
        "logprob_ms": 1e3 * med["logprob"],
        "fused_ms": 1e3 * med["fused"],
        "ratio": med["fused"] / med["logprob"],
        "best_logprob_ms": 1e3 * best["logprob"],
        "best_fused_ms": 1e3 * best["fused"],
        "best_ratio": best["fused"] / best["logprob"],
        "peak_logprob": ranks[0]["peaks"]["logprob"],
        "peak_fused": ranks[0]["peaks"]["fused"],
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--positions", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--no-report", action="store_true", help="print only, do not update docs/benchmarks.md")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.perf_counter()
    rows = [run_tp(tp, args) for tp in args.tp]
    wall = time.perf_counter() - t0
    from benchmarks._report import machine, update_section

    lines = [
        "## entropy_sharded — fused logprob+entropy vs logprob alone (vocab-sharded logits, gloo, CPU)",
        "",
        f"`benchmarks/entropy_sharded.py --positions {args.positions} --vocab {args.vocab} --chunk {args.chunk} "
        f"--repeats {args.repeats}`: {args.positions} positions × V = {args.vocab} float32 logits, vocabulary split "
        f"over TP gloo processes, `torch.no_grad()` (π_old pass), chunks of {args.chunk} positions. Median wall time "
        f"per call (slowest rank), interleaved runs; peak = extra resident memory of one call on rank 0 "
        f"(VmHWM − VmRSS). Target: fused ≤ 1.2× logprob-only.",
        "",
        "| TP | V/TP | logprob-only median [ms] | fused median [ms] | ratio (median) | ratio (best of N) "
        "| peak extra logprob-only [MiB] | peak extra fused [MiB] |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['tp']} | {args.vocab // r['tp']} | {r['logprob_ms']:.1f} | {r['fused_ms']:.1f} | "
            f"{r['ratio']:.2f} | {r['best_ratio']:.2f} | {r['peak_logprob']:.1f} | {r['peak_fused']:.1f} |"
        )
    lines += [
        "",
        f"Machine: {machine()}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}; "
        f"load average at the end {os.getloadavg()[0]:.1f} (the CPU is shared: ratios are more meaningful "
        f"than absolute times); total {wall:.0f} s.",
    ]
    md = "\n".join(lines)
    print(md)
    if not args.no_report:
        update_section("entropy_sharded", md)


if __name__ == "__main__":
    main()
