"""``nemo-granular compare``: the algorithms side by side, and the report.

Every run of a seed starts from the SAME warm-started policy, sees the same prompts (the
data stream is a function of (seed, step)) and the same sample budget per step (SPPO: one
sample for each of G× more prompts). Runs are separate processes (``nemo-granular train``),
``jobs`` at a time, one torch thread each; their output is echoed line by line with a
``[run]`` prefix and kept in each run's ``train.log``. Warm starts are cached under
``<out>/warmstart/seed<S>-<key>``, the key a hash of everything that determines the policy
(:func:`warmstart.warmstart_key`), so a changed override never reuses a stale one.
``report_from_runs`` builds ``report.md`` and the plots from finished run directories (also
used by ``slurm/submit_comparison.sh``).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SMOKE = ["warmstart.max_steps=150", "rl.steps=10", "rl.prompts_per_step=8", "rl.generations_per_prompt=4",
         "rl.minibatches_per_rollout=2", "rl.eval_every=5", "logger.log_every=5"]
NOT_ALGORITHMS = ("base", "smoke")  # configs in the config directory that are not an algorithm of their own


class CompareInterrupted(Exception):
    """Ctrl-C (or a stopped run): the running runs saved a checkpoint; ``--resume`` continues."""


class RunFailed(RuntimeError):
    """A run exited with an error; the message is its last output line and the log's path."""


def available_algorithms(config_dir: Path) -> list[str]:
    return sorted(p.stem for p in config_dir.glob("*.yaml") if p.stem not in NOT_ALGORITHMS)


def _train(config: Path, args: list[str], log: Path, label: str, append: bool = False) -> None:
    """``nemo-granular train`` in a child process; its output goes to ``log`` and, prefixed, to stderr."""
    cmd = [sys.executable, "-m", "nemo_granular", "train", "--config", str(config), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1", PYTHONUNBUFFERED="1")
    last = ""
    with log.open("a" if append else "w") as fh:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
        for line in proc.stdout:
            fh.write(line)
            fh.flush()
            last = line.strip() or last
            print(f"[{label}] {line.rstrip()}", file=sys.stderr, flush=True)
        rc = proc.wait()
    if rc in (130, 99):
        raise CompareInterrupted(f"run {label} stopped (exit {rc}) after saving a checkpoint")
    if rc != 0:
        raise RunFailed(f"run {label} failed (exit {rc}): {last or '(no output)'} (log: {log})")


def _run_all(jobs: int, calls: list) -> None:
    """Run the calls ``jobs`` at a time. On Ctrl-C: start nothing new, let the running ones
    checkpoint (they received the same SIGINT from the terminal), then raise CompareInterrupted."""
    pool = ThreadPoolExecutor(jobs)
    futures = [pool.submit(c) for c in calls]
    try:
        for f in futures:
            f.result()
    except KeyboardInterrupt:
        print("compare: Ctrl-C: the running runs save a checkpoint and stop (Ctrl-C again aborts them)",
              file=sys.stderr, flush=True)
        for f in futures:
            f.cancel()
        pool.shutdown(wait=True)
        raise CompareInterrupted("interrupted; finished runs and checkpoints are kept") from None
    except BaseException:
        for f in futures:
            f.cancel()
        pool.shutdown(wait=True)
        raise
    pool.shutdown()


def _cached_warmstart(d: Path, key: str) -> Path | None:
    """The policy of a complete warm start with this key in ``d``, or None."""
    from .checkpoint import CheckpointError, find_resumable

    try:
        if json.loads((d / "key.json").read_text()).get("key") != key:
            return None
        loaded, _ = find_resumable(d / "checkpoints")
    except (OSError, ValueError, CheckpointError):
        return None
    return loaded.path / "policy" if loaded.state.get("step") == 0 else None


def _accuracies(run: Path) -> tuple[float | None, float | None]:
    acc = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec.get("validation/accuracy"), (int, float)):
            acc.append(rec["validation/accuracy"])
    return (acc[0], acc[-1]) if acc else (None, None)


