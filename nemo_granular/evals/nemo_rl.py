"""The benchmark suites on a cluster: every checkpoint of a NeMo-RL run through NeMo-RL's ``run_eval``.

For each checkpoint ``<run>/checkpoints/step_N`` the protocol asks for (:mod:`.suite`):

1. export it to Hugging Face format once: ``python -m nemo_granular export <step_N> <run>/hf/step_N
   --no-verify`` (skipped when ``<run>/hf/step_N/config.json`` exists); a Megatron checkpoint is
   exported by an interpreter that has Megatron-Bridge (:mod:`.export_python`);
2. per benchmark: ``<launcher> --config nemo_granular/configs/evals/<benchmark>.yaml
   generation.model_name=<hf> tokenizer.name=<hf> eval.num_tests_per_prompt=<n> ...
   eval.save_path=<run>/evals/<suite>/step_N/<benchmark>``, in the NeMo-RL checkout (its prompt
   file and ``examples/run_eval.py``); the launcher defaults to ``uv run python examples/run_eval.py``,
   and to ``python examples/run_eval.py`` in a container job (:func:`default_launcher`);
3. read ``evaluation_data.json`` that ``run_eval`` saves there: the score is the mean reward over
   all samples (avg@n); merged into ``<run>/evals.json`` (:mod:`.results`).

A benchmark whose result file already exists is not run again (rerun after a failure resumes).
:func:`plan` is pure: ``--dry-run`` prints exactly the commands :func:`run_plan` would execute.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .export_python import ExportPython, megatron_export_python
from .results import check_steps, merge_write
from .suite import BENCHMARKS, Protocol

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs" / "evals"  # package data: found from a wheel too
DEFAULT_LAUNCHER = "uv run python examples/run_eval.py"
CONTAINER_LAUNCHER = "python examples/run_eval.py"


def default_launcher(environ=None) -> str:
    """How ``run_eval`` is started when ``--launcher`` is not given: ``uv run python`` in a NeMo-RL
    checkout; in a container job (``NG_CONTAINER``, which ``slurm/launch.sh`` and
    ``submit_comparison.sh`` set in every container step) the image's ``python``, whose venv is
    NeMo-RL's. ``uv run`` there re-syncs the project (a checkout mounted elsewhere than the image's
    own is built again, which needs an index) and needs a writable cache: under pyxis ``HOME`` is
    an empty directory in a read-only root (docs/slurm.md)."""
    import os

    env = os.environ if environ is None else environ
    return CONTAINER_LAUNCHER if env.get("NG_CONTAINER") else DEFAULT_LAUNCHER


STEP_RE = re.compile(r"step_(\d+)")


@dataclass
class Command:
    kind: str  # "export" | "eval"
    argv: list[str]
    cwd: Path | None
    step: int
    suite: str | None = None
    benchmark: str | None = None
    result: Path | None = None  # evaluation_data.json that marks it done
    settings: dict = field(default_factory=dict)
    exporter: ExportPython | None = None  # export of a Megatron checkpoint: the interpreter chosen

    def shell(self) -> str:
        cmd = shlex.join(self.argv)
        return f"(cd {shlex.quote(str(self.cwd))} && {cmd})" if self.cwd else cmd


def checkpoint_steps(run: Path) -> dict[int, Path]:
    ckpt = run / "checkpoints"
    if not ckpt.is_dir():
        return {}
    return {int(m.group(1)): p for p in ckpt.iterdir() if p.is_dir() and (m := STEP_RE.fullmatch(p.name))}


def benchmark_data(key: str, data_dir: Path | None) -> list[str]:
    """The data overrides of one benchmark: NeMo-RL's loader, or the local JSONL file in ``data_dir``
    (for a benchmark NeMo-RL loads itself, a ``<key>.jsonl`` present in ``data_dir`` wins: offline nodes)."""
    b = BENCHMARKS[key]
    local = None if data_dir is None else Path(data_dir).resolve() / f"{key}.jsonl"
    if b.builtin and not (local is not None and local.is_file()):
        return []
    if local is None:
        raise ValueError(f"benchmark {key}: NeMo-RL has no loader for it; give --data-dir with {key}.jsonl")
    return [
        f"data.dataset_name={local}",
        "data.problem_key=problem",
        "data.solution_key=answer",
        "data.file_format=json",
        "data.split=train",
    ]


def is_megatron_checkpoint(step_dir: Path) -> bool:
    from ..export.source import detect

    try:
        return detect(Path(step_dir), "policy") == "megatron"
    except ValueError:
        return False  # not a checkpoint the exporter knows: it says so itself


def training_vllm_tp(step_dir: Path) -> int | None:
    """The vLLM ``tensor_parallel_size`` the run generated with (``policy.generation.vllm_cfg`` of
    the ``config.yaml`` NeMo-RL's CheckpointManager saves in every checkpoint): the size the run
    chose for its model (e.g. 4 for Qwen3-30B-A3B, whose bf16 weights, ~57 GiB, leave little of
    an H100 for the KV cache at TP 1). None when the checkpoint has no such config."""
    from ..export.source import read_yaml

    cfg = Path(step_dir) / "config.yaml"
    if not cfg.is_file():
        return None
    try:
        tp = read_yaml(cfg)["policy"]["generation"]["vllm_cfg"]["tensor_parallel_size"]
    except (KeyError, TypeError, ValueError):
        return None
    return tp if isinstance(tp, int) and tp >= 1 else None


def plan(
    run: Path,
    protocols: list[Protocol],
    *,
    nemo_rl_dir: Path,
    data_dir: Path | None = None,
    launcher: str | None = None,
    config_dir: Path = CONFIG_DIR,
    gpus_per_node: int = 8,
    num_nodes: int = 1,
    tensor_parallel: int | None = None,
    prompt_tokens: int = 1024,
    python: str = sys.executable,
    export_python: str | None = None,
    steps: list[int] | None = None,
    extra: list[str] | None = None,
    benchmarks: list[str] | None = None,
) -> list[Command]:
    """The commands, in order. ``python`` exports DTensor checkpoints; ``export_python`` is the
    interpreter for Megatron ones (default: :func:`.export_python.megatron_export_python`).
    ``benchmarks``: only these of each protocol's benchmarks (None: all). ``launcher``: None =
    :func:`default_launcher`.
    ``tensor_parallel``: vLLM's TP for every benchmark; None = the training run's
    (:func:`training_vllm_tp`, else 1), at most the eval's GPUs (``gpus_per_node * num_nodes``)."""
    run = Path(run).resolve()
    launcher = default_launcher() if launcher is None else launcher
    ckpts = checkpoint_steps(run)
    if not ckpts:
        raise FileNotFoundError(f"{run}: no checkpoints/step_N (not a NeMo-RL run directory with checkpoints)")
    all_steps = sorted(ckpts)
    check_steps(run, steps, all_steps)
    exported: set[int] = set()
    cmds: list[Command] = []
    for proto in protocols:
        if steps is not None:
            chosen = [s for s in all_steps if s in steps]
        elif proto.select == "best":
            chosen = sorted({s for s in all_steps if proto.every is None or s % proto.every == 0} | {all_steps[-1]})
        else:
            chosen = [all_steps[-1]]
        for step in chosen:
            hf = run / "hf" / f"step_{step}"
            tp = tensor_parallel if tensor_parallel is not None else (training_vllm_tp(ckpts[step]) or 1)
            if tp > gpus_per_node * num_nodes:
                source = "--tensor-parallel" if tensor_parallel is not None else "the run's policy.generation.vllm_cfg"
                raise ValueError(
                    f"vLLM tensor_parallel_size {tp} ({source}) needs more GPUs than the eval has "
                    f"({num_nodes} node(s) x {gpus_per_node}); give --gpus-per-node/--num-nodes "
                    "or --tensor-parallel"
                )
            if step not in exported:
                exported.add(step)
                if not (hf / "config.json").is_file():
                    exporter = None
                    args = [str(ckpts[step]), str(hf), "--no-verify"]
                    if is_megatron_checkpoint(ckpts[step]):
                        exporter = megatron_export_python(nemo_rl_dir, explicit=export_python)
                        argv = exporter.export_argv(*args)
                    else:
                        argv = [python, "-m", "nemo_granular", "export", *args]
                    cmds.append(Command("export", argv, None, step, exporter=exporter))
            for key, setting in proto.benchmarks.items():
                if benchmarks is not None and key not in benchmarks:
                    continue
                save = run / "evals" / proto.name / f"step_{step}" / key
                argv = shlex.split(launcher) + [
                    "--config",
                    str(Path(config_dir).resolve() / f"{key}.yaml"),
                    f"generation.model_name={hf}",
                    f"tokenizer.name={hf}",
                    "eval.metric=pass@k",
                    "eval.k_value=1",
                    f"eval.num_tests_per_prompt={setting.samples}",
                    f"generation.temperature={setting.temperature:g}",
                    f"generation.top_p={setting.top_p:g}",
                    f"generation.vllm_cfg.max_model_len={prompt_tokens + proto.max_new_tokens}",
                    f"generation.vllm_cfg.tensor_parallel_size={tp}",
                    f"cluster.gpus_per_node={gpus_per_node}",
                    f"cluster.num_nodes={num_nodes}",
                    *benchmark_data(key, data_dir),
                    f"eval.save_path={save}",
                    *(extra or []),
                ]
                cmds.append(
                    Command(
                        "eval",
                        argv,
                        Path(nemo_rl_dir),
                        step,
                        proto.name,
                        key,
                        save / "evaluation_data.json",
                        {
                            "samples": setting.samples,
                            "decoding": setting.decoding,
                            "metric": setting.metric,
                            "max_new_tokens": proto.max_new_tokens,
                        },
                    )
                )
    return cmds


def read_result(path: Path) -> tuple[float, int, int]:
    """(score = mean reward over all samples, problems, samples per problem) of a run_eval output."""
    try:
        data = json.loads(path.read_text())
        rewards = [float(s["reward"]) for s in data["evaluation_data"]]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path}: not a run_eval evaluation_data.json ({str(err).splitlines()[0]})") from None
    n = 1
    cfg = path.with_name("config.json")
    if cfg.is_file():
        try:
            n = int(json.loads(cfg.read_text()).get("num_tests_per_prompt", 1)) or 1
        except (ValueError, TypeError):
            n = 1
    if not rewards:
        raise ValueError(f"{path}: no evaluated samples")
    return sum(rewards) / len(rewards), len(rewards) // n, n


