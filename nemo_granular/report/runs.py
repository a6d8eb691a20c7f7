"""One run structure for the report, from an embedded run or a NeMo-RL run directory.

:func:`load_run` never raises for a run that is broken: a run directory that cannot be read,
or that stopped before its last step, comes back with ``status`` ``"failed"`` or
``"incomplete"`` and ``problem`` saying why, so a report still covers the other runs.

Canonical record keys (the embedded trainer's names; NeMo-RL's are mapped in
:data:`NEMO_RL_METRICS`): ``step``, ``samples``, ``wall_time`` (cumulative RL seconds,
validation excluded), ``train/reward``, ``validation/accuracy``, ``train/clip_frac_low``,
``train/clip_frac_high``, ``train/prev_entropy``, ``train/response_length``,
``train/groups_per_response``, ``train/gen_mismatch_abs_mean``.

NeMo-RL run directory: anything that holds TensorBoard event files written by NeMo-RL's
``Logger`` (``<logger.log_dir>/exp_NNN/tensorboard/``; ``slurm/submit_comparison.sh`` puts
``logger.log_dir`` at ``<run>/logs`` and ``checkpointing.checkpoint_dir`` at ``<run>/checkpoints``).
The config comes from ``<run>/config.yaml`` or the newest ``step_N/config.yaml`` that
NeMo-RL's checkpointer writes. Event files of a resumed job (``exp_002``...) are merged by step,
the later write winning.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..lookup import lookup
from ..rundir import detect, event_files, step0_record
from ..rundir import read_yaml as _read_yaml

# canonical key <- NeMo-RL TensorBoard tags, first present wins
NEMO_RL_METRICS = {
    "train/reward": ("train/reward",),
    "validation/accuracy": ("validation/accuracy",),
    "train/clip_frac_low": ("train/clip_frac_low",),
    "train/clip_frac_high": ("train/clip_frac_high",),
    "train/prev_entropy": ("train/prev_entropy_mean", "train/approx_entropy"),
    "train/response_length": ("train/mean_gen_tokens_per_sample",),
    "train/groups_per_response": ("train/groups_per_response",),
    "train/gen_mismatch_abs_mean": ("train/gen_mismatch_abs_mean",),
}
STEP_TIME_TAG = "timing/train/total_step_time"
VALIDATION_TIME_TAGS = ("timing/validation/total_validation_time",)
SAMPLES_TAG = "train/global_valid_seqs"
_ERROR_RE = re.compile(r"Traceback|Error|error:|CANCELLED|DUE TO TIME LIMIT|OUT_OF_MEMORY|oom-kill|Killed")


@dataclass
class Run:
    dir: Path
    source: str  # "embedded" | "nemo-rl" | "unknown"
    algorithm: str
    name: str  # the label seeds are grouped under (config name)
    seed: int
    recs: list = field(default_factory=list)
    meta: dict = field(default_factory=dict)  # model, task, steps, batch, lr, decoding, ...
    status: str = "finished"  # "finished" | "incomplete" | "failed"
    problem: str | None = None
    evals: dict | None = None  # benchmark-suite results (evals.json), see nemo_granular.evals

    @property
    def last_step(self) -> int:
        return max((r["step"] for r in self.recs), default=0)


def _batch_text(prompts: int | None, samples: int | None, sppo: bool) -> str | None:
    """How a run's step batch reads in the report (SPPO: one sample per prompt)."""
    if prompts is None or samples is None:
        return None
    if not sppo:
        return f"{prompts} prompts × {samples} samples"
    if samples > 1:
        return f"{prompts * samples} prompts × 1 sample (SPPO, equal samples)"
    return f"{prompts} prompts × 1 sample (SPPO, equal prompts)"


def _first(cfg: dict, *keys, default=None):
    for k in keys:
        v = lookup(cfg, k)
        if v is not None:
            return v
    return default


