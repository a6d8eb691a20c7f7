#!/usr/bin/env python3
"""Stand-in for a NeMo-RL training driver in the Slurm comparison test (a test fixture).

``slurm/submit_comparison.sh`` starts NeMo-RL drivers as ``$NEMO_RL_PYTHON -m
nemo_granular.run_grpo --config CFG overrides...``; the test sets ``NEMO_RL_PYTHON="python
tests/harness/nemo_rl_logger_driver.py"``, so this script receives exactly the arguments Python would.
Instead of training it produces what a NeMo-RL run leaves behind, with NeMo-RL's own code:

* the config as ``run_grpo`` / ``run_sppo`` load it (``nemo_granular.nemo_rl.configs.load_resolved``:
  NeMo-RL's ``load_config`` with the ``nemo_rl/upstream/`` parents resolved, ``parse_hydra_overrides``,
  NeMo-RL's resolvers);
* TensorBoard events from NeMo-RL's ``Logger`` in ``get_next_experiment_dir(logger.log_dir)``
  (``exp_NNN/``), with the metric names and prefixes NeMo-RL's GRPO/PPO loops log
  (``train/reward``, ``train/mean_gen_tokens_per_sample``, ``train/global_valid_seqs``,
  ``timing/train/total_step_time``, ``validation/accuracy``, ...), one step per
  ``step_seconds`` (``NG_FAKE_STEP_SECONDS``, default 0.2);
* a final checkpoint ``checkpoint_dir/step_N/``: when ``policy.model_name`` is a local (small)
  Hugging Face model (e.g. ``tests/harness/export_cpu/tiny_hf.py``), with REAL weights in the format of the
  config's backend (Megatron only: ``policy.megatron_cfg.enabled``, else exit 2), as NeMo-RL's
  Megatron policy worker writes it (:func:`write_megatron_checkpoint`); otherwise NeMo-RL's
  ``CheckpointManager`` writes its ``config.yaml`` and no weights. The "training": the initial weights plus
  seeded noise (deterministic in algorithm and seed), saved as ``<run>/stand_in/trained_hf`` (the
  weights the checkpoint holds, for a test to compare with an export), then written by
  ``tests/harness/export_cpu/megatron_writer.py`` with NeMo-RL's and Megatron-Bridge's code (HF import,
  ``setup_model_config`` on the run's config at TP = PP = CP = EP = 1, Bridge's
  ``save_checkpoint``, ``CheckpointManager``, which writes the run's ``config.yaml``), in one
  process started with the Python NeMo-RL starts its Megatron workers with (the stock Megatron
  worker's venv under ``NEMO_RL_VENV_DIR``, else this one).

The metrics are synthetic but deterministic in (algorithm, seed, step); ESPO's curves rise a
little faster than GSPO's so the report has something to compare. The benchmark scores are not
this script's: the eval job (``nemo-granular eval-checkpoints``) measures them on the checkpoint.

``-m nemo_granular preflight ...`` (how the launchers call the preflight with the driver's Python)
runs the REAL ``nemo-granular preflight``, exactly as ``python -m nemo_granular preflight ...``
would (:func:`preflight`). ``NG_FAKE_PREFLIGHT=1`` swaps in :func:`fake_preflight`, a stand-in
with the same interface, for the tests in which the real one (tens of seconds of NeMo-RL import
per call) would add time but no evidence.

As a stand-in for ``python``, ``-m`` puts the current directory first on ``sys.path`` as Python
does: a NeMo-RL checkout as the working directory makes ``nemo_rl`` importable, as for ``uv run
python -m ...`` there.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace


def as_python_m() -> None:
    """``sys.path`` as ``python -m MODULE`` has it: the current directory first."""
    sys.path.insert(0, os.getcwd())


def fake_preflight(argv: list[str]) -> int:
    """Stand-in for ``nemo-granular preflight [--driver grpo|sppo] CONFIG [key=value ...]``: appends
    its command line (without ``--driver``) to ``$NG_FAKE_PREFLIGHT_LOG`` (when set) and reports a
    missing CONFIG plus the problems listed in ``$NG_FAKE_PREFLIGHT_PROBLEMS`` (separated by ``;``),
    one line each on stderr in the real one's format (``preflight: error: <problem> [source]``),
    exit 1; exit 0 without any."""
    if argv[:1] == ["--driver"]:  # --driver grpo|sppo (what the launchers pass)
        argv = argv[2:]
    log = os.environ.get("NG_FAKE_PREFLIGHT_LOG")
    if log:
        with open(log, "a") as f:
            f.write(" ".join(argv) + "\n")
    problems = [p for p in os.environ.get("NG_FAKE_PREFLIGHT_PROBLEMS", "").split(";") if p.strip()]
    if not argv or not Path(argv[0]).is_file():
        problems.insert(0, f"{argv[0] if argv else 'CONFIG'}: no such config file")
    for p in problems:
        print(f"preflight: error: {p.strip()} [stand-in preflight]", file=sys.stderr)
    if not problems:
        print(f"preflight: {argv[0]}: no problems", flush=True)
    return 1 if problems else 0


def preflight(argv: list[str]) -> int:
    """``-m nemo_granular preflight ARGV``: the real CLI, run as ``python -m nemo_granular`` runs it
    (``runpy``, ``sys.argv`` set as Python sets it); ``NG_FAKE_PREFLIGHT=1``: :func:`fake_preflight`."""
    if os.environ.get("NG_FAKE_PREFLIGHT") == "1":
        return fake_preflight(argv)
    import runpy

    sys.argv = ["-m", "preflight", *argv]  # runpy replaces argv[0] with the module's path
    try:
        runpy.run_module("nemo_granular", run_name="__main__", alter_sys=True)
    except SystemExit as done:  # nemo_granular/__main__.py ends with sys.exit(main())
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["-m"]:
        as_python_m()
    if argv[:3] == ["-m", "nemo_granular", "preflight"]:
        return preflight(argv[3:])
    if len(argv) < 2 or argv[0] != "-m":
        print(
            "nemo_rl_logger_driver: usage: -m nemo_granular.run_grpo|run_sppo --config CFG [overrides]", file=sys.stderr
        )
        return 2
    import argparse

    parser = argparse.ArgumentParser(prog=argv[1])  # as run_grpo / run_sppo parse their arguments
    parser.add_argument("--config", required=True)
    args, overrides = parser.parse_known_args(argv[2:])
    module, cfg_path = argv[1], args.config
    if module not in ("nemo_granular.run_grpo", "nemo_granular.run_sppo"):
        print(f"nemo_rl_logger_driver: unexpected module {module}", file=sys.stderr)
        return 2
    from nemo_rl.utils.logger import Logger, get_next_experiment_dir

    from nemo_granular.nemo_rl.configs import load_resolved

    cfg = load_resolved(cfg_path, overrides)  # what run_grpo / run_sppo load
    real_weights = Path(str(cfg["policy"]["model_name"])).is_dir()  # a local (small) model: real weights
    if real_weights and not (cfg["policy"].get("megatron_cfg") or {}).get("enabled"):
        print(
            "nemo_rl_logger_driver: writes real weights in Megatron checkpoints only (policy.megatron_cfg.enabled)",
            file=sys.stderr,
        )
        return 2
    section = "ppo" if module.endswith("run_sppo") else "grpo"
    algo = cfg[section]
    name = (cfg.get("loss_fn", {}).get("granular", {}) or {}).get("algorithm") or (
        "sppo" if section == "ppo" else "grpo"
    )
    seed = int(algo.get("seed", 0))
    steps = int(algo["max_num_steps"])
    val_period = int(algo.get("val_period", 0) or 0)
    samples = int(algo["num_prompts_per_step"]) * int(algo.get("num_generations_per_prompt", 1))
    dt = float(os.environ.get("NG_FAKE_STEP_SECONDS", "0.2"))

    log_cfg = cfg["logger"]
    log_cfg["log_dir"] = get_next_experiment_dir(log_cfg["log_dir"])
    log_cfg.update(wandb_enabled=False, swanlab_enabled=False, mlflow_enabled=False, monitor_gpus=False)
    logger = Logger(log_cfg)
    print(
        f"[{name}] logging to {log_cfg['log_dir']} (nodes={cfg['cluster']['num_nodes']}, "
        f"gpus/node={cfg['cluster']['gpus_per_node']})",
        flush=True,
    )

    rate = {"espo": 0.09, "sspo": 0.08, "sppo": 0.07}.get(name, 0.05)
    noise = lambda s: 0.01 * math.sin(1.7 * s + seed)  # noqa: E731 - deterministic "noise"

    def accuracy(step: int) -> float:
        return 0.30 + 0.25 * (1 - math.exp(-rate * step)) + noise(step)

    if algo.get("val_at_start"):
        logger.log_metrics({"accuracy": accuracy(0)}, 0, prefix="validation")
    for step in range(1, steps + 1):
        time.sleep(dt)
        reward = 0.25 + 0.3 * (1 - math.exp(-rate * step)) + noise(step)
        logger.log_metrics(
            {
                "reward": reward,
                "mean_gen_tokens_per_sample": 900.0 + 20 * step,
                "global_valid_seqs": float(samples),
                "loss": -0.01 * reward,
                "grad_norm": 0.5 + noise(step),
                "clip_frac_low": 0.002,
                "clip_frac_high": 0.003,
                "prev_entropy_mean": 0.42 - 0.005 * step,
            },
            step,
            prefix="train",
        )
        logger.log_metrics({"total_step_time": 30.0 + 5 * noise(step)}, step, prefix="timing/train")
        if val_period and step % val_period == 0:
            logger.log_metrics({"accuracy": accuracy(step)}, step, prefix="validation")
            logger.log_metrics({"total_validation_time": 3.0}, step, prefix="timing/validation")

    info = {"step": steps, "val_reward": accuracy(steps)}
    if real_weights:
        path = write_megatron_checkpoint(cfg, steps, info, f"{name}:{seed}")
    else:
        from nemo_rl.utils.checkpoint import CheckpointManager

        ckpt = CheckpointManager(cfg["checkpointing"])
        # run_config: NeMo-RL passes its pydantic MasterConfig and dumps .model_dump() to config.yaml
        path = ckpt.init_tmp_checkpoint(steps, info, run_config=SimpleNamespace(model_dump=lambda: cfg))
        ckpt.finalize_checkpoint(path)
    print(f"[{name}] finished {steps} steps; checkpoint {path}", flush=True)
    return 0


TRAINING_NOISE = 2e-3  # the stand-in's "training": std of the noise added to every weight
STOCK_MEGATRON_WORKER = "nemo_rl.models.policy.workers.megatron_policy_worker.MegatronPolicyWorker"
WRITER = Path(__file__).resolve().parent / "export_cpu" / "megatron_writer.py"


def megatron_worker_python() -> str:
    """The interpreter NeMo-RL starts its Megatron policy workers with: the stock worker's venv
    under ``NEMO_RL_VENV_DIR`` (prebuilt in NeMo-RL's image) unless NeMo-RL is told to use this
    one (``NEMO_RL_PY_EXECUTABLES_SYSTEM=1``); this one when there is no such venv."""
    venv = Path(os.environ.get("NEMO_RL_VENV_DIR") or Path.cwd() / "venvs") / STOCK_MEGATRON_WORKER / "bin" / "python"
    if os.environ.get("NEMO_RL_PY_EXECUTABLES_SYSTEM") == "1" or not venv.exists():
        return sys.executable
    return str(venv)


def write_megatron_checkpoint(cfg: dict, step: int, info: dict, training_key: str) -> Path:
    """``checkpoint_dir/step_<step>`` with the "trained" weights of ``policy.model_name`` (module
    docstring); returns it."""
    import json
    import socket
    import subprocess
    import zlib

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt_dir = Path(cfg["checkpointing"]["checkpoint_dir"])
    work = ckpt_dir.parent / "stand_in"
    trained = work / "trained_hf"
    model_name = cfg["policy"]["model_name"]
    model = AutoModelForCausalLM.from_pretrained(model_name, dtype=torch.float32)
    gen = torch.Generator().manual_seed(zlib.crc32(training_key.encode()))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(TRAINING_NOISE * torch.randn(p.shape, generator=gen))
    model.save_pretrained(str(trained))
    AutoTokenizer.from_pretrained(model_name).save_pretrained(str(trained))
    job = {
        "config": cfg,
        "hf_dir": str(trained),
        "checkpoint_dir": str(ckpt_dir),
        "step": step,
        "tp": 1,
        "pp": 1,
        "ep": 1,
        "training_info": info,
        "scratch_dir": str(work),
    }
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    python = megatron_worker_python()
    # NeMo-RL from the working directory (the checkout), as `python -m` found it for this process
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *filter(None, [os.environ.get("PYTHONPATH")])])}
    print(f"[stand-in] writing {ckpt_dir / f'step_{step}'} with {python}", flush=True)
    subprocess.run([python, str(WRITER), "0", "1", str(port), json.dumps([job])], env=env, check=True)
    return ckpt_dir / f"step_{step}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