def collect(run: Path, protocols: list[Protocol], cmds: list[Command], benchmarks: list[str] | None = None) -> dict:
    """Merge every finished result of the plan into ``<run>/evals.json``. ``benchmarks``: the
    suite's benchmarks the plan was restricted to (the suite is then recorded with those only)."""
    run = Path(run).resolve()
    data = {}
    for proto in protocols:
        mine = [c for c in cmds if c.kind == "eval" and c.suite == proto.name]
        benches, results = {}, {}
        for c in mine:
            if not c.result.is_file():
                continue
            s, problems, n = read_result(c.result)
            results.setdefault(c.step, {})[c.benchmark] = s
            benches[c.benchmark] = {
                "label": BENCHMARKS[c.benchmark].label,
                "problems": problems,
                "samples_per_problem": n,
                "decoding": c.settings["decoding"] + f", ≤{c.settings['max_new_tokens']} new tokens",
                "metric": c.settings["metric"],
            }
        if not results:
            continue
        for key, setting in proto.benchmarks.items():  # benchmarks with no result yet still get a column
            if benchmarks is not None and key not in benchmarks:
                continue
            benches.setdefault(
                key,
                {
                    "label": BENCHMARKS[key].label,
                    "problems": "?",
                    "samples_per_problem": setting.samples,
                    "decoding": setting.decoding,
                    "metric": setting.metric,
                },
            )
        data = merge_write(
            run / "evals.json",
            run.name,
            "nemo-rl",
            proto.name,
            {
                "description": proto.description,
                "select": proto.select,
                "select_note": proto.select_note,
                "every": proto.every,
            },
            benches,
            results,
        )
    return data


def run_plan(cmds: list[Command], log=print) -> list[str]:
    """Execute the plan in order; a benchmark already done is skipped. Returns the failures
    (one line each); a failed export skips that checkpoint's evaluations."""
    failed_steps: set[int] = set()
    failures = []
    for c in cmds:
        if c.step in failed_steps:
            continue
        if c.kind == "eval" and c.result.is_file():
            log(f"[eval-checkpoints] step {c.step} {c.suite}/{c.benchmark}: done before, kept")
            continue
        log(f"[eval-checkpoints] {c.shell()}")
        rc = subprocess.call(c.argv, cwd=str(c.cwd) if c.cwd else None)
        if rc != 0 or (c.kind == "eval" and not c.result.is_file()):
            what = "export" if c.kind == "export" else f"{c.suite}/{c.benchmark}"
            failures.append(f"step {c.step} {what}: exit {rc}" + ("" if rc else f", no {c.result}"))
            if c.kind == "export":
                failed_steps.add(c.step)
    return failures