def _failure_hint(run: Path) -> str | None:
    """The last error-looking line of the run's logs (train.log, *.out/*.err/*.log in the run
    directory, and ``slurm-*<run name>*.out`` next to it as submit_comparison.sh writes them)."""
    cands = [p for pat in ("*.log", "*.out", "*.err") for p in run.glob(pat)]
    if run.parent.is_dir():
        cands += sorted(run.parent.glob(f"*{run.name}*.out"))
    hint = None
    for p in sorted(set(cands), key=lambda p: p.stat().st_mtime if p.exists() else 0):
        try:
            lines = p.read_text(errors="replace").splitlines()
        except OSError:
            continue
        for line in reversed(lines):
            if _ERROR_RE.search(line):
                hint = f"{line.strip()[:200]} ({p.name})"
                break
    return hint


# ---------------------------------------------------------------------------- embedded
def _load_embedded(run: Path) -> Run:
    cfg = _read_yaml(run / "config.yaml")
    alg = lookup(cfg, "loss_fn.granular.algorithm") or run.name.split("_seed")[0]
    out = Run(dir=run, source="embedded", algorithm=alg, name=cfg.get("name", alg), seed=int(cfg.get("seed", 0)))
    rl = cfg.get("rl", {}) if isinstance(cfg.get("rl"), dict) else {}
    G = rl.get("generations_per_prompt")
    prompts = rl.get("prompts_per_step")
    sppo = alg == "sppo"
    out.meta = {
        "model": lookup(cfg, "model.path")
        or (
            f"tiny random Qwen3 (hidden {lookup(cfg, 'model.hidden_size')}, {lookup(cfg, 'model.num_layers')} layers"
            f"{', MoE' if lookup(cfg, 'model.moe') else ''}), warm-started on worked solutions"
        ),
        "task": (
            f"synthetic sums of {lookup(cfg, 'task.num_terms')} integers in [1, {lookup(cfg, 'task.max_term')}]"
            if lookup(cfg, "task.kind", "arithmetic") == "arithmetic"
            else f"JSONL {lookup(cfg, 'task.path')}"
        ),
        "steps": rl.get("steps"),
        "batch": _batch_text(prompts, G, sppo),
        "samples_per_step": None if prompts is None or G is None else prompts * G,
        "lr": rl.get("lr"),
        "optimizer_steps_per_rollout": rl.get("minibatches_per_rollout"),
        "decoding": {
            "train": f"T={rl.get('temperature')}, top-p 1, top-k off, ≤{rl.get('max_new_tokens')} tokens",
            "validation": f"greedy, ≤{rl.get('max_new_tokens')} tokens",
        },
        "validation_every": rl.get("eval_every"),
    }
    metrics = run / "metrics.jsonl"
    if not run.is_dir():
        out.status, out.problem = "failed", "no such directory"
        return out
    if not metrics.is_file():
        out.status = "failed"
        out.problem = "no metrics.jsonl (the run never started training)" + (
            f"; last error: {h}" if (h := _failure_hint(run)) else ""
        )
        return out
    bad = 0
    for line in metrics.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            bad += 1  # a line cut by a kill
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            out.recs.append({k: v for k, v in rec.items() if isinstance(v, (int, float))})
    out.recs.sort(key=lambda r: r["step"])
    out.meta["warmstart"] = warm_start_of(run, cfg, out.recs)
    _check_complete(out, rl.get("steps"), bad)
    return out


def warm_start_of(run: Path, cfg: dict, recs: list[dict]) -> dict | None:
    """The warm start an embedded run started from, or None: its own (the ``warmstart/*`` keys of its
    step-0 record) or, for a run started from ``model.init_from=<dir>/checkpoints/step_N/policy`` (the
    runs of ``compare``), the one in ``<dir>`` (its step-0 record and config.yaml). ``dir``, ``accuracy``
    (greedy held-out), ``steps``, ``target`` (``warmstart.target_accuracy``), ``max_steps``."""
    init = lookup(cfg, "model.init_from")
    if init:
        parents = Path(init).parents
        if len(parents) < 3:
            return None
        where = parents[2]
        rec0, wcfg = step0_record(where) or {}, _read_yaml(where / "config.yaml")
    else:
        where, wcfg = run, cfg
        rec0 = next((r for r in recs if r["step"] == 0), {})
    if not isinstance(rec0.get("warmstart/accuracy"), (int, float)):
        return None
    return {
        "dir": where,
        "accuracy": rec0["warmstart/accuracy"],
        "steps": rec0.get("warmstart/steps"),
        "target": lookup(wcfg, "warmstart.target_accuracy"),
        "max_steps": lookup(wcfg, "warmstart.max_steps"),
    }


