#!/usr/bin/env python3
"""Ray cluster readiness and liveness probes used by ``slurm/launch.sh`` (runs on the head node).

``wait``  — connect to the Ray head and wait until ``--expected`` nodes are alive; print
            ``RAY_NODES alive=K expected=N`` and write ``--out`` (JSON: the ``ray.nodes()`` count
            and each node's host, IP and resources). Exit 0 when ready, 3 on timeout.
``watch`` — poll ``ray.nodes()`` every ``--interval`` seconds; the moment fewer than
            ``--expected`` nodes are alive, print one ``ERROR`` line naming the lost node(s) and
            exit 4 (exit 5 when the head itself stops answering). The launcher fails the job on it.

Both connect with ``ray.init(address=...)``; nothing here schedules work on the cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _log(msg: str) -> None:
    print(f"[ray_cluster {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _connect(address: str):
    import ray  # lazy: only the head node's environment needs ray

    ray.init(address=address, log_to_driver=False, logging_level="ERROR", namespace="nemo_granular_probe")
    return ray


def _snapshot(ray) -> tuple[list[dict], list[dict]]:
    nodes = ray.nodes()
    alive = [n for n in nodes if n.get("Alive")]
    dead = [n for n in nodes if not n.get("Alive")]
    return alive, dead


def _describe(n: dict) -> dict:
    return {
        "hostname": n.get("NodeManagerHostname"),
        "ip": n.get("NodeManagerAddress"),
        "node_id": n.get("NodeID"),
        "resources": n.get("Resources", {}),
    }


def _write_json(path: str, obj: dict) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def cmd_wait(args) -> int:
    ray = _connect(args.address)
    deadline = time.monotonic() + args.timeout
    last = -1
    while True:
        alive, _ = _snapshot(ray)
        if len(alive) != last:
            _log(f"{len(alive)}/{args.expected} Ray nodes alive")
            last = len(alive)
        if len(alive) >= args.expected:
            break
        if time.monotonic() > deadline:
            print(f"ERROR: only {len(alive)} of {args.expected} Ray nodes joined within {args.timeout:.0f} s", flush=True)
            return 3
        time.sleep(1.0)
    info = {"alive": len(alive), "expected": args.expected, "nodes": [_describe(n) for n in alive]}
    if args.out:
        _write_json(args.out, info)
    print(f"RAY_NODES alive={len(alive)} expected={args.expected} "
          f"hosts={','.join(sorted(str(n['NodeManagerHostname']) for n in alive))}", flush=True)
    return 0


def cmd_watch(args) -> int:
    ray = _connect(args.address)
    known: dict[str, str] = {}
    while True:
        try:
            alive, dead = _snapshot(ray)
        except Exception as err:  # the GCS (head) stopped answering
            print(f"ERROR: lost contact with the Ray head at {args.address}: {type(err).__name__}: {err}", flush=True)
            return 5
        for n in alive:
            known[n["NodeID"]] = f"{n.get('NodeManagerHostname')} ({n.get('NodeManagerAddress')})"
        if len(alive) < args.expected:
            lost = sorted({known.get(n["NodeID"], f"{n.get('NodeManagerHostname')} ({n.get('NodeManagerAddress')})")
                           for n in dead})
            print(f"ERROR: Ray node lost: {', '.join(lost) or 'unknown'} — {len(alive)} of {args.expected} nodes alive",
                  flush=True)
            return 4
        time.sleep(args.interval)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("wait", "watch"):
        s = sub.add_parser(name)
        s.add_argument("--address", required=True, help="HOST:PORT of the Ray head (GCS)")
        s.add_argument("--expected", type=int, required=True, help="number of Ray nodes the job needs")
        if name == "wait":
            s.add_argument("--timeout", type=float, default=600.0)
            s.add_argument("--out", default="")
        else:
            s.add_argument("--interval", type=float, default=5.0)
    args = p.parse_args(argv)
    if args.expected < 1:
        print("ERROR: --expected must be >= 1", file=sys.stderr)
        return 2
    return cmd_wait(args) if args.cmd == "wait" else cmd_watch(args)


if __name__ == "__main__":
    sys.exit(main())
