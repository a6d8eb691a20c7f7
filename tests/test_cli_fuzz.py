"""Bad input to ``train``, ``compare`` and ``export``: one line naming the key or file, exit 2,
nothing left half-written.

A table of hand-picked cases (each run through the real CLI entry point in-process, with the
file tree snapshotted before and after) and a hypothesis search over every config key with
hostile values.
"""

from __future__ import annotations

import os
import shutil
import string
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from nemo_granular.embedded.config import LOCAL_CONFIGS, TrainConfig, load_train_config

GRPO = LOCAL_CONFIGS / "grpo.yaml"
TINY = [
    "warmstart.enabled=false",
    "model.hidden_size=32",
    "model.num_layers=1",
    "model.intermediate_size=64",
    "task.heldout_size=8",
    "rl.max_new_tokens=8",
    "logger.progress=false",
    "logger.tensorboard=false",
]


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """A finished run (for export and for 'already holds a run'), and corrupted copies of its checkpoint."""
    from nemo_granular.embedded.trainer import Trainer

    root = tmp_path_factory.mktemp("shared")
    run = root / "run"
    assert Trainer(load_train_config(GRPO, TINY + [f"output_dir={run}", "rl.steps=0"]), log=lambda m: None).run() == 0
    step = run / "checkpoints" / "step_000000"
    for name, rel, corrupt in [
        ("trunc", "policy/model.safetensors", lambda p: os.truncate(p, 1000)),
        ("badstate", "trainer_state.json", lambda p: p.write_text("{")),
        ("badconfig", "policy/config.json", lambda p: p.write_text("{")),
        ("noweights", "policy/model.safetensors", lambda p: p.unlink()),
    ]:
        shutil.copytree(step, root / name)
        corrupt(root / name / rel)
    broken = root / "brokenrun"  # a run whose only checkpoint is unusable
    shutil.copytree(run, broken)
    os.truncate(broken / "checkpoints" / "step_000000" / "optimizer.pt", 10)
    dangling = root / "dangling"
    shutil.copytree(run, dangling)
    (dangling / "checkpoints" / "latest").write_text("step_000009\n")
    shutil.rmtree(dangling / "checkpoints" / "step_000000")
    return root


def _files(tmp: Path) -> None:
    f = tmp / "f"
    f.mkdir()
    (f / "invalid.yaml").write_text("rl: [1, 2\n")
    (f / "bad_indent.yaml").write_text("rl:\n  steps: 3\n   lr: 2\n")
    (f / "empty.yaml").write_text("")
    (f / "comments.yaml").write_text("# nothing here yet\n\n")
    (f / "empty_parent.yaml").write_text("defaults: empty.yaml\nseed: 1\n")
    (f / "list.yaml").write_text("- a\n- b\n")
    (f / "scalar.yaml").write_text("5\n")
    (f / "binary.yaml").write_bytes(b"\xff\xfe\x00\x01rl:\x00")
    (f / "cyc_a.yaml").write_text("defaults: cyc_b.yaml\n")
    (f / "cyc_b.yaml").write_text("defaults: cyc_a.yaml\n")
    (f / "orphan.yaml").write_text("defaults: nowhere.yaml\n")
    (f / "bad_defaults.yaml").write_text("defaults: {a: 1}\n")
    (f / "unknown_key.yaml").write_text(f"defaults: {GRPO}\nfoo: 1\n")
    (f / "nested_unknown.yaml").write_text(f"defaults: {GRPO}\nrl:\n  stepz: 3\n")
    (f / "bad.jsonl").write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b"}\n')
    (f / "notjson.jsonl").write_text('{"prompt": "a", "answer": "1"}\nnot json\n')
    (f / "one.jsonl").write_text('{"prompt": "a", "answer": "1"}\n')
    (f / "nosolutions.jsonl").write_text('{"prompt": "a", "answer": "1"}\n' * 8)
    (f / "notmodel").mkdir()
    (f / "a_file").write_text("x")
    (f / "cmp").mkdir()
    (f / "cmp" / "report.md").write_text("# an earlier comparison\n")
    (f / "cmp_runs").mkdir()
    (f / "cmp_runs" / "runs").mkdir()
    (f / "notarun").mkdir()


