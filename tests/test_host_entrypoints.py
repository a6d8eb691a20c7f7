"""``run_grpo`` / ``run_sppo`` driven through real NeMo-RL as far as a machine without GPUs allows.

World: NeMo-RL (``nemo_rl_src``). Each launcher's ``main`` runs in a subprocess (it installs
estimators and registers environments process-wide) on a tiny local model folder (tokenizer +
config, no weights) and a local JSONL dataset, with HF offline. Real: our config loader on the
real NeMo-RL parents, the start-up checks, NeMo-RL's ``MasterConfig``, ``get_tokenizer``,
``configure_generation_config``, the environment / worker-extension registration into NeMo-RL's
registries, ``setup_response_data`` (datasets and processors), the estimator install into
``grpo``/``ppo``, the loss construction and the policy factory. Shimmed at the boundary, in the
test only: ``init_ray`` and ``create_env`` (Ray: on a shared CI machine ``init_ray`` would attach
to whatever Ray cluster runs there) and ``setup`` itself, which is replaced by a recorder that
binds the launcher's arguments to the REAL ``setup`` signature and stops: the next thing the real
``setup`` does is build GPU clusters ("Not enough GPUs" without them).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.nemo_rl, pytest.mark.v070]

ROOT = Path(__file__).resolve().parents[1]
CFG = ROOT / "examples" / "configs"

DRIVER = r"""
import inspect, json, sys, types
module_name, launcher, configs = sys.argv[1], sys.argv[2], sys.argv[3:]
import importlib
algo = importlib.import_module(module_name)
import nemo_rl.data.utils as data_utils
import nemo_rl.distributed.virtual_cluster as vc
from nemo_rl.distributed.ray_actor_environment_registry import ACTOR_ENVIRONMENT_REGISTRY
from nemo_rl.environments.utils import ENV_REGISTRY
run = importlib.import_module(launcher)

class Reached(Exception):
    pass

facts = {}
vc.init_ray = lambda *a, **k: facts.__setitem__("init_ray", True)
data_utils.create_env = lambda env_name, env_config: facts.setdefault("envs", []).append(env_name) or \
    types.SimpleNamespace(env_name=env_name)
real_setup = algo.setup
original_factory = algo._create_advantage_estimator

def recording_setup(*args, **kwargs):
    bound = inspect.signature(real_setup).bind(*args, **kwargs)   # the real signature
    master, tokenizer, dataset, val_dataset = (bound.arguments[k] for k in list(bound.arguments)[:4])
    facts["master_type"] = type(master).__module__ + "." + type(master).__name__
    facts["train_rows"], facts["val_rows"] = len(dataset), len(val_dataset)
    facts["pad_id"] = tokenizer.pad_token_id
    facts["stop_token_ids"] = master.policy["generation"].get("stop_token_ids")
    factory = bound.arguments.get("policy_factory")
    facts["policy_factory"] = None if factory is None else getattr(factory, "__qualname__", type(factory).__name__)
    facts["estimator_patched"] = algo._create_advantage_estimator is not original_factory
    est = algo._create_advantage_estimator(master)
    facts["estimator"] = type(getattr(est, "inner", est)).__name__
    raise Reached

algo.setup = recording_setup
if hasattr(run, "build_loss"):
    real_build = run.build_loss
    def recording_build(*a, **k):
        loss = real_build(*a, **k)
        facts.setdefault("losses", []).append(type(loss).__name__ + ":" + str(getattr(loss, "vocab_size", None)))
        return loss
    run.build_loss = recording_build
import contextlib, io, os
save_every = []      # NG_SAVE_EVERY_MINUTES refused at start-up (the first config: checkpointing disabled)
for value in ("ten", "30"):
    os.environ["NG_SAVE_EVERY_MINUTES"] = value
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            rc = run.main(["--config", configs[0]])
        except Reached:
            facts.setdefault("reached", []).append(configs[0])
            rc = None
    save_every.append([rc, err.getvalue()])
    del os.environ["NG_SAVE_EVERY_MINUTES"]
