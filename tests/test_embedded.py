"""The embedded trainer: real transformers models, real tokenizer, real checkpoints."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import tiny_train
from contract import ContractRecorder, check_policy_loss_call, check_value_loss_call
from nemo_granular.embedded.config import LOCAL_CONFIGS, load_train_config

ROOT = Path(__file__).resolve().parents[1]
LOCAL = LOCAL_CONFIGS  # package data: nemo_granular/configs/local
TINY = tiny_train()


def _cfg(name, tmp_path, *extra):
    return load_train_config(LOCAL / f"{name}.yaml", TINY + [f"output_dir={tmp_path}", *extra])


def _cli(*args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "nemo_granular", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=ROOT,
    )


# ---------------------------------------------------------------- configs
@pytest.mark.parametrize(
    "name", ["grpo", "gspo", "gspo_token", "sspo", "sspo_no_ec", "espo", "sppo", "sppo_small_critic", "moe", "smoke"]
)
def test_every_local_config_loads(name):
    cfg = load_train_config(LOCAL / f"{name}.yaml")
    assert cfg.loss_fn.granular.algorithm in ("grpo", "gspo", "gspo_token", "sspo", "sspo_no_ec", "espo", "sppo")
    assert cfg.rl.minibatches_per_rollout > 1  # several optimizer steps per rollout, or every ratio is 1


def test_examples_local_configs_point_at_the_packaged_ones():
    """``--config examples/configs/local/X.yaml`` (a clone) and ``--config X`` (a wheel) are the same config."""
    examples = ROOT / "examples" / "configs" / "local"
    assert sorted(p.name for p in examples.glob("*.yaml")) == sorted(p.name for p in LOCAL.glob("*.yaml"))
    for p in LOCAL.glob("*.yaml"):
        assert load_train_config(examples / p.name) == load_train_config(p) == load_train_config(p.stem)


@pytest.mark.parametrize(
    "override, field",
    [
        ("rl.minibatches_per_rollout=3", "rl.minibatches_per_rollout"),
        ("loss_fn.granular.sspo.beta=1.5", "loss_fn.granular.sspo.beta"),
        ("loss_fn.granular.algorithm=ppo2", "loss_fn.granular.algorithm"),
        ("rl.temperature=0", "rl.temperature"),
        ("model.hiden_size=3", "model.hiden_size"),
        ("grpo.adv_estimator.name=sppo", "grpo.adv_estimator.name"),
    ],
)
def test_bad_config_is_one_line_error_naming_the_field(override, field):
    with pytest.raises(ValueError) as err:
        load_train_config(LOCAL / "grpo.yaml", [override])
    msg = str(err.value)
    assert field in msg and "\n" not in msg


def test_cli_errors_are_one_line(tmp_path):
    missing = _cli(
        "train", "--config", str(LOCAL / "grpo.yaml"), f"model.path={tmp_path / 'nope'}", f"output_dir={tmp_path}"
    )
    assert missing.returncode == 2
    assert missing.stderr.strip().count("\n") == 0 and "nope" in missing.stderr
    bad = _cli("train", "--config", str(tmp_path / "absent.yaml"))
    assert bad.returncode == 2 and "absent.yaml" in bad.stderr and bad.stderr.strip().count("\n") == 0


def test_defaults_inheritance_and_overrides(tmp_path):
    (tmp_path / "parent.yaml").write_text("seed: 3\nrl:\n  steps: 7\n  lr: 0.5\n")
    (tmp_path / "child.yaml").write_text("defaults: parent.yaml\nrl:\n  steps: 9\n")
    cfg = load_train_config(tmp_path / "child.yaml", ["rl.lr=0.25", "+name=x"])
    assert (cfg.seed, cfg.rl.steps, cfg.rl.lr, cfg.name) == (3, 9, 0.25, "x")


# ---------------------------------------------------------------- parts
def test_tokenizer_has_one_blank_line_token_and_roundtrips(tmp_path):
    from nemo_granular.core.groups import build_delimiter_table
    from nemo_granular.embedded.models import build_tokenizer, load_tokenizer

    build_tokenizer(tmp_path)
    tok = load_tokenizer(str(tmp_path))  # standard HF format, reloaded
    text = "Q:1+2\n1+2=3\n\nA:3"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    table = build_delimiter_table(tok)
    assert int(table.sum()) == 1 and bool(table[tok.convert_tokens_to_ids("\n\n")])
    assert len(tok) <= 64


def test_task_verifier_and_disjoint_split():
    from nemo_granular.embedded.task import ArithmeticTask, verify

    task = ArithmeticTask(seed=1, heldout_size=64)
    held = {p.prompt for p in task.heldout}
    train = task.sample(512, torch.Generator().manual_seed(0))
    assert not held & {p.prompt for p in train}
    p = train[0]
    assert p.solution.count("\n\n") == task.num_terms - 1  # steps separated by blank lines, then the answer
    r, failed = verify([p.solution, "1+1=2\n\nA:99999", "no answer"], [p.answer] * 3)
    assert r.tolist() == [1.0, 0.0, 0.0] and failed.tolist() == [False, False, True]


def test_to_nemo_batch_layout():
    from nemo_granular.embedded.rollout import to_nemo_batch

    pad = 0
    gen = {
        "prompt_ids": torch.tensor([[0, 5, 6], [7, 8, 9]]),
        "prompt_attention": torch.tensor([[0, 1, 1], [1, 1, 1]]),
        "response_ids": torch.tensor([[11, 1, 0], [12, 13, 14]]),
        "response_len": torch.tensor([2, 3]),
        "truncated": torch.tensor([False, True]),
        "generation_logprobs": torch.tensor([[-0.1, -0.2, 0.0], [-0.3, -0.4, -0.5]]),
    }
    b = to_nemo_batch(gen, pad)
    assert b["input_ids"].tolist() == [[5, 6, 11, 1, 0, 0], [7, 8, 9, 12, 13, 14]]
    assert b["token_mask"].tolist() == [[0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 1]]
    assert torch.allclose(
        b["generation_logprobs"], torch.tensor([[0, 0, -0.1, -0.2, 0, 0], [0, 0, 0, -0.3, -0.4, -0.5]])
    )
    assert b["prompt_ids"].tolist() == [[5, 6, 0], [7, 8, 9]] and b["input_lengths"].tolist() == [4, 6]


def test_old_policy_pass_puts_token_js_logprob_and_entropy_in_column_j():
    """π_old's logprob of token j and the entropy of the distribution it was drawn from sit in column j
    (NeMo-RL's layout; column 0 holds 0), against a float64 recomputation. The stand-in model is a bigram
    table: its logits at position j depend on token j only, so a value one column off cannot match."""
    from types import SimpleNamespace

    from nemo_granular.embedded.rollout import old_policy_pass

    g = torch.Generator().manual_seed(0)
    V, temperature = 11, 0.7
    table = 2 * torch.randn(V, V, generator=g)
    ids = torch.randint(0, V, (3, 8), generator=g)
    batch = {"input_ids": ids, "input_lengths": torch.tensor([8, 5, 7])}
    old_policy_pass(
        lambda input_ids, attention_mask: SimpleNamespace(logits=table[input_ids]), batch, temperature, chunk_size=4
    )
    logp = torch.log_softmax(table.double()[ids[:, :-1]] / temperature, -1)  # position j scores token j + 1
    expect = {
        "prev_logprobs": logp.gather(-1, ids[:, 1:, None]).squeeze(-1),
        "prev_entropy": -(logp.exp() * logp).sum(-1),
    }
    for key, ref in expect.items():
        got = batch[key]
        assert got.shape == ids.shape and bool((got[:, 0] == 0).all()), key
        torch.testing.assert_close(got[:, 1:].double(), ref, rtol=0, atol=1e-5, msg=key)


# ---------------------------------------------------------------- the contract, on every call
@pytest.mark.parametrize("algorithm", ["sspo", "espo", "sppo"])
def test_trainer_calls_plugin_with_nemo_rl_contract(tmp_path, algorithm):
    from nemo_granular.embedded.trainer import Trainer

    t = Trainer(_cfg(algorithm, tmp_path, "rl.steps=2"))
    t.loss_fn = ContractRecorder(t.loss_fn, check_policy_loss_call)
    if t.critic is not None:
        t.value_loss_fn = ContractRecorder(t.value_loss_fn, check_value_loss_call)
    assert t.run() == 0
    per_rollout = (16 // 2) // 4  # rows per minibatch / micro batch size
    assert t.loss_fn.calls == 2 * 2 * per_rollout
    if t.critic is not None:
        assert t.value_loss_fn.calls == t.loss_fn.calls
    rec = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    last = rec[-1]
    # π_old comes from the same model as the sampler: train and generation logprobs agree
    assert abs(last["train/token_mult_prob_error"] - 1.0) < 1e-3
    assert last["train/nonfinite_tokens"] == 0
    for key in ("train/clip_frac_low", "train/clip_frac_high", "train/prev_entropy", "train/groups_per_response"):
        assert key in last
    # what the report needs to tell whether runs shared the CPU equally: CPU seconds and when each step ended
    steps = rec[1:]
    assert all(0 < r["timing/train/cpu_time"] for r in steps)
    ends = [r["timing/train/step_end_unix"] for r in steps]
    assert ends == sorted(ends) and ends[-1] - ends[0] >= steps[-1]["timing/train/total_step_time"] - 1e-6


def test_critic_values_are_each_rows_prompt_forwarded_alone(tmp_path):
    """SPPO's V(prompt) in the trainer: the unique prompts go through the critic once
    (``sppo.critic.unique_prompts``) and come back to every row at its first response column. The
    reference here forwards each row's prompt (the tokens before its first response token) alone, with
    no padding, and reads the scalar head. The rows (the embedded task's prompts all have one length,
    so these are drawn here): prompts of 3, 5 and 7 tokens, each repeated with other responses, and a
    prompt that is another's prefix."""
    from nemo_granular.embedded.trainer import Trainer

    t = Trainer(_cfg("sppo", tmp_path, "rl.steps=1"), log=lambda m: None)
    try:
        pad = t.tokenizer.pad_token_id
        gen = torch.Generator().manual_seed(0)
        vocab = torch.tensor([i for i in range(t.critic.config.vocab_size) if i != pad])
        prompts = [vocab[torch.randint(len(vocab), (n,), generator=gen)] for n in (3, 5, 7)]
        prompts.append(prompts[2][:4])
        rows = [0, 1, 0, 2, 3, 1, 2, 0]
        S = 12
        input_ids = torch.full((len(rows), S), pad)
        token_mask = torch.zeros(len(rows), S)
        for b, k in enumerate(rows):
            n = len(prompts[k])
            input_ids[b, :n] = prompts[k]
            length = 1 + b % 4  # responses of different lengths, then padding
            input_ids[b, n : n + length] = vocab[torch.randint(len(vocab), (length,), generator=gen)]
            token_mask[b, n : n + length] = 1
        with torch.no_grad():
            values = t.critic_values({"input_ids": input_ids, "token_mask": token_mask})
            ref = torch.stack([t.critic(input_ids=prompts[k][None]).logits[0, 0].float() for k in rows])
    finally:
        t.close()
    first = torch.tensor([len(prompts[k]) for k in rows])
    at = values.gather(1, first[:, None])[:, 0]
    torch.testing.assert_close(at, ref, rtol=0, atol=1e-7)  # measured: 7.5e-9
    assert values.abs().sum() == at.abs().sum()  # nothing written elsewhere


def test_moe_policy_trains(tmp_path):
    from nemo_granular.embedded.trainer import Trainer

    t = Trainer(_cfg("moe", tmp_path, "rl.steps=1", "model.expert_size=16", "model.num_experts=4"))
    assert type(t.policy).__name__ == "Qwen3MoeForCausalLM"
    assert t.run() == 0


# ---------------------------------------------------------------- checkpoints and resume
def _records(path):
    out = []
    for line in Path(path).read_text().splitlines():
        rec = json.loads(line)
        out.append({k: v for k, v in rec.items() if k != "wall_time" and not k.startswith("timing/")})
    return out


def test_resume_after_sigkill_is_bit_identical(tmp_path):
    args = [
        "train",
        "--config",
        str(LOCAL / "sspo.yaml"),
        *TINY,
        "rl.steps=8",
        "checkpoint.every=2",
        "checkpoint.keep=10",
    ]
    full = _cli(*args, f"output_dir={tmp_path / 'full'}")
    assert full.returncode == 0, full.stderr[-2000:]

    run = tmp_path / "killed"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "nemo_granular", *args, f"output_dir={run}"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    latest = run / "checkpoints" / "latest"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if latest.exists() and latest.read_text().strip() >= "step_000004":
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the run finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resumed = _cli(*args, f"output_dir={run}", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert re.search(r"resuming at step [4-8] of 8 from ", resumed.stderr), resumed.stderr[-2000:]
    assert _records(run / "metrics.jsonl") == _records(tmp_path / "full" / "metrics.jsonl")
    a = torch.load(tmp_path / "full" / "checkpoints" / "step_000008" / "optimizer.pt", weights_only=True)
    b = torch.load(run / "checkpoints" / "step_000008" / "optimizer.pt", weights_only=True)
    assert all(
        torch.equal(a["policy"]["state"][k]["exp_avg"], b["policy"]["state"][k]["exp_avg"])
        for k in a["policy"]["state"]
    )


def test_sigterm_checkpoints_and_exits_99_then_resumes(tmp_path):
    args = ["train", "--config", str(LOCAL / "grpo.yaml"), *TINY, "rl.steps=400", f"output_dir={tmp_path}"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "nemo_granular", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 99
    state = json.loads(
        (
            tmp_path / "checkpoints" / (tmp_path / "checkpoints" / "latest").read_text().strip() / "trainer_state.json"
        ).read_text()
    )
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert state["step"] == steps[-1] >= 2  # no step lost: the checkpoint holds the last logged step
    assert not list((tmp_path / "checkpoints").glob(".tmp_*"))  # nothing half-written left behind
    more = _cli(*args[:-2], "rl.steps=" + str(state["step"] + 1), f"output_dir={tmp_path}", "--resume")
    assert more.returncode == 0, more.stderr[-2000:]
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()][-1] == state["step"] + 1


# ---------------------------------------------------------------- a user's model directory and JSONL task
def test_local_hf_model_dir_and_jsonl_task(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from nemo_granular.embedded.models import build_tokenizer
    from nemo_granular.embedded.trainer import Trainer

    model_dir = tmp_path / "my_model"
    tok = build_tokenizer(model_dir)
    Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=64,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            intermediate_size=64,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
    ).save_pretrained(model_dir)
    data = tmp_path / "problems.jsonl"
    data.write_text(
        "".join(
            f'{{"prompt": "what is {a} plus {b}? ", "answer": "{a + b}"}}\n' for a in range(1, 6) for b in range(1, 6)
        )
    )
    cfg = load_train_config(
        LOCAL / "espo.yaml",
        TINY
        + [
            f"output_dir={tmp_path / 'run'}",
            f"model.path={model_dir}",
            "task.kind=jsonl",
            f"task.path={data}",
            r"task.answer_pattern=(\d+)",
            "rl.steps=1",
        ],
    )
    t = Trainer(cfg)
    assert t.policy.config.hidden_size == 32 and len(t.task.heldout) >= 1
    assert t.run() == 0
    rec = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert rec["step"] == 1 and rec["samples"] == 16


def test_jsonl_errors_name_the_file_and_line(tmp_path):
    from nemo_granular.embedded.task import JsonlTask

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        JsonlTask(str(bad))
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        JsonlTask(str(tmp_path / "missing.jsonl"))


def test_version_and_train_help_name_the_packaged_configs(capsys):
    from nemo_granular import __version__
    from nemo_granular.cli import main

    assert main(["--version"]) == 0 and capsys.readouterr().out.strip() == f"nemo-granular {__version__}"
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "packaged configs (--config NAME): base, espo, grpo" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize(
    "steps, every, said",
    [
        (5, 10, "checkpoint at the end)"),  # the 5-step run that announced "every 10 steps"
        (10, 10, "checkpoint at the end)"),
        (0, 10, "checkpoint at the end)"),
        (5, 0, "checkpoint at the end)"),
        (20, 10, "checkpoints every 10 steps)"),
        (25, 10, "checkpoints every 10 steps and at the end)"),
    ],
)
def test_start_line_announces_the_checkpoints_that_will_be_written(tmp_path, steps, every, said):
    from nemo_granular.embedded.trainer import Trainer

    logs = []
    Trainer(_cfg("grpo", tmp_path, f"rl.steps={steps}", f"checkpoint.every={every}"), log=logs.append).close()
    assert logs[0].endswith(f"(metrics.jsonl; {said}"), logs[0]


def test_a_warm_start_that_misses_its_target_says_so_in_one_line(tmp_path):
    """--smoke's warm start ended at 0.195 held-out accuracy (target 0.5) and nothing said so."""
    from nemo_granular.embedded.trainer import Trainer

    def warm(target, where):
        lines = []
        cfg = _cfg(
            "grpo",
            tmp_path / where,
            "warmstart.enabled=true",
            "warmstart.max_steps=2",
            "warmstart.eval_every=2",
            "warmstart.batch_size=4",
            f"warmstart.target_accuracy={target}",
            "rl.steps=0",
        )
        assert Trainer(cfg, log=lines.append, summary=lambda m: None).run() == 0
        evals = [line for line in lines if line.startswith("warm start step 2:")]
        missed = [line for line in lines if "missed its target" in line]
        return evals, missed

    evals, missed = warm(1.0, "miss")  # 2 SFT steps cannot get every held-out problem right
    acc = evals[-1].rsplit("accuracy ", 1)[1]
    assert len(missed) == 1 and "\n" not in missed[0], missed
    assert f"accuracy {acc} < warmstart.target_accuracy=1" in missed[0] and "warmstart.max_steps=2" in missed[0]
    assert warm(0.0, "hit")[1] == []  # reached (any accuracy >= 0): nothing to say


def test_ctrl_c_during_the_warm_start_keeps_its_outcome_in_the_step0_record(tmp_path):
    """A stop signal during the warm start finishes the warm start, then saves; its step-0 record (the
    warmstart/* keys, which only this process knows) used to be left unwritten, and the resumed run wrote
    one without them. Now the record is written before the checkpoint, equal to an uninterrupted run's
    but for the time it measures, and --resume writes no second one."""
    from nemo_granular.embedded.trainer import Trainer

    warm = [
        "warmstart.enabled=true",
        "warmstart.max_steps=4",
        "warmstart.eval_every=2",
        "warmstart.batch_size=4",
        "rl.steps=1",
    ]

    def records(run):
        return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]

    def untimed(rec):
        return {
            k: v for k, v in rec.items() if k not in ("wall_time", "warmstart/seconds") and not k.startswith("timing/")
        }

    def ctrl_c_mid_warm_start(line):  # a real SIGINT, to the handler the trainer installed
        if line.startswith("warm start step 2:"):
            os.kill(os.getpid(), signal.SIGINT)

    stopped = tmp_path / "stopped"
    trainer = Trainer(_cfg("grpo", stopped, *warm), log=ctrl_c_mid_warm_start, summary=lambda m: None)
    assert trainer.run() == 130
    (rec0,) = records(stopped)
    assert rec0["step"] == 0 and rec0["warmstart/steps"] == 4  # the warm start ran to its end, then saved
    assert (stopped / "checkpoints" / "step_000000").is_dir()
    reference = tmp_path / "uninterrupted"
    assert Trainer(_cfg("grpo", reference, *warm), log=lambda m: None, summary=lambda m: None).run() == 0
    assert untimed(rec0) == untimed(records(reference)[0])
    assert Trainer(_cfg("grpo", stopped, *warm), resume=True, log=lambda m: None, summary=lambda m: None).run() == 0
    assert [untimed(r) for r in records(stopped)] == [untimed(r) for r in records(reference)]


def test_start_lines_say_a_warm_start_only_and_a_resume_once(tmp_path, capsys):
    """Issue #36 item 7: a warm-start-only run (rl.steps=0, as ``compare`` starts one) does not read
    "then 0 RL steps"; a resumed run says that it resumes in one line, not "resuming" then "resumed"."""
    from nemo_granular.cli import main

    base = ["train", "--config", str(LOCAL / "grpo.yaml"), *TINY]
    warm = ["warmstart.enabled=true", "warmstart.max_steps=3", "warmstart.eval_every=3", "warmstart.batch_size=4"]
    assert main([*base, *warm, "rl.steps=0", f"output_dir={tmp_path / 'ws'}"]) == 0
    start = next(line for line in capsys.readouterr().err.splitlines() if line.startswith("train grpo"))
    assert "warm start only, no RL steps →" in start and "then 0 RL step" not in start, start

    out = f"output_dir={tmp_path / 'run'}"
    assert main([*base, "rl.steps=1", out]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", *base[1:], "rl.steps=2", out]) == 0  # one step more
    said = [line for line in capsys.readouterr().err.splitlines() if "resum" in line.lower()]
    assert len(said) == 1 and said[0].startswith("train grpo (seed 0) on cpu: resuming at step 1 of 2 from "), said
