#!/usr/bin/env python3
"""Stand-in driver for the Slurm launcher tests (a test fixture, not the product).

It honours the same contract as ``nemo-granular train`` so that ``slurm/launch.sh`` can be tested
before / without the embedded trainer:

    python tests/harness/slurm_stub_driver.py output_dir=DIR rl.steps=N checkpoint.every=K \
        [step_seconds=S] [seed=N] [--resume | --auto-resume]

* connects to Ray when ``RAY_ADDRESS`` is set and writes ``DIR/driver_ray_nodes.json`` with the
  ``ray.nodes()`` alive count;
* one line per step in ``DIR/metrics.jsonl`` (``step``, ``loss``, ``attempt``, ``resumed_from``);
* checkpoints ``DIR/checkpoints/step_XXXXXX/`` (written to a temp dir, then renamed) every K steps
  and at the end, and ``DIR/checkpoints/latest`` (atomic) naming the newest one;
* ``--auto-resume`` continues after the step named by ``latest`` (fresh start without one);
  ``--resume`` is strict like ``nemo-granular train --resume``: exit 2 without a checkpoint;
* on SIGUSR1 / SIGTERM: finish the current step, save a checkpoint, exit 99.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time

PREEMPTED = 99
_stop = {"sig": None}


def _on_signal(signum, _frame):
    _stop["sig"] = signal.Signals(signum).name


def _atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _save(ckpt_root: str, step: int, state: dict) -> None:
    name = f"step_{step:06d}"
    final = os.path.join(ckpt_root, name)
    if os.path.isdir(final):
        return
    tmp = os.path.join(ckpt_root, f".tmp_{name}_{os.getpid()}")
    os.makedirs(tmp, exist_ok=True)
    _atomic_write(os.path.join(tmp, "state.json"), json.dumps({**state, "step": step}))
    os.replace(tmp, final)
    _atomic_write(os.path.join(ckpt_root, "latest"), name + "\n")


def main(argv: list[str]) -> int:
    opts = {"output_dir": None, "rl.steps": "10", "checkpoint.every": "5", "step_seconds": "0.2", "seed": "0"}
    resume = ""
    for a in argv:
        if a in ("--resume", "--auto-resume"):
            resume = a
        elif "=" in a and a.split("=", 1)[0] in opts:
            k, v = a.split("=", 1)
            opts[k] = v
        else:
            print(f"slurm_stub_driver: unknown argument {a!r}", file=sys.stderr)
            return 2
    if not opts["output_dir"]:
        print("slurm_stub_driver: output_dir=... is required", file=sys.stderr)
        return 2
    out = opts["output_dir"]
    steps, every, dt = int(opts["rl.steps"]), int(opts["checkpoint.every"]), float(opts["step_seconds"])
    ckpt_root = os.path.join(out, "checkpoints")
    os.makedirs(ckpt_root, exist_ok=True)
    signal.signal(signal.SIGUSR1, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    attempt = int(os.environ.get("NG_SLURM_ATTEMPT", os.environ.get("SLURM_RESTART_COUNT", "0")))

    if os.environ.get("RAY_ADDRESS"):
        import ray

        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False, logging_level="ERROR")
        alive = [n for n in ray.nodes() if n.get("Alive")]
        print(f"DRIVER_RAY_NODES {len(alive)}", flush=True)
        _atomic_write(
            os.path.join(out, "driver_ray_nodes.json"),
            json.dumps({"alive": len(alive), "hosts": sorted(n["NodeManagerHostname"] for n in alive)}),
        )
        ray.shutdown()

    start, loss = 1, 1.0
    latest = os.path.join(ckpt_root, "latest")
    resumed_from = 0
    if resume == "--resume" and not os.path.exists(latest):
        print(f"slurm_stub_driver: --resume: nothing to resume in {ckpt_root}", file=sys.stderr)
        return 2
    if resume and os.path.exists(latest):
        name = open(latest).read().strip()
        state = json.load(open(os.path.join(ckpt_root, name, "state.json")))
        start, loss, resumed_from = state["step"] + 1, state["loss"], state["step"]
        print(f"resumed from {name}", flush=True)

    with open(os.path.join(out, "metrics.jsonl"), "a") as metrics:
        for step in range(start, steps + 1):
            time.sleep(dt)
            loss = loss * 0.9 + 0.01 * math.sin(step + int(opts["seed"]))
            metrics.write(
                json.dumps({"step": step, "loss": loss, "attempt": attempt, "resumed_from": resumed_from}) + "\n"
            )
            metrics.flush()
            if step % every == 0 or step == steps:
                _save(ckpt_root, step, {"loss": loss})
            if _stop["sig"] is not None and step < steps:
                _save(ckpt_root, step, {"loss": loss})
                print(f"preempted by {_stop['sig']} after step {step}: checkpoint saved", flush=True)
                return PREEMPTED
    print(f"finished {steps} steps", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