def compare(algorithms: list[str], seeds: int, steps: int | None, out: Path, config_dir: Path,
            jobs: int | None = None, smoke: bool = False, overrides: list[str] | None = None,
            force: bool = False, resume: bool = False) -> Path:
    from .checkpoint import step_dirs
    from .config import load_train_config
    from .warmstart import warmstart_key

    # 1. every argument and every run's config checked before anything is written or run
    if not config_dir.is_dir():
        raise FileNotFoundError(f"--config-dir {config_dir}: no such directory")
    valid = ", ".join(available_algorithms(config_dir))
    if not algorithms:
        raise ValueError(f"--algorithms is empty (valid: {valid})")
    unknown = [a for a in algorithms if a in NOT_ALGORITHMS or not (config_dir / f"{a}.yaml").is_file()]
    if unknown:
        raise ValueError(f"--algorithms: unknown {', '.join(map(repr, unknown))} (valid: {valid})")
    if seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {seeds}")
    if jobs is not None and jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}")
    if steps is not None and steps < 0:
        raise ValueError(f"--steps must be >= 0, got {steps}")
    jobs = jobs or max(1, min(2, os.cpu_count() or 1))
    extra = (SMOKE if smoke else []) + list(overrides or [])
    if steps is not None:
        extra.append(f"rl.steps={steps}")
    common = ["logger.progress=false", "threads=1"] + extra
    plan = []
    for s in range(seeds):
        for alg in algorithms:
            run = out / "runs" / f"{alg}_seed{s}"
            try:
                cfg = load_train_config(config_dir / f"{alg}.yaml", common + [f"seed={s}", f"output_dir={run}"])
            except ValueError as err:
                raise ValueError(f"{alg}: {err}") from None
            plan.append({"alg": alg, "seed": s, "run": run, "cfg": cfg, "init": None})
    previous = [n for n in ("report.md", "runs") if (out / n).exists()]
    if previous and not (force or resume):
        raise FileExistsError(f"--out {out} already holds a comparison ({', '.join(previous)}): add --resume to "
                              "continue it, --force to redo it, or choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    if force:
        shutil.rmtree(out / "runs", ignore_errors=True)
        (out / "report.md").unlink(missing_ok=True)
    t0 = time.time()

    # 2. one warm start per distinct key (seed, model, task, warm-start settings, code, versions),
    #    shared by every algorithm whose config gives that key; reused when already complete
    groups: dict[str, dict] = {}
    for item in plan:
        cfg = item["cfg"]
        if cfg.model.init_from or not cfg.warmstart.enabled:
            continue  # nothing to warm-start: each run starts from its own config
        key, parts = warmstart_key(cfg)
        g = groups.setdefault(key, {"key": key, "parts": parts, "alg": item["alg"], "seed": item["seed"],
                                    "dir": out / "warmstart" / f"seed{item['seed']}-{key}", "items": []})
        g["items"].append(item)
    cache_notes, calls = [], []
    for g in groups.values():
        g["policy"] = _cached_warmstart(g["dir"], g["key"])
        label = f"warmstart seed{g['seed']}-{g['key'][:8]}"
        cache_notes.append(f"seed{g['seed']}-{g['key']} ({'reused' if g['policy'] else 'computed'})")
        if g["policy"] is not None:
            print(f"[{label}] reusing the cached warm start {g['dir']} (same key: same config, code and versions)",
                  file=sys.stderr, flush=True)
            continue
        g["dir"].mkdir(parents=True, exist_ok=True)
        args = ["--force", *common, f"seed={g['seed']}", f"output_dir={g['dir']}", "rl.steps=0", "name=warmstart"]

        def call(g=g, args=args, label=label):
            _train(config_dir / f"{g['alg']}.yaml", args, g["dir"] / "train.log", label)
            (g["dir"] / "key.json").write_text(json.dumps({"key": g["key"], **g["parts"]}, indent=1))
            g["policy"] = _cached_warmstart(g["dir"], g["key"])
            if g["policy"] is None:
                raise RunFailed(f"warm start {g['dir']} wrote no complete step-0 checkpoint")
        calls.append(call)
    _run_all(jobs, calls)
    for g in groups.values():
        for item in g["items"]:
            item["init"] = g["policy"]
    t_warm = time.time() - t0
    print(f"warm starts done in {t_warm:.0f} s", file=sys.stderr, flush=True)

    # 3. every algorithm from its seed's warm start
    calls = []
    for item in plan:
        run = item["run"]
        flags = []
        if resume and step_dirs(run / "checkpoints"):
            flags = ["--resume"]
        elif resume and run.exists():
            flags = ["--force"]  # an earlier attempt that never reached a checkpoint
        run.mkdir(parents=True, exist_ok=True)
        args = [*flags, *common, f"seed={item['seed']}", f"output_dir={run}"]
        if item["init"] is not None:
            args.append(f"model.init_from={item['init']}")
        calls.append(lambda item=item, args=args, append=bool(flags): _train(
            config_dir / f"{item['alg']}.yaml", args, item["run"] / "train.log", f"{item['alg']} seed{item['seed']}",
            append=append))
    _run_all(jobs, calls)
    total = time.time() - t0
    timing = {"warm start (s)": t_warm, "total wall (s)": total, "jobs": jobs}
    if cache_notes:
        timing["warm-start cache key"] = "; ".join(cache_notes)
    report = report_from_runs([item["run"] for item in plan], out, timing=timing)
    for item in plan:
        acc0, acc = _accuracies(item["run"])
        shown = "n/a" if acc is None else f"{acc0:.3f} → {acc:.3f}"
        print(f"{item['alg']} seed {item['seed']}: held-out accuracy {shown} ({item['run']})", file=sys.stderr)
    return report


# ---------------------------------------------------------------------------- report
def _load_run(run: Path) -> dict:
    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"{run}: no metrics.jsonl (not a finished run directory)")
    recs = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    import yaml

    cfg = yaml.safe_load((run / "config.yaml").read_text()) if (run / "config.yaml").is_file() else {}
    alg = cfg.get("loss_fn", {}).get("granular", {}).get("algorithm") or run.name.split("_seed")[0]
    return {"dir": run, "algorithm": alg, "name": cfg.get("name", alg), "seed": cfg.get("seed", 0), "recs": recs}


