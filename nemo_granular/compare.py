"""``nemo-granular compare``: the algorithms side by side, and the report.

Every run of a seed starts from the SAME warm-started policy, sees the same prompts (the
data stream is a function of (seed, step)) and the same sample budget per step (SPPO: one
sample for each of G× more prompts). Runs are separate processes (``nemo-granular train``),
``jobs`` at a time, one torch thread each; their output is echoed line by line with a
``[run]`` prefix on stderr (progress) and kept in each run's ``train.log``; the summary (every run's
held-out accuracy, the report's path) goes to stdout. Warm starts are cached under
``<out>/warmstart/seed<S>-<key>``, the key a hash of everything that determines the policy
(:func:`warmstart.warmstart_key`), so a changed override never reuses a stale one.
After training, every run's checkpoints are evaluated on the benchmark suite
(``nemo-granular eval-checkpoints``, :mod:`nemo_granular.evals`; all checkpoints are kept for it) and
:func:`nemo_granular.report.report_from_runs` builds ``report.md`` and the plots (it also reads
NeMo-RL run directories: ``compare --from-runs``, used by ``slurm/submit_comparison.sh``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .cli_common import INTERRUPTED_EXIT_CODE, ArgumentParser, check_writable_dir, command_prefix

SMOKE = [
    "warmstart.max_steps=150",
    "rl.steps=10",
    "rl.prompts_per_step=8",
    "rl.generations_per_prompt=4",
    "rl.minibatches_per_rollout=2",
    "rl.eval_every=5",
    "logger.log_every=5",
]
# a config whose rl.generations_per_prompt is 1 (``sppo_equal_prompts``: SPPO at GRPO's prompts per step,
# one sample each, the paper's setting) keeps it under --smoke: the smoke budget's G would make it plain SPPO
SMOKE_ONE_SAMPLE = [o for o in SMOKE if not o.startswith("rl.generations_per_prompt=")]
NOT_ALGORITHMS = ("base", "smoke")  # configs in the config directory that are not an algorithm of their own
# seeds by default: enough for a 95 % interval over seeds of every paired claim (t with n−1 degrees of
# freedom: 2.78 at 5 seeds, 4.30 at 3), within the demo's time budget on 2 cores (README); --smoke: the
# fewest that give an interval at all
DEFAULT_SEEDS, SMOKE_SEEDS = 5, 3
DEFAULT_OUT = "outputs/compare"
DEFAULT_ALGORITHMS = "grpo,gspo,sspo,espo,sppo"


class CompareInterrupted(Exception):
    """Ctrl-C (or a stopped run): the running runs saved a checkpoint; ``--resume`` continues."""


class _Children:
    """The runs started (``nemo-granular train`` processes, each in its own session) and whether a signal
    has stopped the comparison; ``lock`` orders starting a run against forwarding a signal."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.procs: set = set()
        self.stopping = False

    def forward(self, signum: int, frame=None) -> None:
        """SIGINT / SIGTERM handler: no new run; each running one gets the signal (SIGINT: it checkpoints
        and exits 130, a second SIGINT aborts it; SIGTERM: it checkpoints and exits 99); then
        KeyboardInterrupt, so the comparison stops as on Ctrl-C."""
        with self.lock:
            self.stopping = True
            for proc in self.procs:
                if proc.poll() is None:
                    proc.send_signal(signum)
        raise KeyboardInterrupt


_CHILDREN = _Children()
RUN_ENV = {"OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1"}  # every run's, on top of ours
_ZYGOTE: list = []  # the zygote the runs are forked from, while ``compare`` trains and evaluates


