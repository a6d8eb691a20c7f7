#!/usr/bin/env python3
"""Stand-in NeMo-RL training driver for the launcher's time-limit and preemption tests (a test fixture).

    python tests/harness/nemo_rl_loop_driver.py -m nemo_granular.run_grpo|nemo_granular.run_sppo --config CFG [overrides]
    python tests/harness/nemo_rl_loop_driver.py -m nemo_granular preflight CFG [overrides]

``slurm/launch.sh`` gets it as ``python tests/harness/nemo_rl_loop_driver.py -m nemo_granular.run_grpo ...``,
i.e. as the Python that starts the driver. It runs the REAL ``nemo_granular.run_grpo.main`` /
``nemo_granular.run_sppo.main`` — our config loader on NeMo-RL's parents, the start-up checks,
NeMo-RL's ``MasterConfig``, NeMo-RL's own ``init_ray`` attaching to the launcher's Ray cluster,
tokenizer, data, the estimator install, the exit code — and replaces only what needs GPUs:

* ``setup`` (it builds GPU worker clusters): the stand-in does what NeMo-RL's ``setup`` does for
  checkpoints (``grpo.py:550-553``, ``ppo.py:420-426`` at 7ea279ab: NeMo-RL's ``CheckpointManager``,
  its latest ``step_N``, the save state from ``_get_grpo_save_state`` / ``_default_ppo_save_state``)
  and returns stand-ins for the rest;
* ``grpo_train`` / ``ppo_train`` (rollouts need vLLM): a loop with the stopping logic of NeMo-RL's
  loops (``grpo.py:2699-3812``, ``ppo.py:1224-2020``): ``TimeoutChecker`` looked up in the algorithm
  module when the loop starts, as the real loop does; ``mark_iteration`` then ``check_save`` after
  every step; a checkpoint through ``CheckpointManager`` (``tmp_step_N``, renamed to ``step_N``)
  every ``checkpointing.save_period`` steps, on the last step and when ``check_save`` fires, with
  the save state updated in place first; ``return`` after a timeout save, after the last step and
  when the epochs run out — how NeMo-RL stops at ``checkpointing.checkpoint_must_save_by``;
* ``create_env`` (a Ray actor per environment): a stand-in object.

``-m nemo_granular preflight`` runs the real preflight, or with ``NG_FAKE_PREFLIGHT=1`` the
stand-in (``tests/harness/nemo_rl_logger_driver.py``: ``preflight``, ``fake_preflight``).

Each step sleeps ``NG_FAKE_STEP_SECONDS`` (default 0.5) and appends ``{"step", "attempt"}`` to
``<run>/steps.jsonl`` (run = the parent of ``checkpointing.checkpoint_dir``); each save of the
first attempt sleeps ``NG_FAKE_SAVE_SECONDS`` (default 0) inside ``tmp_step_N`` before NeMo-RL
renames it (a slow save). Before the real driver starts, the script writes
``<run>/startup.<attempt>`` and, in the first attempt, sleeps ``NG_FAKE_STARTUP_SECONDS`` (default
0): the window in which a real driver has no signal handler yet (interpreter start, ``uv run``'s
environment sync, heavy imports). Both are windows the tests send USR1 into; a requeued attempt
(``NG_SLURM_ATTEMPT`` > 0) is not signalled and does without them.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nemo_rl_logger_driver import as_python_m, preflight  # tests/ is not a package

MODULES = {
    "nemo_granular.run_grpo": ("nemo_rl.algorithms.grpo", "grpo", "grpo_train"),
    "nemo_granular.run_sppo": ("nemo_rl.algorithms.ppo", "ppo", "ppo_train"),
}


def _attempt() -> int:
    return int(os.environ.get("NG_SLURM_ATTEMPT", "0"))


class _StandIn:
    """Answers what run_grpo / run_sppo call on the objects setup returns (none of it is trained)."""

    def shutdown(self) -> None:
        pass


def _stand_in_setup(algo, section: str):
    def setup(master_config, tokenizer, dataset, val_dataset, *args, **kwargs):
        from nemo_rl.utils.checkpoint import CheckpointManager
        from nemo_rl.utils.logger import Logger

        checkpointer = CheckpointManager(master_config.checkpointing)
        loaded = checkpointer.load_training_info(checkpointer.get_latest_checkpoint_path())
        if section == "grpo":
            state = algo._get_grpo_save_state(loaded)
        else:
            state = loaded if loaded is not None else algo._default_ppo_save_state()
        log_cfg = dict(
            master_config.logger,
            wandb_enabled=False,
            tensorboard_enabled=False,
            mlflow_enabled=False,
            swanlab_enabled=False,
            monitor_gpus=False,
        )
        logger = Logger(log_cfg)
        # one batch per step: the epoch never ends before max_num_steps
        dataloader = list(range(int(getattr(master_config, section).max_num_steps)))
        policy, generation = _StandIn(), _StandIn()
        if section == "grpo":
            return (
                policy,
                generation,
                None,
                (None, None),
                dataloader,
                None,
                None,
                logger,
                checkpointer,
                state,
                master_config,
                None,
                None,
            )
        return (
            policy,
            generation,
            _StandIn(),
            (None, None),
            dataloader,
            None,
            None,
            None,
            logger,
            checkpointer,
            state,
            master_config,
        )

    return setup


def _stand_in_loop(algo, section: str, real_train):
    state_key = f"{section}_save_state"

    def train(*args, **kwargs):
        bound = inspect.signature(real_train).bind(*args, **kwargs)  # called exactly as NeMo-RL's loop is
        a = bound.arguments
        cfg, state, checkpointer = a["master_config"], a[state_key], a["checkpointer"]
        dataloader = a.get("dataloader", a.get("wrapped_dataloader"))
        is_dict = isinstance(state, dict)

        def get(k):
            return state[k] if is_dict else getattr(state, k)

        def put(k, v):
            if is_dict:
                state[k] = v
            else:
                setattr(state, k, v)

        run = Path(cfg.checkpointing["checkpoint_dir"]).parent
        step_s = float(os.environ.get("NG_FAKE_STEP_SECONDS", "0.5"))
        save_s = float(os.environ.get("NG_FAKE_SAVE_SECONDS", "0")) if _attempt() == 0 else 0.0
        algo_cfg = getattr(cfg, section)
        # the wall-clock window in which the checker (and its time budget) was made, for the tests
        made_after = time.time()
        timeout = algo.TimeoutChecker(timeout=cfg.checkpointing["checkpoint_must_save_by"], fit_last_save_time=True)
        with open(run / "checkers.jsonl", "a") as f:
            f.write(json.dumps({"attempt": _attempt(), "after": made_after, "before": time.time()}) + "\n")
        timeout.start_iterations()
        current_step, total_steps, current_epoch = get("current_step"), get("total_steps"), get("current_epoch")
        max_steps, max_epochs = algo_cfg.max_num_steps, algo_cfg.max_num_epochs
        print(
            f"stand-in {section} loop: from step {total_steps}, max_num_steps {max_steps}, "
            f"checkpoint_must_save_by {cfg.checkpointing['checkpoint_must_save_by']}",
            flush=True,
        )
        while current_epoch < max_epochs and total_steps < max_steps:
            for _batch in dataloader[current_step:]:
                time.sleep(step_s)
                with open(run / "steps.jsonl", "a") as f:
                    f.write(json.dumps({"step": total_steps + 1, "attempt": _attempt()}) + "\n")
                is_last = total_steps + 1 >= max_steps or (
                    current_epoch + 1 == max_epochs and current_step + 1 == len(dataloader)
                )
                timeout.mark_iteration()
                by_step = is_last or (total_steps + 1) % cfg.checkpointing["save_period"] == 0
                by_timeout = timeout.check_save()
                if cfg.checkpointing["enabled"] and (by_step or by_timeout):
                    put("current_step", current_step + 1)
                    put("total_steps", total_steps + 1)
                    put("current_epoch", current_epoch)
                    print(f"Saving checkpoint for step {total_steps + 1}...", flush=True)
                    path = Path(
                        checkpointer.init_tmp_checkpoint(total_steps + 1, dict(state) if is_dict else vars(state), cfg)
                    )
                    (path / "policy").mkdir()
                    (path / "policy" / "weights.txt").write_text(f"step {total_steps + 1}\n")
                    time.sleep(save_s)
                    checkpointer.finalize_checkpoint(path)
                current_step += 1
                total_steps += 1
                if by_timeout:
                    print("Timeout has been reached, stopping training early", flush=True)
                    return
                if total_steps >= max_steps:
                    print("Max number of steps has been reached, stopping training early", flush=True)
                    return
            current_epoch += 1
            current_step = 0

    return train


def main(argv: list[str]) -> int:
    if argv[:1] == ["-m"]:
        as_python_m()
    if argv[:3] == ["-m", "nemo_granular", "preflight"]:
        return preflight(argv[3:])
    if len(argv) < 2 or argv[0] != "-m" or argv[1] not in MODULES:
        print(f"nemo_rl_loop_driver: usage: -m {'|'.join(MODULES)} --config CFG [overrides]", file=sys.stderr)
        return 2
    module_name, section, train_name = MODULES[argv[1]]
    cfg_arg = argv[argv.index("--config") + 1]
    overrides = {k: v for k, _, v in (a.partition("=") for a in argv if "=" in a)}
    run = Path(overrides.get("checkpointing.checkpoint_dir", "")).parent
    if str(run) != ".":
        run.mkdir(parents=True, exist_ok=True)
        (run / f"startup.{_attempt()}").write_text(f"{os.getpid()}\n")
    if _attempt() == 0:
        time.sleep(float(os.environ.get("NG_FAKE_STARTUP_SECONDS", "0")))

    import importlib

    algo = importlib.import_module(module_name)
    import nemo_rl.data.utils as data_utils

    data_utils.create_env = lambda env_name, env_config: SimpleNamespace(env_name=env_name)
    real_train = getattr(algo, train_name)
    algo.setup = _stand_in_setup(algo, section)
    setattr(algo, train_name, _stand_in_loop(algo, section, real_train))
    driver = importlib.import_module(argv[1])
    print(f"nemo_rl_loop_driver: {argv[1]} --config {cfg_arg} (setup and {train_name} stand-ins)", flush=True)
    return driver.main(argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
