"""Run one function on every rank of a fresh CPU "cluster": spawned processes with the environment
NeMo-RL's ``RayWorkerGroup`` gives its worker actors (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, NODE_RANK), so the worker's own ``init_process_group`` (gloo, see ``cpu_stand_ins``) forms
the world. No Ray: the worker class is what the Ray actor would run, constructed directly.

``run_world(n, fn, *args)`` returns ``fn(rank, *args)`` of every rank, in rank order; an exception
on any rank is re-raised here with its traceback. One world per call (the Megatron worker keeps
process-global state), so a test asks everything of one world in one ``fn``.

``preload=True`` (the Megatron worlds) forks the ranks from a forkserver that imported
:mod:`megatron_cpu.preload` once, with :data:`IMPORT_ENV` (what is read at import time), instead of
spawning interpreters that each import it again. The server is single-threaded and has no process
group, so a fork of it is a clean rank; everything else (``env``, the rank variables) is set per rank.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import traceback

import torch.multiprocessing as mp

TIMEOUT_S = 600
# read when torch / huggingface_hub / transformers are imported: the forkserver imports them with these
IMPORT_ENV = {"OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, env: dict, fn, args, results) -> None:
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        NODE_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    try:
        # plain bytes: torch's queue pickler would share tensors through file descriptors that die
        # with this process, which may exit before the parent reads them
        results.put((rank, True, pickle.dumps(fn(rank, *args))))
    except BaseException:  # noqa: BLE001 - forwarded to the test process
        results.put((rank, False, traceback.format_exc()))


def _forkserver():
    """The forkserver context, its server started (once per process) with :data:`IMPORT_ENV` set."""
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["megatron_cpu.preload"])
    saved = {k: os.environ.get(k) for k in IMPORT_ENV}
    os.environ.update(IMPORT_ENV)
    try:
        forkserver.ensure_running()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return ctx


def run_world(
    world: int, fn, *args, env: dict | None = None, timeout: float = TIMEOUT_S, preload: bool = False
) -> list:
    ctx = _forkserver() if preload else mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    base = {"OMP_NUM_THREADS": "1", **(env or {})}
    if preload:
        assert {k: base.get(k, v) for k, v in IMPORT_ENV.items()} == IMPORT_ENV, "imported with IMPORT_ENV"
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, port, base, fn, args, results), daemon=False)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    errors = []
    try:
        for _ in range(world):
            try:
                rank, ok, value = results.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"no answer from the {world}-rank world within {timeout} s") from None
            if ok:
                out[rank] = pickle.loads(value)
            else:
                errors.append(f"rank {rank}:\n{value}")
                break  # the other ranks are likely stuck in a collective
    finally:
        for p in procs:
            p.join(timeout=30 if not errors else 1)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [out[r] for r in range(world)]