def _start(args: list[str]):
    """``python -m nemo_granular ARGS`` in a session of its own, stdout and stderr merged into ``.stdout``
    (text): forked from the zygote (:mod:`nemo_granular.zygote`: torch and transformers already
    imported, ~5 s of CPU less per run) when one runs, else a new interpreter."""
    env = dict(os.environ, **RUN_ENV)
    if _ZYGOTE and _ZYGOTE[0] is not None:
        return _ZYGOTE[0].start(args, env=env)
    return subprocess.Popen(
        [sys.executable, "-m", "nemo_granular", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        text=True,
        start_new_session=True,
    )


class RunFailed(RuntimeError):
    """A run exited with an error; the message is its last output line and the log's path."""


def available_algorithms(config_dir: Path) -> list[str]:
    return sorted(p.stem for p in config_dir.glob("*.yaml") if p.stem not in NOT_ALGORITHMS)


@contextlib.contextmanager
def _started(args: list[str], what: str):
    """A command of ``compare`` (a run, an evaluation) started and registered, so that a Ctrl-C is forwarded
    to it; none starts after a Ctrl-C. Its own session: the terminal's Ctrl-C reaches only this process,
    which forwards it to each command exactly once (a run started in the instant between the terminal's
    signal and Python's handler got none and trained on to the end; a second one would abort a run
    before it saved)."""
    _start_zygote()
    with _CHILDREN.lock:
        if _CHILDREN.stopping:
            raise CompareInterrupted(f"{what} not started (interrupted)")
        proc = _start(args)
        _CHILDREN.procs.add(proc)
    try:
        yield proc
    finally:
        with _CHILDREN.lock:
            _CHILDREN.procs.discard(proc)


def _train(config: Path, args: list[str], log: Path, label: str, append: bool = False) -> None:
    """``nemo-granular train`` in a child process; its output goes to ``log`` and, prefixed, to stderr
    (all but its own ``resume with:`` line: a comparison continues with ``compare --resume``)."""
    from .embedded.cli import RESUME_HINT

    last = ""
    with (
        log.open("a" if append else "w") as fh,
        _started(["train", "--config", str(config), *args], f"run {label}") as proc,
    ):
        for line in proc.stdout:
            fh.write(line)
            fh.flush()
            last = line.strip() or last
            if not line.startswith(RESUME_HINT):
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
    futures = []
    try:
        futures += [pool.submit(c) for c in calls]
        for f in futures:
            f.result()
    except KeyboardInterrupt:
        print(
            "compare: Ctrl-C: the running runs save a checkpoint and stop (Ctrl-C again aborts them)",
            file=sys.stderr,
            flush=True,
        )
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


def _warmstart_state(d: Path, key: str) -> tuple[str, Path | None]:
    """Where the warm start in ``d`` (the folder of ``key``) stands, and its policy: ``"done"`` (step-0
    checkpoint and step-0 record written; also after a Ctrl-C, which lets a warm start finish and save),
    ``"checkpointed"`` (a checkpoint but no step-0 record, as earlier versions left a warm start stopped by
    Ctrl-C: ``train --resume`` writes the record) or ``"new"`` (nothing checkpointed: never started,
    stopped while its process was starting, or aborted by a second Ctrl-C)."""
    from .embedded.checkpoint import CheckpointError, find_resumable
    from .rundir import step0_record

    try:
        recorded = json.loads((d / "key.json").read_text()).get("key")
    except (OSError, ValueError, AttributeError):
        recorded = None
    if recorded not in (None, key):
        raise FileExistsError(f"{d}: its key.json names the warm start {recorded}, not {key}: move the folder away")
    try:
        loaded, _ = find_resumable(d / "checkpoints")
    except (OSError, ValueError, CheckpointError):
        return "new", None
    if loaded.state.get("step") != 0:
        raise FileExistsError(
            f"{d}: holds a checkpoint past step 0 ({loaded.path.name}), not a warm start: move the folder away"
        )
    return ("done" if step0_record(d) is not None else "checkpointed"), loaded.path / "policy"


def _warm_starts(plan: list[dict], per_alg: dict, out: Path, config_dir: Path, jobs: int) -> list[str]:
    """One warm start per distinct key (seed, model, task, warm-start settings, code, versions), shared by
    every algorithm whose config gives that key, in ``<out>/warmstart/seed<S>-<key>`` (``key.json``
    written before it starts). A complete one is reused, one stopped after its checkpoint is resumed,
    never redone; only one that left no checkpoint starts again. Sets each item's ``init``; returns the
    report's cache notes."""
    from .embedded.warmstart import warmstart_key

    groups: dict[str, dict] = {}
    for item in plan:
        cfg = item["cfg"]
        if cfg.model.init_from or not cfg.warmstart.enabled:
            continue  # nothing to warm-start: each run starts from its own config
        key, parts = warmstart_key(cfg)
        g = groups.setdefault(
            key,
            {
                "key": key,
                "parts": parts,
                "alg": item["alg"],
                "seed": item["seed"],
                "dir": out / "warmstart" / f"seed{item['seed']}-{key}",
                "items": [],
            },
        )
        g["items"].append(item)
    notes, calls = [], []
    for g in groups.values():
        state, g["policy"] = _warmstart_state(g["dir"], g["key"])
        label = f"warmstart seed{g['seed']}-{g['key'][:8]}"
        how = {"done": "reused", "checkpointed": "resumed", "new": "computed"}[state]
        notes.append(f"seed{g['seed']}-{g['key']} ({how})")
        if state == "done":
            print(
                f"[{label}] reusing the cached warm start {g['dir']} (same key: same config, code and versions)",
                file=sys.stderr,
                flush=True,
            )
            continue
        earlier = g["dir"].is_dir()
        if state == "checkpointed":
            print(
                f"[{label}] continuing the interrupted warm start {g['dir']} from its checkpoint (not redone)",
                file=sys.stderr,
                flush=True,
            )
        elif earlier:
            print(
                f"[{label}] the interrupted warm start {g['dir']} left no checkpoint: starting it again",
                file=sys.stderr,
                flush=True,
            )
        g["dir"].mkdir(parents=True, exist_ok=True)
        if not (g["dir"] / "key.json").is_file():  # the folder names its key before anything is trained
            (g["dir"] / "key.json").write_text(json.dumps({"key": g["key"], **g["parts"]}, indent=1))
        args = [
            "--resume" if state == "checkpointed" else "--force",
            *per_alg[g["alg"]],
            f"seed={g['seed']}",
            f"output_dir={g['dir']}",
            "rl.steps=0",
            "name=warmstart",
        ]

        def call(g=g, args=args, label=label, append=earlier):
            _train(config_dir / f"{g['alg']}.yaml", args, g["dir"] / "train.log", label, append=append)
            state, g["policy"] = _warmstart_state(g["dir"], g["key"])
            if state != "done":
                raise RunFailed(f"warm start {g['dir']} wrote no complete step-0 checkpoint and record")

        calls.append(call)
    _run_all(jobs, calls)
    for g in groups.values():
        for item in g["items"]:
            item["init"] = g["policy"]
    return notes


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


def _finished(run: Path, steps: int) -> bool:
    """Whether the run has its step ``steps`` both checkpointed and in ``metrics.jsonl`` (what
    ``train --resume`` would find with nothing left to train)."""
    from .embedded.checkpoint import STEP_RE, step_dirs

    newest = step_dirs(run / "checkpoints")
    if not newest or int(STEP_RE.fullmatch(newest[0].name).group(1)) < steps:
        return False
    metrics, recorded = run / "metrics.jsonl", set()
    for line in metrics.read_text(errors="replace").splitlines() if metrics.is_file() else []:
        try:
            recorded.add(json.loads(line).get("step"))
        except (ValueError, AttributeError):  # a line cut by a kill
            continue
    return steps in recorded


def _evaluate(run: Path, suite: str, max_samples: int | None, label: str, score_cache: Path | None = None) -> None:
    """``nemo-granular eval-checkpoints`` on one finished run (output in ``<run>/evals.log``); skipped
    when ``evals.json`` already holds every suite with the run's newest checkpoint (``--resume``).
    ``score_cache``: scores kept by a key of all their inputs (the runs of a seed share step 0)."""
    from .embedded.checkpoint import STEP_RE, step_dirs
    from .evals.suite import protocols_for

    done = run / "evals.json"
    newest = step_dirs(run / "checkpoints")
    try:
        have = json.loads(done.read_text()).get("suites", {}) if done.is_file() and newest else {}
        last = str(int(STEP_RE.fullmatch(newest[0].name).group(1))) if newest else None
        if have and all(last in have.get(p.name, {}).get("checkpoints", {}) for p in protocols_for(suite)):
            print(f"[{label}] benchmark suite {suite!r}: already evaluated ({done})", file=sys.stderr, flush=True)
            return
    except (OSError, ValueError, AttributeError):
        pass
    args = ["eval-checkpoints", str(run), "--suite", suite]
    if max_samples is not None:
        args += ["--max-samples", str(max_samples)]
    if score_cache is not None:
        args += ["--score-cache", str(score_cache)]
    with (run / "evals.log").open("w") as fh, _started(args, f"evaluation of {label}") as proc:
        for line in proc.stdout:
            fh.write(line)
        rc = proc.wait()
    if rc != 0:
        raise RunFailed(f"evaluation of {label} failed (exit {rc}); log: {run / 'evals.log'}")
    print(f"[{label}] benchmark suite {suite!r} evaluated ({run / 'evals.json'})", file=sys.stderr, flush=True)


def compare(
    algorithms: list[str],
    seeds: int | None,
    steps: int | None,
    out: Path,
    config_dir: Path,
    jobs: int | None = None,
    smoke: bool = False,
    overrides: list[str] | None = None,
    force: bool = False,
    resume: bool = False,
    suite: str | None = "all",
    eval_max_samples: int | None = 8,
) -> Path:
    from .embedded.config import load_train_config

    # 1. every argument and every run's config checked before anything is written or run
    if not config_dir.is_dir():
        raise FileNotFoundError(f"--config-dir {config_dir}: no such directory")
    valid = ", ".join(available_algorithms(config_dir))
    if not algorithms:
        raise ValueError(f"--algorithms is empty (valid: {valid})")
    if "" in algorithms:
        raise ValueError(f"--algorithms: a name is empty (two commas in a row, or one at an end; valid: {valid})")
    unknown = [a for a in algorithms if a in NOT_ALGORITHMS or not (config_dir / f"{a}.yaml").is_file()]
    if unknown:
        raise ValueError(f"--algorithms: unknown {', '.join(map(repr, unknown))} (valid: {valid})")
    if seeds is None:
        seeds = SMOKE_SEEDS if smoke else DEFAULT_SEEDS
    if seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {seeds}")
    if jobs is not None and jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}")
    if steps is not None and steps < 1:
        raise ValueError(f"--steps must be >= 1, got {steps} (a run needs RL steps to be compared)")
    check_writable_dir(out, "--out")
    out = Path(out).absolute()  # every path printed and recorded holds from any directory
    jobs = jobs or max(1, min(2, os.cpu_count() or 1))
    extra = list(overrides or []) + ([f"rl.steps={steps}"] if steps is not None else [])
    # every checkpoint kept: the benchmark suite evaluates them (SSPO protocol: every 10 steps)
    base = ["logger.progress=false", "threads=1"] + (["checkpoint.keep=1000"] if suite else [])
    per_alg = {}  # each algorithm's overrides: --smoke keeps a one-sample-per-prompt config at one sample
    for alg in algorithms:
        smoke_here = SMOKE if smoke else []
        if smoke:
            try:
                own = load_train_config(config_dir / f"{alg}.yaml", list(overrides or []))
            except ValueError as err:
                raise ValueError(f"{alg}: {err}") from None
            if own.rl.generations_per_prompt == 1:
                smoke_here = SMOKE_ONE_SAMPLE
        per_alg[alg] = base + smoke_here + extra
    plan = []
    for s in range(seeds):
        for alg in algorithms:
            run = out / "runs" / f"{alg}_seed{s}"
            try:
                cfg = load_train_config(config_dir / f"{alg}.yaml", per_alg[alg] + [f"seed={s}", f"output_dir={run}"])
            except ValueError as err:
                raise ValueError(f"{alg}: {err}") from None
            if cfg.rl.steps < 1:  # a run without RL steps has nothing the report can compare
                raise ValueError(f"{alg}: rl.steps={cfg.rl.steps}: a comparison needs at least 1 RL step")
            plan.append({"alg": alg, "seed": s, "run": run, "cfg": cfg, "init": None, "common": per_alg[alg]})
    previous = [n for n in ("report.md", "runs", "warmstart") if (out / n).exists()]
    if resume and not ((out / "runs").is_dir() or (out / "warmstart").is_dir()):
        raise FileNotFoundError(
            f"--resume: nothing to resume in --out {out} (no runs/ or warmstart/); drop --resume to start a comparison"
        )
    if previous and not (force or resume):
        raise FileExistsError(
            f"--out {out} already holds a comparison ({', '.join(previous)}): add --resume to "
            "continue it, --force to redo it, or choose another --out"
        )
    out.mkdir(parents=True, exist_ok=True)
    if force:
        shutil.rmtree(out / "runs", ignore_errors=True)
        (out / "report.md").unlink(missing_ok=True)
    # runs/ marks the folder as a comparison from its first moment, so that the `continue with: ... --resume`
    # printed after a Ctrl-C at any later moment (a warm start included) finds something to resume
    (out / "runs").mkdir(exist_ok=True)

    print(_plan_line(plan, algorithms, seeds, jobs, suite, out), file=sys.stderr, flush=True)
    # 2. the warm starts (cached by key); 3. every algorithm from its seed's warm start; 4. the benchmark
    #    suite; 5. the report. Ctrl-C at any moment: the runs checkpoint, CompareInterrupted, --resume continues
    try:
        return _stages(plan, per_alg, out, config_dir, jobs, resume, smoke, suite, eval_max_samples)
    except KeyboardInterrupt:  # outside the runs (between stages, building the report): nothing to save
        raise CompareInterrupted("interrupted; finished runs and checkpoints are kept") from None
    finally:
        _stop_zygote()