# (id, argv with {f} = bad files, {s} = shared dir, {cfg} = grpo.yaml, {t} = the test's tmp dir; expected text)
T = ["train", "--config", "{cfg}", *TINY, "output_dir={t}/out"]
CASES = [
    # ---- train: the config file
    ("train: missing config file", ["train", "--config", "{f}/absent.yaml"], "absent.yaml"),
    ("train: config is a directory", ["train", "--config", "{f}/notmodel"], "{f}/notmodel: is a directory"),
    ("train: empty config file", ["train", "--config", "{f}/empty.yaml"], "empty.yaml: the config file is empty"),
    ("train: config of comments only", ["train", "--config", "{f}/comments.yaml"], "comments.yaml: the config file is"),
    ("train: empty parent config", ["train", "--config", "{f}/empty_parent.yaml"], "empty.yaml: the config file is"),
    ("train: unknown packaged name", ["train", "--config", "nosuchalgo"], "packaged configs: base, espo"),
    ("train: invalid YAML", ["train", "--config", "{f}/invalid.yaml"], "invalid.yaml:2:1: not valid YAML"),
    ("train: YAML indentation", ["train", "--config", "{f}/bad_indent.yaml"], "bad_indent.yaml:3:6: not valid YAML"),
    ("train: YAML list", ["train", "--config", "{f}/list.yaml"], "list.yaml: the top level must be a mapping"),
    ("train: YAML scalar", ["train", "--config", "{f}/scalar.yaml"], "scalar.yaml"),
    ("train: binary file", ["train", "--config", "{f}/binary.yaml"], "binary.yaml"),
    ("train: defaults cycle", ["train", "--config", "{f}/cyc_a.yaml"], "cyc_a.yaml: defaults: cycle"),
    ("train: missing parent", ["train", "--config", "{f}/orphan.yaml"], "nowhere.yaml"),
    ("train: defaults not a name", ["train", "--config", "{f}/bad_defaults.yaml"], "bad_defaults.yaml: defaults:"),
    ("train: unknown key in file", ["train", "--config", "{f}/unknown_key.yaml"], "foo"),
    ("train: unknown nested key in file", ["train", "--config", "{f}/nested_unknown.yaml"], "rl.stepz"),
    # ---- train: overrides
    ("override without =", [*T, "rl.steps"], "override 'rl.steps'"),
    ("override with empty key", [*T, "=5"], "override '=5'"),
    ("override with empty segment", [*T, "rl..steps=5"], "rl..steps"),
    (
        "override unknown key",
        [*T, "model.hiden_size=3"],
        "model.hiden_size: unknown key (did you mean model.hidden_size?)",
    ),
    ("override unknown section", [*T, "a.b.c=1"], "a: unknown key"),
    ("override adds unknown key", [*T, "+model.extra=1"], "model.extra"),
    ("delete a missing key", [*T, "~model.nothing"], "model.nothing"),
    ("override section by scalar", [*T, "rl=5"], "rl:"),
    ("override broken YAML value", [*T, "rl.steps=[1,"], "rl.steps"),
    ("steps not a number", [*T, "rl.steps=abc"], "rl.steps"),
    ("steps negative", [*T, "rl.steps=-1"], "rl.steps"),
    ("steps a list", [*T, "rl.steps=[1,2]"], "rl.steps"),
    ("seed fractional", [*T, "seed=1.5"], "seed"),
    ("threads zero", [*T, "threads=0"], "threads"),
    ("temperature zero", [*T, "rl.temperature=0"], "rl.temperature"),
    ("lr zero", [*T, "rl.lr=0"], "rl.lr"),
    ("minibatches do not divide", [*T, "rl.minibatches_per_rollout=3"], "rl.minibatches_per_rollout"),
    ("eval_every zero", [*T, "rl.eval_every=0"], "rl.eval_every"),
    ("max_new_tokens zero", [*T, "rl.max_new_tokens=0"], "rl.max_new_tokens"),
    ("unknown algorithm", [*T, "loss_fn.granular.algorithm=ppo2"], "loss_fn.granular.algorithm"),
    ("sspo beta out of range", [*T, "loss_fn.granular.sspo.beta=1.5"], "loss_fn.granular.sspo.beta"),
    ("estimator does not fit", [*T, "grpo.adv_estimator.name=sppo"], "grpo.adv_estimator.name"),
    ("unknown device", [*T, "device=tpu"], "device"),
    ("hidden not divisible by heads", [*T, "model.hidden_size=30"], "model.hidden_size"),
    ("heads not divisible by kv heads", [*T, "model.num_kv_heads=3"], "model.num_kv_heads"),
    ("intermediate size zero", [*T, "model.intermediate_size=0"], "model.intermediate_size"),
    ("experts per token > experts", [*T, "model.moe=true", "model.experts_per_token=9"], "model.experts_per_token"),
    ("critic hidden size zero", [*T, "critic.hidden_size=0"], "critic.hidden_size"),
    ("warm start batch zero", [*T, "warmstart.batch_size=0"], "warmstart.batch_size"),
    ("checkpoint keep zero", [*T, "checkpoint.keep=0"], "checkpoint.keep"),
    ("checkpoint every negative", [*T, "checkpoint.every=-1"], "checkpoint.every"),
    ("log_every negative", [*T, "logger.log_every=-1"], "logger.log_every"),
    ("wandb mode unknown", [*T, "logger.wandb_mode=maybe"], "logger.wandb_mode"),
    ("progress not a bool", [*T, "logger.progress=maybe"], "logger.progress"),
    ("task kind unknown", [*T, "task.kind=csv"], "task.kind"),
    ("task num_terms 1", [*T, "task.num_terms=1"], "task.num_terms"),
    ("task max_term 0", [*T, "task.max_term=0"], "task.max_term"),
    ("answer pattern invalid", [*T, "task.answer_pattern=("], "task.answer_pattern"),
    ("answer pattern without group", [*T, r"task.answer_pattern=\d+"], "task.answer_pattern"),
    ("jsonl without path", [*T, "task.kind=jsonl"], "task.path"),
    # ---- train: files named by the config
    ("jsonl missing", [*T, "task.kind=jsonl", "task.path={f}/missing.jsonl"], "missing.jsonl"),
    ("jsonl record without answer", [*T, "task.kind=jsonl", "task.path={f}/bad.jsonl"], "bad.jsonl:2"),
    ("jsonl line not JSON", [*T, "task.kind=jsonl", "task.path={f}/notjson.jsonl"], "notjson.jsonl:2"),
    ("jsonl one record", [*T, "task.kind=jsonl", "task.path={f}/one.jsonl"], "one.jsonl"),
    (
        "jsonl without worked solutions",
        [*T, "task.kind=jsonl", "task.path={f}/nosolutions.jsonl", "warmstart.enabled=true"],
        "warmstart.enabled",
    ),
    ("model.path missing", [*T, "model.path={f}/nomodel"], "model.path"),
    ("model.path not a model", [*T, "model.path={f}/notmodel"], "model.path"),
    ("model.init_from missing", [*T, "model.init_from={f}/nomodel"], "model.init_from"),
    # ---- train: the output directory and the flags
    ("output_dir is a file", [*T, "output_dir={f}/a_file"], "output_dir {f}/a_file: is a file, not a directory"),
    ("output_dir under a file", [*T, "output_dir={f}/a_file/run"], "output_dir {f}/a_file/run: is under"),
    ("fresh run into an existing run", ["train", "--config", "{cfg}", "output_dir={s}/run"], "already holds a run"),
    ("resume with nothing to resume", [*T, "--resume"], "nothing to resume"),
    (
        "resume from an unusable checkpoint",
        ["train", "--config", "{cfg}", "output_dir={s}/brokenrun", "--resume"],
        "optimizer.pt",
    ),
    (
        "resume with latest dangling",
        ["train", "--config", "{cfg}", "output_dir={s}/dangling", "--resume"],
        "step_000009",
    ),
    (
        "resume with another algorithm",
        ["train", "--config", "sspo", "output_dir={s}/run", "--resume"],
        "algorithm='grpo'",
    ),
    ("resume and force", [*T, "--resume", "--force"], "--force: not allowed with argument --resume"),
    ("resume and auto-resume", [*T, "--resume", "--auto-resume"], "not allowed with"),
    ("unknown option", [*T, "--resum"], "unrecognized arguments: --resum"),
    ("missing --config", ["train"], "--config"),
    # ---- compare
    ("compare: empty algorithms", ["compare", "--algorithms", "", "--out", "{t}/c"], "--algorithms is empty"),
    ("compare: only commas", ["compare", "--algorithms", " , ,", "--out", "{t}/c"], "valid: espo, grpo"),
    ("compare: unknown algorithm", ["compare", "--algorithms", "grpo,nope", "--out", "{t}/c"], "unknown 'nope'"),
    ("compare: base is no algorithm", ["compare", "--algorithms", "base", "--out", "{t}/c"], "unknown 'base'"),
    ("compare: seeds 0", ["compare", "--algorithms", "grpo", "--seeds", "0", "--out", "{t}/c"], "--seeds"),
    ("compare: seeds not int", ["compare", "--seeds", "two", "--out", "{t}/c"], "--seeds"),
    ("compare: jobs 0", ["compare", "--algorithms", "grpo", "--jobs", "0", "--out", "{t}/c"], "--jobs"),
    ("compare: steps negative", ["compare", "--algorithms", "grpo", "--steps", "-1", "--out", "{t}/c"], "--steps"),
    ("compare: steps 0", ["compare", "--algorithms", "grpo", "--steps", "0", "--out", "{t}/c"], "--steps must be >= 1"),
    (
        "compare: rl.steps=0",
        ["compare", "--algorithms", "grpo,sspo", "--out", "{t}/c", "rl.steps=0"],
        "grpo: rl.steps=0: a comparison needs at least 1 RL step",
    ),
    ("compare: config dir missing", ["compare", "--config-dir", "{f}/nodir", "--out", "{t}/c"], "nodir"),
    (
        "compare: bad override",
        ["compare", "--algorithms", "grpo", "--out", "{t}/c", "rl.temperature=0"],
        "grpo: rl.temperature",
    ),
    (
        "compare: unknown key",
        ["compare", "--algorithms", "sspo", "--out", "{t}/c", "rl.stepz=3"],
        "rl.stepz: unknown key (did you mean rl.steps?)",
    ),
    ("unknown key: a section's key at the top", [*T, "lr=0.1"], "lr: unknown key (did you mean rl.lr"),
    (
        "compare: out is a file",
        ["compare", "--algorithms", "grpo", "--out", "{f}/a_file"],
        "--out {f}/a_file: is a file, not a directory",
    ),
    (
        "compare: out holds a report",
        ["compare", "--algorithms", "grpo", "--out", "{f}/cmp"],
        "already holds a comparison",
    ),
    (
        "compare: out holds runs",
        ["compare", "--algorithms", "grpo", "--out", "{f}/cmp_runs"],
        "already holds a comparison",
    ),
    (
        "compare: resume with nothing",
        ["compare", "--algorithms", "grpo", "--out", "{t}/c", "--resume"],
        "nothing to resume",
    ),
    ("compare: force and resume", ["compare", "--force", "--resume"], "not allowed with"),
    ("compare: from-runs not a run", ["compare", "--from-runs", "{f}/notarun", "--out", "{t}/c"], "notarun"),
    ("compare: from-runs missing", ["compare", "--from-runs", "{f}/gone", "--out", "{t}/c"], "gone"),
    (
        "compare: from-runs over a report",
        ["compare", "--from-runs", "{s}/run", "--out", "{f}/cmp"],
        "already holds a report.md",
    ),
    (
        "compare: an empty name among others",
        ["compare", "--algorithms", "grpo,,sspo", "--out", "{t}/c"],
        "--algorithms: a name is empty",
    ),
    (
        "compare: a trailing comma",
        ["compare", "--algorithms", "grpo,", "--out", "{t}/c"],
        "--algorithms: a name is empty",
    ),
    (
        "compare: from-runs with algorithms",
        ["compare", "--from-runs", "{s}/run", "--algorithms", "grpo", "--out", "{t}/c"],
        "--algorithms: not with --from-runs",
    ),
    (
        "compare: from-runs with seeds and smoke",
        ["compare", "--smoke", "--seeds", "2", "--from-runs", "{s}/run", "--out", "{t}/c"],
        "--seeds, --smoke: not with --from-runs",
    ),
    # ---- eval-checkpoints
    (
        "eval-checkpoints: a step without a checkpoint",
        ["eval-checkpoints", "{s}/run", "--steps", "55"],
        "--steps: {s}/run has no checkpoint of step 55 (its checkpoints: 0)",
    ),
    ("eval-checkpoints: an empty step", ["eval-checkpoints", "{s}/run", "--steps", "0,,5"], "--steps: expected"),
    ("eval-checkpoints: a negative step", ["eval-checkpoints", "{s}/run", "--steps=-5"], "--steps: expected"),
    # ---- export
    ("export: source missing", ["export", "{f}/gone", "{t}/e"], "gone"),
    ("export: source a file", ["export", "{f}/a_file", "{t}/e"], "a_file"),
    ("export: not a checkpoint", ["export", "{f}/notmodel", "{t}/e"], "notmodel"),
    ("export: output exists", ["export", "{s}/run", "{f}/a_file"], "a_file"),
    ("export: truncated weights", ["export", "{s}/trunc", "{t}/e"], "model.safetensors"),
    ("export: missing weights", ["export", "{s}/noweights", "{t}/e"], "noweights"),
    ("export: broken trainer_state", ["export", "{s}/badstate", "{t}/e"], "trainer_state.json"),
    ("export: broken model config", ["export", "{s}/badconfig", "{t}/e"], "config.json"),
    ("export: dangling latest", ["export", "{s}/dangling", "{t}/e"], "step_000009"),
    ("export: no critic", ["export", "{s}/run", "{t}/e", "--what", "critic"], "critic"),
    ("export: wrong source kind", ["export", "{s}/run", "{t}/e", "--source", "dcp"], "weights"),
    ("export: bad dtype", ["export", "{s}/run", "{t}/e", "--dtype", "int8"], "--dtype"),
    ("export: bad shard size", ["export", "{s}/run", "{t}/e", "--max-shard-size", "lots"], "--max-shard-size"),
    ("export: zero shard size", ["export", "{s}/run", "{t}/e", "--max-shard-size", "0"], "--max-shard-size"),
    ("export: missing output", ["export", "{s}/run"], "out"),
    # ---- the command itself
    ("unknown command", ["trian"], "unknown command 'trian'"),
]