facts["save_every"] = save_every
facts["save_every_reached"] = facts.pop("reached", [])   # none should have: setup() comes after the check
facts["save_every_init_ray"] = facts.pop("init_ray", False)   # nor Ray
for cfg in configs:
    try:
        rc = run.main(["--config", cfg])
        facts.setdefault("rc", []).append(rc)
    except Reached:
        facts.setdefault("reached", []).append(cfg)
facts["env_registry"] = sorted(k for k in ENV_REGISTRY if "espo" in k)
facts["actor_envs"] = sorted(k for k in ACTOR_ENVIRONMENT_REGISTRY if k.startswith("nemo_granular"))
print("FACTS " + json.dumps(facts))
"""


@pytest.fixture(scope="module")
def fixtures(nemo_rl_src, tmp_path_factory):
    """A tiny tokenizer+config model folder, a JSONL dataset, and child configs of our examples."""
    from cpu_host.models import write_word_level_model

    d = tmp_path_factory.mktemp("entry")
    words = ["what", "is", "1", "2", "3", "4", "+", "=", "answer", "\\boxed{", "}"]
    model = write_word_level_model(d / "model", words, vocab_size=40)
    rows = [{"problem": f"what is {a} + {b}", "answer": str(a + b)} for a in (1, 2) for b in (1, 2, 3)]
    data = d / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def child(parent: str, env: str, extra: str = "") -> str:
        path = d / ("child_" + Path(parent).stem + ".yaml")
        ds = f"{{dataset_name: ResponseDataset, data_path: {data}, input_key: problem, output_key: answer}}"
        path.write_text(
            f"defaults: {CFG / parent}\n"
            f"policy: {{model_name: {model}, tokenizer: {{name: {model}}}}}\n"
            "data:\n  _override_: true\n  max_input_seq_length: 64\n  shuffle: false\n  num_workers: 0\n"
            f"  use_multiple_dataloader: false\n  train: {ds}\n  validation: {ds}\n"
            f"  default: {{prompt_file: null, system_prompt_file: null, processor: math_hf_data_processor, "
            f"env_name: {env}}}\n"
            f"env: {{{env}: {{num_workers: 1}}}}\n"
            f"logger: {{log_dir: {d / 'logs'}}}\ncheckpointing: {{enabled: false, checkpoint_dir: {d / 'ckpt'}}}\n"
            + extra
        )
        return str(path)

    return {
        "sspo": child("nemo_rl/sspo_math_1B.yaml", "math"),
        "espo": child("nemo_rl/espo_math_1B.yaml", "espo_math"),
        "sppo": child("sppo_r1_distill_qwen_1.5b.yaml", "math", "value: {model_name: " + str(model) + "}\n"),
        "dir": d,
    }


def _drive(module: str, launcher: str, configs: list[str], cwd: Path) -> dict:
    import os

    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", RAY_ADDRESS="")
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, module, launcher, *configs],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=cwd,
        env=env,
    )
    facts = [ln for ln in proc.stdout.splitlines() if ln.startswith("FACTS ")]
    assert proc.returncode == 0 and facts, (proc.stdout[-3000:], proc.stderr[-5000:])
    return json.loads(facts[-1][6:])


@pytest.fixture(scope="module")
def grpo_facts(fixtures):
    return _drive(
        "nemo_rl.algorithms.grpo", "nemo_granular.run_grpo", [fixtures["sspo"], fixtures["espo"]], fixtures["dir"]
    )


@pytest.fixture(scope="module")
def sppo_facts(fixtures):
    return _drive("nemo_rl.algorithms.ppo", "nemo_granular.run_sppo", [fixtures["sppo"]], fixtures["dir"])


def test_run_grpo_reaches_real_setup(fixtures, grpo_facts):
    facts = grpo_facts
    assert "rc" not in facts, facts  # no start-up refusal / error exit
    assert facts["reached"] == [fixtures["sspo"], fixtures["espo"]]
    assert facts["master_type"] == "nemo_rl.algorithms.grpo.MasterConfig"
    assert facts["train_rows"] == facts["val_rows"] == 6
    assert facts["envs"] == ["math", "espo_math"]  # our ESPO environment, by its registered name
    assert facts["env_registry"] == ["espo_math"]
    assert facts["actor_envs"] == sorted(
        [
            "nemo_granular.nemo_rl.environments.ESPOMathEnvironment",
            "nemo_granular.nemo_rl.megatron_worker.GranularMegatronPolicyWorker",
            "nemo_granular.nemo_rl.dtensor_worker.GranularDTensorPolicyWorkerV2",
        ]
    )
    assert facts["policy_factory"] is not None and facts["estimator_patched"] is True
    assert facts["estimator"] == "ESPOEstimator"  # the last config is ESPO
    # ESPO's |V| comes from the model config (40), not len(tokenizer) (15)
    assert facts["losses"] == ["GranularPolicyLoss:40", "GranularPolicyLoss:40"]


def test_run_sppo_reaches_real_ppo_setup(fixtures, sppo_facts):
    facts = sppo_facts
    assert "rc" not in facts, facts
    assert facts["reached"] == [fixtures["sppo"]]
    assert facts["master_type"] == "nemo_rl.algorithms.ppo.MasterConfig"
    assert facts["train_rows"] == facts["val_rows"] == 6 and facts["envs"] == ["math"]
    assert facts["estimator_patched"] is True and facts["estimator"] == "SPPOEstimator"


ONE_LINE = r"""
import contextlib, importlib, io, json, sys
run = importlib.import_module(sys.argv[1])
out = []
for cfg in sys.argv[2:]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = run.main(["--config", cfg])
    out.append([rc, err.getvalue(), sorted(m for m in ("nemo_rl.algorithms.grpo", "nemo_rl.algorithms.ppo")
                                           if m in sys.modules)])