_ZYGOTE_LOCK = threading.Lock()


def _start_zygote() -> None:
    """The runs' zygote, started by the first run (outside ``_CHILDREN.lock``: a Ctrl-C meanwhile is
    forwarded at once). Where it cannot start, each run is a new interpreter: the same runs, ~5 s more CPU."""
    from .zygote import Zygote

    with _ZYGOTE_LOCK:
        if _ZYGOTE or _CHILDREN.stopping:
            return
        try:
            _ZYGOTE.append(Zygote(dict(os.environ, **RUN_ENV)))
        except (OSError, RuntimeError, AttributeError):  # AttributeError: no socket.send_fds (not Unix)
            _ZYGOTE.append(None)


def _stop_zygote() -> None:
    with _ZYGOTE_LOCK:
        while _ZYGOTE:
            zygote = _ZYGOTE.pop()
            if zygote is not None:
                zygote.close()


def _plan_line(plan, algorithms, seeds, jobs, suite, out) -> str:
    """What ``compare`` is about to do, printed before it starts (no silent first minutes)."""
    steps = sorted({item["cfg"].rl.steps for item in plan})
    shown = "/".join(map(str, steps)) + f" RL step{'s' if steps != [1] else ''}"
    algs = f"{len(algorithms)} algorithm{'s' if len(algorithms) > 1 else ''} ({', '.join(algorithms)})"
    bench = f"then the benchmark suite {suite!r} on each run's checkpoints; " if suite else ""
    runs = f"{len(plan)} run{'s' if len(plan) > 1 else ''} = {algs} × {seeds} seed{'s' if seeds > 1 else ''}"
    return f"compare: {runs}, {shown} each, {jobs} at a time; {bench}report: {out / 'report.md'}"


