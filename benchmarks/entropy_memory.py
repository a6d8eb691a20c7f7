"""Peak extra memory of the π_old entropy pass against NeMo-RL's log-prob-only pass, at Qwen's
vocabulary |V| = 151,936, with ``logprob_chunk_size: null`` (issue 26, item 7).

Each contender runs once per measurement on the same bf16 logits ``[1, N, V]`` (no grad, one
process; NeMo-RL's pass gets a one-rank process group — gloo on CPU, NCCL on a GPU):
  * NeMo-RL: ``from_parallel_logits_to_logprobs(..., inference_only=True, chunk_size=None)`` (its
    log-prob pass when ``logprob_chunk_size`` is null), from the checkout named by ``NEMO_RL_SRC``;
  * ours: ``vocab_parallel_entropy(logits, group, chunk_size=None)`` — the entropy our workers add
    next to NeMo-RL's log-probs — and the fused ``vocab_parallel_logprob_and_entropy``;
  * ours with one chunk of all N positions (what a null chunk size meant before: the whole
    ``[N, V]`` block at once), for scale.
Peak extra memory = on a GPU ``torch.cuda.max_memory_allocated`` during the call minus the
memory allocated before it; on CPU the resident high-water mark (``VmHWM``, reset before the call)
minus the resident size before it. The time is the median of ``--repeats`` calls.

    NEMO_RL_SRC=<NeMo-RL checkout> python benchmarks/entropy_memory.py                 # CPU, N=512
    NEMO_RL_SRC=<NeMo-RL checkout> python benchmarks/entropy_memory.py --device cuda   # GPU, N=16384

Writes the ``entropy_memory`` (``entropy_memory_cuda``) section of docs/benchmarks.md.
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
from nemo_granular.distributed.vocab_parallel import (
    MAX_BLOCK_ELEMENTS,
    chunk_rows,
    vocab_parallel_entropy,
    vocab_parallel_logprob_and_entropy,
)
from peers import load_nemo_rl, peak_extra_bytes

VOCAB = 151_936


def _group(device):
    import socket

    import torch.distributed as dist

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
        )
    return dist.group.WORLD


def _peak(call, device) -> int | None:
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        call()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    return peak_extra_bytes(call)


def _time(call, device, repeats) -> float:
    out = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--positions", type=int, default=None, help="N (default: 512 on CPU, 16384 on a GPU)")
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device is visible")
    if device.type == "cpu":
        torch.set_num_threads(1)
    N, V = args.positions or (16384 if device.type == "cuda" else 512), args.vocab
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(1, N, V, generator=g) * 3).to(torch.bfloat16).to(device)
    target = torch.randint(0, V, (1, N), generator=g).to(device)
    group = _group(device)
    nemo, why = load_nemo_rl()
    cont = {}
    if nemo is not None:
        mu = nemo[2]
        cont["NeMo-RL log-prob pass (chunk_size null)"] = lambda: mu.from_parallel_logits_to_logprobs(
            logits, target, 0, V, group, inference_only=True, chunk_size=None
        )
    cont["ours: entropy (chunk_size null)"] = lambda: vocab_parallel_entropy(logits, group, None)
    cont["ours: logprob + entropy (chunk_size null)"] = lambda: vocab_parallel_logprob_and_entropy(
        logits, target, group, 0, None
    )
    cont[f"ours: entropy, one chunk of all {N} positions"] = lambda: vocab_parallel_entropy(logits, group, N)
    rows = []
    with torch.no_grad():
        for name, call in cont.items():
            call()  # warm-up
            peak = _peak(call, device)
            ms = _time(call, device, args.repeats)
            rows.append((name, peak, ms))
            print(
                f"  {name:55s} peak extra {peak / 2**20 if peak is not None else float('nan'):9.1f} MiB  {ms:9.1f} ms",
                flush=True,
            )
    rows_per_chunk = chunk_rows(None, V)
    block = rows_per_chunk * V * 4
    f32_all = N * V * 4
    L = [
        f"## π_old entropy pass: peak extra memory (`benchmarks/entropy_memory.py`"
        f"{' --device cuda' if device.type == 'cuda' else ''})",
        "",
        f"Machine: {machine()}; device: {device}. bf16 logits [1, {N}, {V}] ({N * V * 2 / 2**20:.0f} MiB); "
        f"a float32 copy of them is {f32_all / 2**20:.0f} MiB. With `logprob_chunk_size: null` our pass works in "
        f"chunks of {rows_per_chunk} positions (`MAX_BLOCK_ELEMENTS` = {MAX_BLOCK_ELEMENTS} floats ÷ 2V): at most "
        f"two float32 blocks of {block / 2**20:.0f} MiB (the exponentials, and on CPU the float32 cast a mixed-dtype "
        f"op makes of one bf16 chunk). Peak extra = "
        + (
            "`torch.cuda.max_memory_allocated` minus the memory allocated before the call"
            if device.type == "cuda"
            else "resident high-water mark (`VmHWM`, reset) minus the resident size before the call"
        )
        + f"; time = median of {args.repeats} calls.",
        "",
    ]
    if why:
        L += [f"NeMo-RL row skipped: {why}.", ""]
    base = rows[0][1] if nemo is not None else None
    L += ["| pass | peak extra MiB | × NeMo-RL's log-prob pass | ms |", "|---|---|---|---|"]
    for name, peak, ms in rows:
        x = f"{peak / base:.2f}" if base and peak is not None else "–"
        L.append(f"| {name} | {peak / 2**20 if peak is not None else float('nan'):.1f} | {x} | {ms:.1f} |")
    md = "\n".join(L) + "\n"
    print()
    print(md)
    if not args.no_write:
        update_section("entropy_memory" + ("_cuda" if device.type == "cuda" else ""), md)
    return md


if __name__ == "__main__":
    main()