print("RESULT " + json.dumps(out))
"""


def test_missing_config_file_is_one_line_in_both_launchers(nemo_rl_src, tmp_path):
    """Issue 15.4: the same one-line answer from run_grpo and run_sppo, naming the file, for a
    missing config and for a missing NeMo-RL parent (run_grpo printed a traceback); given before
    NeMo-RL's algorithm modules are imported (tens of seconds on a CPU)."""
    orphan = tmp_path / "orphan.yaml"
    orphan.write_text("defaults: nemo_rl/upstream/no_such_base.yaml\n")
    cases = (
        (tmp_path / "absent.yaml", "absent.yaml: config file not found"),
        (
            orphan,
            "orphan.yaml: defaults entry 'nemo_rl/upstream/no_such_base.yaml': "
            "NeMo-RL has no examples/configs/no_such_base.yaml",
        ),
    )
    for launcher, prefix in (("run_grpo", "nemo_granular.run_grpo: "), ("run_sppo", "nemo_granular.run_sppo: error: ")):
        proc = subprocess.run(
            [sys.executable, "-c", ONE_LINE, f"nemo_granular.{launcher}", *(str(c) for c, _ in cases)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        result = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        assert proc.returncode == 0 and result, proc.stderr[-3000:]
        for (rc, err, imported), (_, expect) in zip(json.loads(result[0][7:]), cases):
            lines = [ln for ln in err.splitlines() if ln.strip() and not _foreign(ln)]
            assert rc == 2 and len(lines) == 1, (launcher, err)
            assert imported == [], (launcher, imported)
            assert lines[0].startswith(prefix) and expect in lines[0], lines[0]


def _foreign(line: str) -> bool:
    """Log lines NeMo-RL's own imports print on this CPU host (torchao / torch warnings)."""
    return line.startswith(("WARNING:", "W1", "I1")) or "torchao" in line or "warn" in line.lower()


def test_sync_runs_log_espo_verification_failed_frac(nemo_rl_src, tmp_path):
    """Issue 15.5: the ESPO estimator built by NeMo-RL's (patched) ``_create_advantage_estimator``
    from our config, called as ``grpo_train`` calls it, and NeMo-RL's real ``Logger`` wrapped by
    ``run_grpo``: the step's ``train`` metrics carry ``verification_failed_frac``."""
    import torch
    from nemo_rl.algorithms import grpo
    from nemo_rl.utils.logger import Logger

    from nemo_granular.nemo_rl import installed
    from nemo_granular.nemo_rl.configs import load_resolved
    from nemo_granular.nemo_rl.environments import CORRECT_CONTENT, INCORRECT_CONTENT, VERIFICATION_FAILED_CONTENT
    from nemo_granular.run_grpo import EstimatorMetricsLogger

    master = grpo.MasterConfig(**load_resolved(CFG / "nemo_rl" / "espo_math_1B.yaml"))
    seen = []

    class Backend:
        def log_metrics(self, metrics, step, prefix="", step_metric=None, step_finished=False):
            seen.append((prefix, step, dict(metrics)))

    real = Logger(
        {
            "log_dir": str(tmp_path),
            "wandb_enabled": False,
            "swanlab_enabled": False,
            "tensorboard_enabled": False,
            "mlflow_enabled": False,
            "monitor_gpus": False,
        }
    )
    real.loggers.append(Backend())
    logger = EstimatorMetricsLogger(real)
    contents = [CORRECT_CONTENT, VERIFICATION_FAILED_CONTENT, INCORRECT_CONTENT, VERIFICATION_FAILED_CONTENT]
    batch = {
        "message_log": [
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a"},
                {"role": "environment", "content": c},
            ]
            for c in contents
        ]
    }
    with installed():
        est = grpo._create_advantage_estimator(master)
        logger.log_metrics({"reward": 0.5}, 1, prefix="train")  # rollout metrics: before the estimator
        est.compute_advantage(
            prompt_ids=torch.tensor([[1], [1], [2], [2]]),
            rewards=torch.tensor([1.0, 0, 0, 0]),
            mask=torch.ones(4, 3),
            repeated_batch=batch,
        )
        logger.log_metrics({"loss": 0.1}, 1, prefix="train")  # the step's main train metrics
    train = [m for p, _, m in seen if p == "train"]
    assert train[0] == {"reward": 0.5}
    assert train[1]["loss"] == 0.1 and train[1]["verification_failed_frac"] == pytest.approx(0.5)


def test_save_every_minutes_is_checked_at_start_in_both_launchers(grpo_facts, sppo_facts):
    """NG_SAVE_EVERY_MINUTES (periodic checkpoints by wall time, docs/slurm.md): a value that is not
    a positive number of minutes, and the variable with checkpointing.enabled: false (the fixtures'
    configs), are one line and exit 2 from run_grpo and run_sppo, before Ray or setup() (run in the
    drives above, before their configs reach setup)."""
    for launcher, facts, prefix in (
        ("run_grpo", grpo_facts, "nemo_granular.run_grpo: "),
        ("run_sppo", sppo_facts, "nemo_granular.run_sppo: error: "),
    ):
        expect = (
            "NG_SAVE_EVERY_MINUTES='ten': must be a positive number of minutes",
            "NG_SAVE_EVERY_MINUTES=30 asks for periodic checkpoints, but checkpointing.enabled is false",
        )
        assert len(facts["save_every"]) == 2 and facts["save_every_reached"] == [], (launcher, facts)
        assert facts["save_every_init_ray"] is False, facts
        for (rc, err), text in zip(facts["save_every"], expect):
            lines = [ln for ln in err.splitlines() if ln.strip() and not _foreign(ln)]
            assert rc == 2 and len(lines) == 1, (launcher, err)
            assert lines[0].startswith(prefix) and text in lines[0], lines[0]