def _stages(plan, per_alg, out, config_dir, jobs, resume, smoke, suite, eval_max_samples) -> Path:
    from .embedded.checkpoint import step_dirs

    t0 = time.time()
    cache_notes = _warm_starts(plan, per_alg, out, config_dir, jobs)
    t_warm = time.time() - t0
    print(f"warm starts done in {t_warm:.0f} s", file=sys.stderr, flush=True)

    # 3. every algorithm from its seed's warm start
    calls = []
    for item in plan:
        run = item["run"]
        if resume and _finished(run, item["cfg"].rl.steps):  # no process started just to find nothing to do
            print(
                f"[{item['alg']} seed{item['seed']}] finished earlier (step {item['cfg'].rl.steps} checkpointed and "
                f"recorded): kept, not restarted",
                file=sys.stderr,
                flush=True,
            )
            continue
        flags = []
        if resume and step_dirs(run / "checkpoints"):
            flags = ["--resume"]
        elif resume and run.exists():
            flags = ["--force"]  # an earlier attempt that never reached a checkpoint
        run.mkdir(parents=True, exist_ok=True)
        args = [*flags, *item["common"], f"seed={item['seed']}", f"output_dir={run}"]
        if item["init"] is not None:
            args.append(f"model.init_from={item['init']}")
        calls.append(
            lambda item=item, args=args, append=bool(flags): _train(
                config_dir / f"{item['alg']}.yaml",
                args,
                item["run"] / "train.log",
                f"{item['alg']} seed{item['seed']}",
                append=append,
            )
        )
    _run_all(jobs, calls)
    t_train = time.time() - t0
    if suite:  # 4. the benchmark suite on every run's checkpoints
        max_samples = min(eval_max_samples or 2, 2) if smoke else eval_max_samples
        finished, lock = [], threading.Lock()
        print(f"benchmark suite {suite!r}: 0/{len(plan)} runs evaluated", file=sys.stderr, flush=True)

        def evaluate(item):
            _evaluate(item["run"], suite, max_samples, f"{item['alg']} seed{item['seed']}", out / "score-cache")
            with lock:  # two runs may finish at once: each count printed once, in order
                finished.append(item["run"])
                print(
                    f"benchmark suite {suite!r}: {len(finished)}/{len(plan)} runs evaluated",
                    file=sys.stderr,
                    flush=True,
                )

        # algorithm by algorithm: the first run of each seed scores the step 0 (the warm start) that its other
        # runs then read from the score cache, instead of two runs of one seed scoring it side by side
        algs = list(dict.fromkeys(item["alg"] for item in plan))
        order = sorted(plan, key=lambda item: (algs.index(item["alg"]), item["seed"]))
        _run_all(jobs, [lambda item=item: evaluate(item) for item in order])
    total = time.time() - t0
    timing = {
        "warm start (s)": t_warm,
        "training (s)": t_train - t_warm,
        "benchmark suite (s)": total - t_train,
        "total wall (s)": total,
        "jobs": jobs,
    }
    if cache_notes:
        timing["warm-start cache key"] = "; ".join(cache_notes)
    _stop_zygote()  # nothing more to run
    from .report import report_from_runs

    print(f"writing the report: {out / 'report.md'}", file=sys.stderr, flush=True)
    report = report_from_runs([item["run"] for item in plan], out, timing=timing, smoke=smoke)
    for item in plan:
        acc0, acc = _accuracies(item["run"])
        shown = "n/a" if acc is None else f"{acc0:.3f} → {acc:.3f}"
        print(f"{item['alg']} seed {item['seed']}: held-out accuracy {shown} ({item['run']})", flush=True)
    return report


