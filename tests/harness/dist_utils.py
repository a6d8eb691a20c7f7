"""A small pool of real torch.distributed (gloo) processes for tests.

``DistPool(world_size)`` spawns ``world_size`` processes (torch.multiprocessing, spawn),
initialises ONE gloo process group among them (``file://`` rendezvous in a temp dir) and
keeps it alive; ``pool.run(fn, *args)`` runs the picklable top-level function
``fn(rank, world_size, *args)`` on every rank and returns the per-rank results (rank order).
An exception on any rank is re-raised here with its traceback. One pool per test module
amortises the process start-up (torch import) over many cases.
"""

from __future__ import annotations

import os
import queue
import tempfile
import traceback

import torch.multiprocessing as mp

TIMEOUT_S = 120


def _worker(rank: int, world_size: int, init_file: str, tasks, results) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    while True:
        item = tasks.get()
        if item is None:
            break  # the process exits; its gloo group goes with it
        fn, args = item
        try:
            results.put((rank, True, fn(rank, world_size, *args)))
        except BaseException:  # noqa: BLE001 - forwarded to the test process
            results.put((rank, False, traceback.format_exc()))


class DistPool:
    def __init__(self, world_size: int):
        self.world_size = world_size
        self._dir = tempfile.TemporaryDirectory(prefix="gloo-")
        ctx = mp.get_context("spawn")
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        init_file = os.path.join(self._dir.name, "rendezvous")
        self._procs = [
            ctx.Process(target=_worker, args=(r, world_size, init_file, self._tasks[r], self._results), daemon=True)
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn, *args):
        for q in self._tasks:
            q.put((fn, args))
        out: dict[int, object] = {}
        errors = []
        for _ in range(self.world_size):
            try:
                rank, ok, value = self._results.get(timeout=TIMEOUT_S)
            except queue.Empty:
                raise TimeoutError(f"gloo pool: no answer within {TIMEOUT_S} s (deadlocked collective?)") from None
            if ok:
                out[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
        if errors:
            raise RuntimeError("\n".join(errors))
        return [out[r] for r in range(self.world_size)]

    def close(self) -> None:
        for q in self._tasks:
            q.put(None)
        for p in self._procs:
            p.join(timeout=20)
            if p.is_alive():
                p.terminate()
        self._dir.cleanup()