def _check_complete(out: Run, planned, unreadable: int = 0) -> None:
    if not out.recs or out.last_step == 0:
        out.status = "failed"
        out.problem = "no RL step logged" + (f"; last error: {h}" if (h := _failure_hint(out.dir)) else "")
    elif planned and out.last_step < int(planned):
        out.status = "incomplete"
        out.problem = f"stopped at step {out.last_step} of {planned}" + (
            f"; last error: {h}"
            if (h := _failure_hint(out.dir))
            else " (no error in its logs: killed or still running)"
        )
    if unreadable and out.problem is None:
        out.problem = f"{unreadable} unreadable metrics line(s) skipped"


# ---------------------------------------------------------------------------- NeMo-RL
def read_scalars(run: Path) -> dict[str, dict[int, tuple[float, float]]]:
    """tag → step → (event wall time, value) from every TensorBoard event file under ``run``;
    for a step written twice (a resumed job) the later write wins. A file cut short by a kill is
    read up to its last complete record."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags: dict[str, dict[int, tuple[float, float]]] = {}
    for d in sorted({p.parent for p in event_files(run)}):
        acc = EventAccumulator(str(d), size_guidance={"scalars": 0})
        try:
            acc.Reload()
        except Exception:  # noqa: BLE001 - a corrupt file: keep what was read from the others
            continue
        for tag in acc.Tags().get("scalars", []):
            slot = tags.setdefault(tag, {})
            for ev in acc.Scalars(tag):
                old = slot.get(ev.step)
                if old is None or ev.wall_time >= old[0]:
                    slot[ev.step] = (ev.wall_time, float(ev.value))
    return tags


def _nemo_rl_config(run: Path) -> dict:
    if (run / "config.yaml").is_file():
        return _read_yaml(run / "config.yaml")
    steps = []
    for p in run.rglob("config.yaml"):
        m = re.fullmatch(r"step_(\d+)", p.parent.name)
        if m:
            steps.append((int(m.group(1)), p))
    return _read_yaml(max(steps)[1]) if steps else {}


def _load_nemo_rl(run: Path) -> Run:
    cfg = _nemo_rl_config(run)
    alg = (
        lookup(cfg, "loss_fn.granular.algorithm")
        or ("sppo" if lookup(cfg, "ppo") is not None and lookup(cfg, "grpo") is None else None)
        or re.split(r"[_\-]", run.name)[0]
    )
    algo_cfg = cfg.get("grpo") if isinstance(cfg.get("grpo"), dict) else (cfg.get("ppo") or {})
    out = Run(
        dir=run,
        source="nemo-rl",
        algorithm=alg,
        name=run.name.split("_seed")[0],
        seed=int(_first(cfg, "grpo.seed", "ppo.seed", default=0) or 0),
    )
    prompts = algo_cfg.get("num_prompts_per_step")
    G = algo_cfg.get("num_generations_per_prompt", 1 if alg == "sppo" else None)
    gen = lookup(cfg, "policy.generation", {}) or {}
    out.meta = {
        "model": lookup(cfg, "policy.model_name"),
        "task": _first(cfg, "data.train.dataset_name", "data.dataset_name", "data.train_data_path"),
        "steps": algo_cfg.get("max_num_steps"),
        "batch": None if prompts is None else f"{prompts} prompts × {G} samples",
        "samples_per_step": None if prompts is None or G is None else prompts * G,
        "lr": _first(cfg, "policy.optimizer.kwargs.lr", "policy.megatron_cfg.optimizer.lr"),
        "decoding": {
            "train": f"T={gen.get('temperature')}, top-p {gen.get('top_p')}, top-k {gen.get('top_k')}, "
            f"≤{gen.get('max_new_tokens')} tokens"
            if gen
            else None,
            "validation": (
                f"{algo_cfg.get('val_num_generations_per_prompt', 1)} sample(s)/prompt, "
                f"T={gen.get('val_temperature', gen.get('temperature'))}"
            )
            if gen
            else None,
        },
        "validation_every": algo_cfg.get("val_period"),
        "source_note": "NeMo-RL TensorBoard events",
    }
    if not run.is_dir():
        out.status, out.problem = "failed", "no such directory"
        return out
    if not event_files(run):
        out.status = "failed"
        out.problem = (
            "no TensorBoard event files (logger.tensorboard_enabled off, or the job died before its first step)"
        ) + (f"; last error: {h}" if (h := _failure_hint(run)) else "")
        return out
    tags = read_scalars(run)
    out.recs = nemo_rl_records(tags, out.meta.get("samples_per_step"))
    if "train/prev_entropy_mean" not in tags and "train/approx_entropy" in tags:
        out.meta["entropy_note"] = "entropy: NeMo-RL's approx_entropy (sampled estimate), not π_old's"
    _check_complete(out, out.meta["steps"])
    return out


def nemo_rl_records(tags: dict, samples_per_step: int | None) -> list[dict]:
    """Canonical per-step records from NeMo-RL's TensorBoard scalars (vectorised per tag)."""
    steps = sorted(
        {s for k in (STEP_TIME_TAG, "train/reward") for s in tags.get(k, {})}
        | {s for s in tags.get("validation/accuracy", {})}
    )
    if not steps:
        return []
    steps_arr = np.asarray(steps, dtype=np.int64)

    def column(tag):
        d = tags.get(tag, {})
        return np.array([d[s][1] if s in d else np.nan for s in steps], dtype=np.float64)

    step_time = np.nan_to_num(column(STEP_TIME_TAG), nan=0.0)
    val_time = np.zeros_like(step_time)
    for tag in VALIDATION_TIME_TAGS:
        val_time += np.nan_to_num(column(tag), nan=0.0)
    wall = np.cumsum(np.clip(step_time - val_time, 0.0, None))
    if SAMPLES_TAG in tags:
        samples = np.cumsum(np.nan_to_num(column(SAMPLES_TAG), nan=0.0))
    else:
        samples = steps_arr * (samples_per_step or 0)
    cols = {}
    for key, cands in NEMO_RL_METRICS.items():
        for tag in cands:
            if tag in tags:
                cols[key] = column(tag)
                break
    recs = []
    for i, s in enumerate(steps):
        rec = {"step": int(s), "samples": int(samples[i]), "wall_time": float(wall[i])}
        rec.update({k: float(v[i]) for k, v in cols.items() if math.isfinite(v[i])})
        recs.append(rec)
    return recs


# ---------------------------------------------------------------------------- entry
def load_run(path) -> Run:
    """The run in ``path`` (embedded or NeMo-RL), with status and problem; evals attached
    from ``<run>/evals.json`` when present."""
    run = Path(path)
    kind = detect(run) if run.is_dir() else "unknown"
    if kind == "embedded":
        out = _load_embedded(run)
    elif kind == "nemo-rl":
        out = _load_nemo_rl(run)
    else:
        out = Run(
            dir=run,
            source="unknown",
            algorithm=run.name.split("_seed")[0],
            name=run.name.split("_seed")[0],
            seed=0,
            status="failed",
        )
        out.problem = (
            "no such directory"
            if not run.is_dir()
            else "neither metrics.jsonl (embedded run) nor TensorBoard event files (NeMo-RL run)"
        ) + (f"; last error: {h}" if run.is_dir() and (h := _failure_hint(run)) else "")
    ev = run / "evals.json"
    if ev.is_file():
        try:
            out.evals = json.loads(ev.read_text())
        except (OSError, ValueError) as err:
            out.meta["evals_note"] = f"evals.json unreadable ({str(err).splitlines()[0]})"
    return out