# ---------------------------------------------------------------------------- the command
def continue_command(argv: list[str]) -> str:
    """The shell command that continues this comparison, runnable as printed from any directory:
    the tool as it can be run (:func:`command_prefix`), --out and --config-dir made absolute."""
    again, i = [], 0
    has_out = False
    while i < len(argv):
        a = argv[i]
        if a in ("--force", "--resume"):
            i += 1
            continue
        for opt in ("--out", "--config-dir"):
            if a == opt and i + 1 < len(argv):
                again += [opt, str(Path(argv[i + 1]).absolute())]
                has_out |= opt == "--out"
                i += 2
                break
            if a.startswith(opt + "="):
                again.append(f"{opt}={Path(a.split('=', 1)[1]).absolute()}")
                has_out |= opt == "--out"
                i += 1
                break
        else:
            again.append(a)
            i += 1
    if not has_out:
        again += ["--out", str(Path(DEFAULT_OUT).absolute())]
    return f"{command_prefix()} compare {shlex.join(again + ['--resume'])}"


def _algorithm_list(text: str) -> list[str]:
    """The names of ``--algorithms``, in order, repeats dropped; an empty name (``grpo,,sspo``, a
    trailing comma) stays in the list as ``""``, which :func:`compare` refuses."""
    if not text.strip():
        return []
    names = []
    for name in (a.strip() for a in text.split(",")):
        if name not in names:
            names.append(name)
    return names