def _series(run: dict, key: str, x: str = "step"):
    pts = [(r[x], r[key]) for r in run["recs"] if key in r and r.get(x) is not None
           and isinstance(r[key], (int, float)) and math.isfinite(r[key])]
    return [p[0] for p in pts], [p[1] for p in pts]


def _mean(values):
    values = [v for v in values if v is not None and math.isfinite(v)]
    return sum(values) / len(values) if values else float("nan")


def _summary(run: dict) -> dict:
    recs = [r for r in run["recs"] if r["step"] > 0]
    acc = [r["validation/accuracy"] for r in run["recs"] if "validation/accuracy" in r]
    ent = [r["train/prev_entropy"] for r in recs if "train/prev_entropy" in r]
    k = max(1, len(recs) // 10)
    return {
        "acc0": acc[0] if acc else float("nan"),
        "acc": acc[-1] if acc else float("nan"),
        "reward_first": _mean([r["train/reward"] for r in recs[:k]]),
        "reward_last": _mean([r["train/reward"] for r in recs[-k:]]),
        "clip_low": _mean([r.get("train/clip_frac_low") for r in recs]),
        "clip_high": _mean([r.get("train/clip_frac_high") for r in recs]),
        "entropy_first": _mean(ent[:k]), "entropy_last": _mean(ent[-k:]),
        "groups": _mean([r.get("train/groups_per_response") for r in recs]),
        "length": _mean([r.get("train/response_length") for r in recs]),
        "wall": recs[-1]["wall_time"] if recs else 0.0,
        "samples": recs[-1]["samples"] if recs else 0,
    }


def _time_to_reward(run: dict, target: float, window: int = 10) -> float | None:
    """Wall time at which the running mean of the reward over ``window`` steps first reaches ``target``."""
    xs, ys = _series(run, "train/reward", "wall_time")
    for i in range(window - 1, len(ys)):
        window_ys = ys[i - window + 1: i + 1]
        if sum(window_ys) / len(window_ys) >= target:
            return xs[i]
    return None


def _fmt_t(t: float | None) -> str:
    return "never" if t is None else f"{t:.0f} s"




def _fmt(mu, sd=None):
    if mu is None or (isinstance(mu, float) and math.isnan(mu)):
        return "n/a"
    return f"{mu:.3f}" if sd is None else f"{mu:.3f} ± {sd:.3f}"


def _plots(by_alg: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("train/reward", "step", "reward (sampled) vs step"),
              ("train/reward", "wall_time", "reward vs wall time (s)"),
              ("validation/accuracy", "step", "held-out greedy accuracy"),
              ("train/clip_frac_low", "step", "clip fraction, low (A<0, r<lo)"),
              ("train/clip_frac_high", "step", "clip fraction, high (A>0, r>hi)"),
              ("train/prev_entropy", "step", "π_old entropy (nats)"),
              ("train/response_length", "step", "response length (tokens)"),
              ("train/groups_per_response", "step", "ratio groups per response")]
    files = []
    for key, x, title in panels:
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for alg, runs in by_alg.items():
            for i, run in enumerate(runs):
                xs, ys = _series(run, key, x)
                if xs:
                    ax.plot(xs, ys, color=f"C{list(by_alg).index(alg)}", alpha=0.85 if i == 0 else 0.35,
                            label=alg if i == 0 else None, lw=1.2)
        ax.set_title(title)
        ax.set_xlabel("wall time (s)" if x == "wall_time" else "RL step")
        if key.startswith("train/clip") and ax.has_data():
            ax.set_yscale("symlog", linthresh=1e-4)
        ax.legend(fontsize=7)
        fig.tight_layout()
        name = f"{key.split('/')[-1]}_vs_{x}.png"
        tmp = out / f".{name}.tmp.png"
        fig.savefig(tmp, dpi=90)
        plt.close(fig)
        os.replace(tmp, out / name)
        files.append(name)
    return files


def _claims(S: dict) -> list[str]:
    def get(alg, key):
        return _mean([s[key] for s in S.get(alg, [])]) if alg in S else None

    def clip(alg):
        a, b = get(alg, "clip_low"), get(alg, "clip_high")
        return None if a is None else a + b

    lines = []

    def claim(text, ok, measured):
        verdict = "n/a (not run)" if ok is None else ("holds" if ok else "does NOT hold")
        lines.append(f"| {text} | {measured} | {verdict} |")

    g, gs, ss, es = clip("grpo"), clip("gspo"), clip("sspo"), clip("espo")
    claim("GSPO's clip fraction is near zero (< 1%)", None if gs is None else gs < 0.01, f"GSPO {_fmt(gs)}")
    claim("SSPO's clip fraction lies between GRPO's and GSPO's",
          None if None in (g, gs, ss) else min(g, gs) <= ss <= max(g, gs),
          f"GRPO {_fmt(g)}, SSPO {_fmt(ss)}, GSPO {_fmt(gs)}")
    claim("ESPO clips less than GSPO", None if None in (es, gs) else es < gs, f"ESPO {_fmt(es)}, GSPO {_fmt(gs)}")

    def decay(alg):
        a, b = get(alg, "entropy_first"), get(alg, "entropy_last")
        return None if a is None or not a else b / a
    dg, ds = decay("grpo"), decay("sspo")
    claim("π_old entropy decays slower for SSPO than for GRPO (last/first)",
          None if None in (dg, ds) else ds > dg, f"GRPO {_fmt(dg)}, SSPO {_fmt(ds)}")
    if "grpo" in S and "sppo" in S:
        # per seed: the time each reaches GRPO's own final reward (mean of its last 10 % of steps)
        grpo_runs = {r["seed"]: r for r in S["_runs"]["grpo"]}
        pairs = []
        for run in S["_runs"]["sppo"]:
            if run["seed"] in grpo_runs:
                g_run = grpo_runs[run["seed"]]
                target = _summary(g_run)["reward_last"]
                pairs.append((run["seed"], target, _time_to_reward(g_run, target), _time_to_reward(run, target)))
        wins = sum(1 for *_, t_g, t_s in pairs if t_s is not None and (t_g is None or t_s < t_g))
        shown = "; ".join(f"seed {s}: target {tgt:.3f}, GRPO {_fmt_t(t_g)}, SPPO {_fmt_t(t_s)}"
                          for s, tgt, t_g, t_s in pairs)
        claim("SPPO reaches GRPO's final reward sooner in wall time (per seed, running mean of 10 steps)",
              None if not pairs else wins * 2 > len(pairs), shown)
    else:
        claim("SPPO reaches GRPO's final reward sooner in wall time", None, "")
    return lines


def report_from_runs(run_dirs: list[Path], out: Path, timing: dict | None = None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    runs = [_load_run(Path(d)) for d in run_dirs]
    by_alg: dict[str, list] = {}
    for run in runs:
        by_alg.setdefault(run["name"], []).append(run)
    S = {alg: [_summary(r) for r in rs] for alg, rs in by_alg.items()}
    files = _plots(by_alg, out)
    lines = ["# nemo-granular comparison", "",
             f"Runs: {len(runs)} ({', '.join(f'{a} × {len(r)}' for a, r in by_alg.items())}). "
             "Each seed's runs start from the same warm-started policy and see the same prompts "
             "and the same number of samples per step (SPPO: one sample per prompt).", ""]
    if timing:
        lines += ["Timing: " + ", ".join(f"{k} {v:.0f}" if isinstance(v, float) else f"{k} {v}"
                                         for k, v in timing.items()), ""]
    lines += ["## Final held-out accuracy (greedy) and training statistics", "",
              "| algorithm | seeds | warm start acc | final acc (mean ± std) | Δ acc | reward first→last 10% | "
              "clip low | clip high | π_old entropy first→last | groups/resp | resp len | samples | RL wall (s) |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for alg, ss in S.items():
        acc = [s["acc"] for s in ss]
        sd = statistics.stdev(acc) if len(acc) > 1 else 0.0
        d = [s["acc"] - s["acc0"] for s in ss]
        lines.append(
            f"| {alg} | {len(ss)} | {_fmt(_mean([s['acc0'] for s in ss]))} | {_fmt(_mean(acc), sd)} | "
            f"{_fmt(_mean(d))} | {_fmt(_mean([s['reward_first'] for s in ss]))}→"
            f"{_fmt(_mean([s['reward_last'] for s in ss]))} | {_mean([s['clip_low'] for s in ss]):.2e} | "
            f"{_mean([s['clip_high'] for s in ss]):.2e} | {_fmt(_mean([s['entropy_first'] for s in ss]))}→"
            f"{_fmt(_mean([s['entropy_last'] for s in ss]))} | {_mean([s['groups'] for s in ss]):.1f} | "
            f"{_mean([s['length'] for s in ss]):.1f} | {int(_mean([s['samples'] for s in ss]))} | "
            f"{_mean([s['wall'] for s in ss]):.0f} |")
    claims_input = {a.split("_seed")[0]: v for a, v in S.items()}
    claims_input["_runs"] = {a: rs for a, rs in by_alg.items()}
    lines += ["", "## The papers' directional claims, as measured in this run", "",
              "| claim | measured | verdict |", "|---|---|---|", *_claims(claims_input), "",
              "Clip fractions are token-weighted means over all RL steps (NeMo-RL normalisation). Wall times are "
              "each run's own RL time (generation + training, evaluation excluded); runs that shared a busy "
              "machine are slowed unevenly, so wall-time claims are only as good as the machine was quiet. "
              "These are small models on a toy task: a claim that does not hold here is reported as such.", "",
              "## Plots", ""]
    lines += [f"![{f}]({f})" for f in files]
    report = out / "report.md"
    tmp = out / ".report.md.tmp"
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, report)
    return report
