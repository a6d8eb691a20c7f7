#!/usr/bin/env python3
"""Ray cluster readiness and liveness probes used by ``slurm/launch.sh`` (runs on the head node).

``wait``  — connect to the Ray head and wait until ``--expected`` nodes are alive; print
            ``RAY_NODES alive=K expected=N`` and write ``--out`` (JSON: the ``ray.nodes()`` count,
            the GCS address, this process's Ray auth mode, and each node's host, IP, resources
            and ports). Exit 0 when ready, 3 on timeout.
``watch`` — poll ``ray.nodes()`` every ``--interval`` seconds; the moment fewer than
            ``--expected`` nodes are alive, print one ``ERROR`` line naming the lost node(s), write
            their Slurm node names to ``--lost-out`` (one a line: each raylet's ``--node-name``, which
            launch.sh sets to ``SLURMD_NODENAME``; the host name where a raylet has none) and exit 4
            (the launcher excludes those nodes and requeues the job, within MAX_RESTARTS); exit 5 when the head stops
            answering: ``--failures`` probes in a row that raised (one that times out under load
            is retried at the next poll). The launcher fails the job on exit 5.

Both connect with ``ray.init(address=...)``; nothing here schedules work on the cluster. When Ray
refuses the connection (exit 6) or cannot be imported (exit 7), the one ``ERROR:`` line carries
Ray's own reason: ``ray.init`` raises a bare ``ConnectionError("Failed to connect to Ray cluster
at ...")`` (from a ``RuntimeError`` whose message is a traceback, or an ``AuthenticationError``,
depending on the auth mode); the reason is the last line Ray's C++ core wrote to stderr while it
retried (``Failed to get cluster ID from GCS server: Unauthenticated: RPC error:
InvalidAuthToken: ...``; stderr is captured during ``ray.init`` and passed on unchanged), else the
first line of the exception the error was raised from.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time


def _log(msg: str) -> None:
    print(f"[ray_cluster {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# a log line of Ray's C++ core: "[2026-11-25 01:52:45,547 W 29834 29834] gcs_client.cc:210: <message>"
_RAY_CORE_LINE = re.compile(r"^\[[^\]]*\] [\w.]+:\d+: (.+)$")


class ProbeError(Exception):
    """Ray could not be reached; ``str()`` is the one-line reason, ``code`` the exit status."""

    def __init__(self, reason: str, code: int):
        super().__init__(reason)
        self.code = code


def _first_line(err: BaseException, limit: int = 400) -> str:
    text = str(err).strip()
    line = f"{type(err).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")
    return line if len(line) <= limit else line[:limit - 3] + "..."


def _root_cause(err: BaseException) -> BaseException | None:
    cause, seen = err.__cause__ or err.__context__, set()
    while cause is not None and id(cause) not in seen and (cause.__cause__ or cause.__context__) is not None:
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return cause


def _connect(address: str, what: str):
    try:
        import ray  # lazy: only the head node's environment needs ray
    except ImportError as err:
        raise ProbeError(f"{what}: cannot import ray with {sys.executable} ({_first_line(err)})", 7) from None
    with tempfile.TemporaryFile(mode="w+") as captured:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(captured.fileno(), 2)
        try:
            ray.init(address=address, log_to_driver=False, logging_level="ERROR", namespace="nemo_granular_probe")
            failure = None
        except Exception as err:  # ConnectionError, AuthenticationError, RuntimeError (version mismatch), ...
            failure = err
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        captured.seek(0)
        text = captured.read()
    sys.stderr.write(text)           # Ray's own lines stay in the log
    if failure is not None:
        cause = _root_cause(failure)
        said = [m.group(1) for m in map(_RAY_CORE_LINE.match, text.splitlines()) if m]
        reason = said[-1] if said else _first_line(cause) if cause is not None else None
        reason = f"{reason} ({_first_line(failure)})" if reason else _first_line(failure)
        raise ProbeError(f"{what}: cannot connect to the Ray head at {address}: {reason}", 6)
    return ray


def _auth_mode() -> str:
    try:
        from ray._raylet import AuthenticationMode, get_authentication_mode
    except ImportError:          # a Ray without token authentication
        return "none"
    return "token" if get_authentication_mode() == AuthenticationMode.TOKEN else "disabled"


def _snapshot(ray) -> tuple[list[dict], list[dict]]:
    nodes = ray.nodes()
    alive = [n for n in nodes if n.get("Alive")]
    dead = [n for n in nodes if not n.get("Alive")]
    return alive, dead


def _slurm_name(n: dict) -> str:
    """The Slurm node a Ray node ran on: its ``--node-name`` (Ray's default is its IP address, not a name)."""
    name = str(n.get("NodeName") or "")
    return name if name and name != n.get("NodeManagerAddress") else str(n.get("NodeManagerHostname"))


def _describe(n: dict) -> dict:
    return {
        "hostname": n.get("NodeManagerHostname"),
        "node_name": n.get("NodeName"),      # the raylet's --node-name (Ray's default: its IP)
        "ip": n.get("NodeManagerAddress"),
        "node_id": n.get("NodeID"),
        "resources": n.get("Resources", {}),
        "ports": {"node_manager": n.get("NodeManagerPort"), "object_manager": n.get("ObjectManagerPort"),
                  "metrics_export": n.get("MetricsExportPort")},
    }


def _write_json(path: str, obj: dict) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def cmd_wait(args) -> int:
    ray = _connect(args.address, "Ray readiness probe")
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
    info = {"alive": len(alive), "expected": args.expected, "address": args.address, "auth_mode": _auth_mode(),
            "nodes": [_describe(n) for n in alive]}
    if args.out:
        _write_json(args.out, info)
    print(f"RAY_NODES alive={len(alive)} expected={args.expected} "
          f"hosts={','.join(sorted(str(n['NodeManagerHostname']) for n in alive))}", flush=True)
    return 0


def cmd_watch(args) -> int:
    ray = _connect(args.address, "Ray watchdog")
    known: dict[str, str] = {}
    failed = 0
    while True:
        try:
            alive, dead = _snapshot(ray)
            failed = 0
        except Exception as err:  # the GCS did not answer: it stopped, or it was slow this once
            failed += 1
            if failed >= args.failures:
                print(f"ERROR: lost contact with the Ray head at {args.address}: {failed} probes in a row failed, "
                      f"the last: {_first_line(err)}", flush=True)
                return 5
            _log(f"probe {failed} of {args.failures} failed in a row, retrying: {_first_line(err)}")
            time.sleep(args.interval)
            continue
        for n in alive:
            known[n["NodeID"]] = f"{n.get('NodeManagerHostname')} ({n.get('NodeManagerAddress')})"
        if len(alive) < args.expected:
            lost = sorted({known.get(n["NodeID"], f"{n.get('NodeManagerHostname')} ({n.get('NodeManagerAddress')})")
                           for n in dead})
            if args.lost_out:
                with open(args.lost_out, "a") as f:
                    f.write("".join(f"{_slurm_name(n)}\n" for n in dead))
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
            s.add_argument("--failures", type=int, default=3,
                           help="fail after this many ray.nodes() probes in a row that raised")
            s.add_argument("--lost-out", default="", help="append the lost nodes' Slurm names here")
    args = p.parse_args(argv)
    if args.expected < 1 or getattr(args, "failures", 1) < 1:
        print("ERROR: --expected and --failures must be >= 1", file=sys.stderr)
        return 2
    try:
        return cmd_wait(args) if args.cmd == "wait" else cmd_watch(args)
    except ProbeError as err:
        print(f"ERROR: {err}", flush=True)
        return err.code


if __name__ == "__main__":
    sys.exit(main())