def _snapshot(*roots: Path) -> dict:
    return {
        str(p): (p.is_dir(), None if p.is_dir() else (p.stat().st_size, p.stat().st_mtime_ns))
        for root in roots
        for p in sorted(root.rglob("*"))
    }


def _main(argv):
    from nemo_granular.cli import main

    try:
        return main(argv)
    except SystemExit as exc:  # argparse's own exit
        return exc.code


def test_no_command_is_a_usage_error(capsys):
    from nemo_granular.cli import COMMANDS

    assert _main([]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("usage: nemo-granular {")
    assert all(name in err for name in COMMANDS) and err.strip().splitlines()[-1].startswith("nemo-granular: error:")
    assert _main(["--help"]) == 0  # asked for: stdout, exit 0
    out, err = capsys.readouterr()
    assert out.startswith("usage: nemo-granular {") and err == ""


def test_every_compare_option_has_help(monkeypatch):
    """Every argument of ``compare`` says what it is in --help (``--out`` said nothing)."""
    import nemo_granular.compare as C

    seen = []

    def parse_args(self, argv=None):
        seen.append(self)
        raise SystemExit(0)

    monkeypatch.setattr(C.ArgumentParser, "parse_args", parse_args)
    assert _main(["compare"]) == 0
    bare = [a.dest for a in seen[0]._actions if not a.help]
    assert not bare, bare
    out = next(a for a in seen[0]._actions if a.dest == "out")
    assert "report.md" in out.help and "--resume" in out.help, out.help


def test_the_table_is_large_enough():
    assert len(CASES) >= 50 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("argv, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(shared, tmp_path, monkeypatch, capsys, argv, expected):
    _files(tmp_path)
    monkeypatch.chdir(tmp_path)  # relative defaults (outputs/...) land here, inside the snapshot
    subst = {"{f}": str(tmp_path / "f"), "{s}": str(shared), "{cfg}": str(GRPO), "{t}": str(tmp_path)}
    args = []
    for a in argv:
        for k, v in subst.items():
            a = a.replace(k, v)
        args.append(a)
    before = _snapshot(tmp_path, shared)
    rc = _main(args)
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, (rc, err)
    assert len(lines) == 1, err
    assert lines[0].startswith(f"nemo-granular {args[0]}: error: ") or lines[0].startswith("nemo-granular: error: ")
    assert expected.replace("{f}", str(tmp_path / "f")).replace("{s}", str(shared)) in lines[0], lines[0]
    assert out == ""
    assert _snapshot(tmp_path, shared) == before  # nothing created, changed or half-written


# ---------------------------------------------------------------- every config key, hostile values
def _leaves(model, prefix=""):
    from pydantic import BaseModel

    keys = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys += _leaves(ann, f"{prefix}{name}.")
        else:
            keys.append(prefix + name)
    return keys


KEYS = _leaves(TrainConfig) + ["model", "rl", "loss_fn.granular", "nope", "rl.nope", "loss_fn.granular.sspo.nope"]
VALUES = st.one_of(
    st.integers(-(10**6), 10**6).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(alphabet=string.printable.replace("\n", "").replace("\r", ""), max_size=12),
    st.sampled_from(
        [
            "",
            "null",
            "~",
            "true",
            "[1, 2]",
            "[",
            "{a: 1}",
            "{",
            "${nope}",
            "${oc.env:NOPE}",
            "???",
            "'",
            '"',
            "1e400",
            "-0",
            "0x10",
            ".inf",
            ".nan",
            "[[]]",
            "{}",
            "[]",
            "a=b",
            "=",
            "\\",
        ]
    ),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.sampled_from(KEYS), value=VALUES, prefix=st.sampled_from(["", "+", "++"]))
@example(key="model", value="[[]]", prefix="")  # a list over a section: omegaconf's ConfigTypeError, found by CI
def test_any_override_is_valid_or_one_line_naming_the_key(key, value, prefix):
    item = f"{prefix}{key}={value}"
    try:
        load_train_config(GRPO, [item])
    except (ValueError, FileNotFoundError) as err:
        msg = str(err)
        assert msg and "\n" not in msg, repr(msg)
        assert key in msg or key.split(".")[-1] in msg or item in msg, (item, msg)