def main(argv: list[str]) -> int:
    """``nemo-granular compare``."""
    if threading.current_thread() is not threading.main_thread():
        return _main(argv)
    # the runs are in sessions of their own: SIGINT (Ctrl-C, kill -INT) and SIGTERM reach them through
    # this handler, also when started with SIGINT ignored (a non-interactive shell's `cmd &`, nohup)
    _CHILDREN.stopping = False
    before = {sig: signal.signal(sig, _CHILDREN.forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _main(argv)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _main(argv: list[str]) -> int:
    from .embedded.config import LOCAL_CONFIGS

    ap = ArgumentParser(
        prog="nemo-granular compare",
        description="Run algorithms side by side (same data, seed and sample budget) and write report.md with plots.",
    )
    ap.add_argument(
        "--algorithms",
        default=None,
        help=f"comma-separated config names from --config-dir (default: {DEFAULT_ALGORITHMS})",
    )
    ap.add_argument(
        "--seeds",
        type=int,
        default=None,
        help=f"number of seeds (0..N-1; default {DEFAULT_SEEDS}, {SMOKE_SEEDS} with --smoke: every "
        "claim gets a 95%% interval over seeds)",
    )
    ap.add_argument("--steps", type=int, default=None, help="RL steps per run, >= 1 (default: the config's)")
    ap.add_argument(
        "--out",
        default=DEFAULT_OUT,
        help="directory for the runs, warm starts, report.md and plots (default: %(default)s); "
        "refused when it already holds a comparison, unless --resume or --force",
    )
    ap.add_argument("--config-dir", default=None, help=f"where <algorithm>.yaml live (default: {LOCAL_CONFIGS})")
    ap.add_argument("--jobs", type=int, default=None, help="parallel runs (default: number of cores, max 2)")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="tiny budget (CI): smoke.yaml's settings for every run, except that a config of one sample "
        "per prompt (sppo_equal_prompts) keeps one",
    )
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--force", action="store_true", help="redo a comparison whose --out already holds one")
    mode.add_argument(
        "--resume",
        action="store_true",
        help="continue an interrupted comparison in --out (runs resume from their checkpoints)",
    )
    ap.add_argument(
        "--from-runs",
        nargs="+",
        default=None,
        metavar="RUN_DIR",
        help="only build the report from finished run directories",
    )
    ap.add_argument("overrides", nargs="*", help="key=value overrides applied to every run")
    args = ap.parse_args(argv)
    from .report import report_from_runs

    if args.from_runs:
        if args.resume:
            raise ValueError("--resume continues a comparison's runs; --from-runs only builds a report")
        training = [
            opt
            for opt, given in (
                ("--algorithms", args.algorithms is not None),
                ("--seeds", args.seeds is not None),
                ("--steps", args.steps is not None),
                ("--jobs", args.jobs is not None),
                ("--smoke", args.smoke),
                ("--config-dir", args.config_dir is not None),
                ("key=value overrides", bool(args.overrides)),
            )
            if given
        ]
        if training:
            raise ValueError(
                f"{', '.join(training)}: not with --from-runs, which only builds a report from the run "
                "directories it names (choose the runs by naming their directories)"
            )
        runs = [Path(p) for p in args.from_runs]
        for run in runs:  # embedded (metrics.jsonl) or NeMo-RL (TensorBoard events) run directories
            if not run.is_dir():
                raise FileNotFoundError(f"--from-runs {run}: no such directory")
        check_writable_dir(args.out, "--out")
        args.out = str(Path(args.out).absolute())
        if (Path(args.out) / "report.md").exists() and not args.force:
            raise FileExistsError(
                f"--out {args.out} already holds a report.md: add --force to replace it, or choose another --out"
            )
        created = not Path(args.out).exists()
        try:
            report = report_from_runs(runs, Path(args.out))
        except BaseException:
            if created:  # leave no empty --out behind when no report could be built
                shutil.rmtree(args.out, ignore_errors=True)
            raise
    else:
        try:
            algorithms = _algorithm_list(DEFAULT_ALGORITHMS if args.algorithms is None else args.algorithms)
            config_dir = Path(LOCAL_CONFIGS if args.config_dir is None else args.config_dir)
            report = compare(
                algorithms=algorithms,
                seeds=args.seeds,
                steps=args.steps,
                out=Path(args.out),
                config_dir=config_dir,
                jobs=args.jobs,
                smoke=args.smoke,
                overrides=args.overrides,
                force=args.force,
                resume=args.resume,
            )
        except CompareInterrupted as err:
            print(f"nemo-granular compare: {err}; continue with: {continue_command(argv)}", file=sys.stderr)
            return INTERRUPTED_EXIT_CODE
        except RunFailed as err:
            print(f"nemo-granular compare: error: {err}", file=sys.stderr)
            return 1
    print(f"report: {Path(report).absolute()}")
    return 0
