"""``nemo-granular preflight``: the command, the plan's numbers, the worker-venv step, the pieces.

World: NeMo-RL (``nemo_rl_src``) except the first test, which checks the one-line refusal in the
world without NeMo-RL. tests/test_preflight_nemo_rl.py compares every check with NeMo-RL itself.

The venv build runs NeMo-RL's own ``nemo_rl.utils.venvs.create_local_venv`` with a recording ``uv``
on ``PATH`` (a test-side stand-in: the real ``uv`` would download NeMo-RL's extras): the test
proves the exact commands the build runs equal the ones preflight prints, and that the venvs are
then found where NeMo-RL looks for them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import env_without_nemo_rl

pytestmark = pytest.mark.v070

ROOT = Path(__file__).resolve().parents[1]
CFG = ROOT / "examples" / "configs"
FIXTURE = ROOT / "tests" / "harness" / "preflight_fixtures" / "espo_qwen3_30b_a3b_before_defer_fix.yaml"
MOE = CFG / "espo_qwen3_30b_a3b_megatron.yaml"
MATH_1_5B = CFG / "sspo_qwen2.5_math_1.5b.yaml"
SPPO_7B = CFG / "sppo_r1_distill_qwen_7b.yaml"
GB = 1e9
# Hugging Face configs of the shipped models' architectures (public config.json values), as local folders
QWEN3_30B_A3B = dict(
    model_type="qwen3_moe",
    architectures=["Qwen3MoeForCausalLM"],
    vocab_size=151936,
    hidden_size=2048,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    tie_word_embeddings=False,
    max_position_embeddings=32768,
)
QWEN25_MATH_1_5B = dict(
    model_type="qwen2",
    architectures=["Qwen2ForCausalLM"],
    vocab_size=151936,
    hidden_size=1536,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    intermediate_size=8960,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
)
R1_DISTILL_7B = dict(
    model_type="qwen2",
    architectures=["Qwen2ForCausalLM"],
    vocab_size=152064,
    hidden_size=3584,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    intermediate_size=18944,
    tie_word_embeddings=False,
    max_position_embeddings=131072,
)


def model_dir(tmp_path: Path, name: str, config: dict) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return d


@pytest.fixture(autouse=True)
def _env(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    monkeypatch.setenv("NEMO_RL_VENV_DIR", str(tmp_path / "venvs"))


def run_main(capsys, *argv) -> tuple[int, str, list[str]]:
    from nemo_granular.cli import main

    rc = main(["preflight", *map(str, argv)])
    out = capsys.readouterr()
    return rc, out.out, [line for line in out.err.splitlines() if line.strip()]


# ----------------------------------------------------------------------------- the command ---


def test_without_nemo_rl_preflight_says_so_in_one_line_and_exits_2():
    proc = subprocess.run(
        [sys.executable, "-m", "nemo_granular", "preflight", str(MOE)],
        capture_output=True,
        text=True,
        env=env_without_nemo_rl(),
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("nemo-granular preflight: NeMo-RL is not importable here"), lines


@pytest.mark.nemo_rl
def test_module_entry_point_is_the_slurm_interface(nemo_rl_src, tmp_path):
    """``python -m nemo_granular preflight CONFIG [overrides]``: 1 and one line per problem on stderr
    for the pre-fix config, the JSON plan on stdout with --json."""
    env = dict(os.environ, NEMO_RL_VENV_DIR=str(tmp_path / "venvs"), HF_HUB_OFFLINE="1", TORCH_CUDA_ARCH_LIST="9.0")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "nemo_granular",
            "preflight",
            str(FIXTURE),
            "cluster.num_nodes=16",
            "--json",
            "--no-venv-check",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    assert doc["ok"] is False and doc["driver"] == "grpo"
    assert doc["plan"]["layout"]["nodes"] == 16 and doc["plan"]["policy_parallel"]["dp"] == 8  # 128 GPUs / 16
    errs = [f for f in doc["findings"] if f["level"] == "error"]
    assert [f["source"] for f in errs] == ["nemo_rl/models/megatron/setup.py:_validate_chunking_config"]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("preflight: error:")]
    assert len(lines) == 1 and "defer_fp32_logits" in lines[0]


@pytest.mark.nemo_rl
def test_clean_config_exits_0_and_prints_the_plan(nemo_rl_src, capsys):
    rc, out, err = run_main(capsys, MOE, "--no-venv-check")
    assert rc == 0, err
    assert "cluster   8 node(s) × 8 GPUs, colocated" in out
    assert "policy    megatron: TP 4 · PP 2 · CP 2 · EP 8 (ETP 1) · DP 4" in out
    assert "vLLM      TP 4 · PP 1 · EP 4 (DP 1 inside an engine) · 16 engine(s)" in out
    assert "batches   policy: 1024 rows per step, global batch 256 → 4 optimizer step(s) per rollout" in out
    assert "recipes/llm/grpo-qwen3-30ba3b-8n8g-megatron-cp2-r3.yaml" in out
    assert "policy.megatron_cfg.expert_model_parallel_size: 4 → 8" in out
    assert "result    ok" in out
    ours = [line for line in err if line.startswith("preflight:")]
    assert ours and all(line.startswith("preflight: warning:") for line in ours), ours  # the model is not cached


@pytest.mark.nemo_rl
def test_bad_input_is_one_line_and_exit_2(nemo_rl_src, capsys, tmp_path):
    rc, _, err = run_main(capsys, tmp_path / "missing.yaml")
    assert rc == 2 and len(err) == 1 and "config file not found" in err[0]
    rc, _, err = run_main(capsys, MOE, "not_an_override")
    assert rc == 2 and len(err) == 1 and "override" in err[0].lower()
    rc, _, err = run_main(capsys, MOE, "--vocab-size", "0")
    assert rc == 2 and len(err) == 1 and "--vocab-size" in err[0]
    rc, _, err = run_main(capsys)
    assert rc == 2 and len(err) == 1 and "give the config file" in err[0]


@pytest.mark.nemo_rl
def test_strict_turns_warnings_into_failures(nemo_rl_src, capsys, monkeypatch):
    # TORCH_CUDA_ARCH_LIST unset is a warning only on the submit host of a CONTAINER job (the image's
    # value wins); elsewhere it is an error (tests/test_launch_checks.py)
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    monkeypatch.setenv("CONTAINER", "nemo-rl.sqsh")
    rc, out, err = run_main(capsys, MOE, "--no-venv-check", "--vocab-size", "151936")
    assert rc == 0 and any("TORCH_CUDA_ARCH_LIST is not set" in line for line in err)
    rc, out, err = run_main(capsys, MOE, "--no-venv-check", "--vocab-size", "151936", "--strict")
    assert rc == 1 and "FAILED" in out


@pytest.mark.nemo_rl
def test_config_option_form_and_driver_rule(nemo_rl_src, capsys):
    from nemo_granular.preflight.run import driver_for

    assert driver_for("x/sppo_r1_distill_qwen_7b.yaml") == "sppo" and driver_for("a/espo_math_1B.yaml") == "grpo"
    assert driver_for("a/espo.yaml", "sppo") == "sppo"
    with pytest.raises(ValueError, match="--driver"):
        driver_for("a.yaml", "ppo")
    rc, out, _ = run_main(capsys, "--config", SPPO_7B, "ppo.num_prompts_per_step=256", "--no-venv-check")
    assert rc == 0 and "(driver: run_sppo)" in out and "batches   policy: 256 rows per step" in out
    rc, out, _ = run_main(
        capsys, SPPO_7B, "--no-venv-check", "ppo.num_prompts_per_step=128", "--driver", "sppo", "cluster.num_nodes=2"
    )  # options between the overrides
    assert rc == 0 and "batches   policy: 128 rows per step" in out and "cluster   2 node(s)" in out
    assert "critic    dtensor_v2" in out


# ---------------------------------------------------------------------------- the plan's numbers ---


@pytest.mark.nemo_rl
def test_logits_memory_matches_docs_scaling(nemo_rl_src, tmp_path):
    """docs/scaling.md §1: Qwen3-30B-A3B at TP 4 / CP 2 / chunk 2048 needs 0.62 GB for the logprob
    pass and 0.93 GB at the training peak; Qwen2.5-Math-1.5B at TP 1 / chunk 1024, 3.7 GB."""
    from nemo_granular.preflight.run import run_preflight

    moe = model_dir(tmp_path, "qwen3-30b-a3b", QWEN3_30B_A3B)
    res = run_preflight(MOE, [f"policy.model_name={moe}"], check_venvs=False)
    assert not [f for f in res.findings if f.level == "error"], [f.line() for f in res.findings]
    m = res.plan["logits_memory"]
    assert (m["tokens_per_gpu"], m["vocab_per_gpu"], m["chunk"]) == (4096, 37984, 2048)
    assert m["logprob_pass_bytes"] == 4096 * 37984 * 2 + 2048 * 37984 * 4
    assert round(m["logprob_pass_bytes"] / GB, 2) == 0.62 and round(m["train_bytes"] / GB, 2) == 0.93
    assert abs(res.plan["model"]["parameters"] / 1e9 - 30.5) < 0.05  # scaling.md §2: ≈ 30.5 B
    small = model_dir(tmp_path, "qwen2.5-math-1.5b", QWEN25_MATH_1_5B)
    res = run_preflight(MATH_1_5B, [f"policy.model_name={small}"], check_venvs=False)
    assert round(res.plan["logits_memory"]["train_bytes"] / GB, 1) == 3.7
    assert abs(res.plan["model"]["parameters"] / 1e9 - 1.54) < 0.02  # scaling.md §1: 1.54 B


@pytest.mark.nemo_rl
def test_model_architecture_findings(nemo_rl_src, tmp_path):
    from nemo_granular.preflight.run import run_preflight

    moe = model_dir(tmp_path, "qwen3-30b-a3b", QWEN3_30B_A3B)
    res = run_preflight(
        MOE,
        [
            f"policy.model_name={moe}",
            "policy.megatron_cfg.expert_model_parallel_size=6",
            "policy.megatron_cfg.pipeline_model_parallel_size=5",
            "policy.megatron_cfg.tensor_model_parallel_size=1",
            "policy.megatron_cfg.context_parallel_size=1",
            "cluster.num_nodes=5",
        ],
        check_venvs=False,
    )
    srcs = {f.source for f in res.findings if f.level == "error"}
    assert "megatron/core/transformer/moe/moe_layer.py:BaseMoELayer.__init__" in srcs  # 128 % 6
    assert "megatron/core/transformer/transformer_block.py:get_num_layers_to_build" in srcs  # 48 % 5
    assert "megatron/core/parallel_state.py:initialize_model_parallel" in srcs  # 40 % (6 * 5)


@pytest.mark.nemo_rl
def test_critic_memory_for_sppo(nemo_rl_src, tmp_path):
    from nemo_granular.preflight.run import run_preflight

    d = model_dir(tmp_path, "r1-distill-7b", R1_DISTILL_7B)
    res = run_preflight(SPPO_7B, [f"policy.model_name={d}"], check_venvs=False)
    crit = res.plan["critic_memory"]
    assert 7.0e9 < crit["params"] < 7.2e9 and crit["offloaded"] is False  # the value head, not the LM head
    assert crit["bytes_per_gpu"] == -(-16 * crit["params"] // 4)  # fp32 + grads + Adam over 4 GPUs
    res = run_preflight(SPPO_7B, [f"policy.model_name={d}", "value.dtensor_cfg.cpu_offload=true"], check_venvs=False)
    assert res.plan["critic_memory"]["bytes_per_gpu"] == 0 and res.plan["critic_memory"]["offloaded"]


@pytest.mark.nemo_rl
def test_recipe_diff_lists_overrides_against_the_nemo_rl_parent(nemo_rl_src):
    from nemo_granular.nemo_rl.configs import load_resolved
    from nemo_granular.preflight.recipe import recipe_diff, reference_recipe

    assert reference_recipe(MATH_1_5B).name == "grpo_math_1B_megatron.yaml"
    assert reference_recipe(CFG / "sppo_r1_distill_qwen_7b_small_critic.yaml").name == "ppo_math_1B.yaml"
    cfg = load_resolved(MATH_1_5B, ["grpo.num_prompts_per_step=96"])
    diff = recipe_diff(MATH_1_5B, cfg)
    assert diff.reference == "examples/configs/grpo_math_1B_megatron.yaml"
    assert ("grpo.num_prompts_per_step", 32, 96) in diff.changed
    assert ("loss_fn.granular.algorithm", "sspo") in diff.added


@pytest.mark.nemo_rl
def test_layout_rules(nemo_rl_src):
    from nemo_granular.preflight.layout import cluster_layout

    def cfg(nodes, gpn, colocated=True, res=None, env=None):
        gen = {"backend": "vllm", "colocated": {"enabled": colocated, "resources": res or {}}}
        data = {"default": {"env_name": env or "math"}}
        return {
            "cluster": {"num_nodes": nodes, "gpus_per_node": gpn},
            "policy": {"generation": gen},
            "data": data,
            "env": {"reward_model": {"resources": {"num_nodes": 1, "gpus_per_node": 2}}},
        }

    lay, found = cluster_layout(cfg(2, 8), "grpo")
    assert not found and (lay.train_world, lay.inference_world) == (16, 16)
    lay, found = cluster_layout(cfg(1, 8, env="reward_model"), "grpo")  # the reward model takes 2 GPUs
    assert lay.train_world == 6
    lay, found = cluster_layout(cfg(3, 8, False, {"num_nodes": 1, "gpus_per_node": 8}), "grpo")
    assert (lay.train_world, lay.inference_world) == (16, 8)
    lay, found = cluster_layout(cfg(1, 8, False, {"num_nodes": None, "gpus_per_node": 2}), "grpo")
    assert (lay.train_world, lay.inference_world) == (6, 2)
    for bad in (
        cfg(0, 8),
        cfg(2, 8, False, {"num_nodes": 2, "gpus_per_node": 8}),
        cfg(1, 8, False, {"num_nodes": 2, "gpus_per_node": 2}),
    ):
        lay, found = cluster_layout(bad, "grpo")
        assert lay is None and len(found) == 1 and found[0].level == "error"
    bad = cfg(2, 8, False, {"num_nodes": 1, "gpus_per_node": 8})
    bad["policy"]["generation"]["backend"] = "sglang"
    assert cluster_layout(bad, "ppo")[0] is None and cluster_layout(bad, "grpo")[0] is not None


@pytest.mark.nemo_rl
def test_worker_rules_without_a_drive(nemo_rl_src):
    """Restated rules whose NeMo-RL place no CPU drive reaches (source guards in test_preflight_nemo_rl.py)."""
    from nemo_granular.preflight.worker_checks import automodel_worker_checks, megatron_worker_checks

    dt = {
        "precision": "bfloat16",
        "dtensor_cfg": {"enabled": True, "_v2": True, "cpu_offload": True},
        "sequence_packing": {"enabled": False},
    }
    assert [f.source for f in automodel_worker_checks("value", dt, 1)] == [
        "nemo_rl/models/automodel/setup.py:setup_distributed"
    ]
    assert automodel_worker_checks("value", dt, 4) == []
    yarn = {**dt, "hf_config_overrides": {"rope_scaling": {"rope_type": "yarn"}}}
    assert any("YaRN" in f.message for f in automodel_worker_checks("policy", yarn, 4))
    meg = {
        "megatron_cfg": {"enabled": True, "optimizer": {}},
        "generation": {"backend": "megatron"},
        "router_replay": {"enabled": True},
        "reward_model_cfg": {"enabled": True},
        "hf_config_overrides": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
    }
    msgs = " | ".join(f.message for f in megatron_worker_checks(meg))
    assert "needs vLLM generation" in msgs and "reward models are not supported" in msgs and "yarn" in msgs


# --------------------------------------------------------------------------------- worker venvs ---

FAKE_UV = """#!/usr/bin/env python3
import json, os, sys
with open(os.environ["FAKE_UV_LOG"], "a") as log:
    log.write(json.dumps({"argv": sys.argv[1:], "env": os.environ.get("UV_PROJECT_ENVIRONMENT")}) + "\\n")
if sys.argv[1:3] == ["venv", "--allow-existing"]:
    os.makedirs(os.path.join(sys.argv[3], "bin"), exist_ok=True)
    open(os.path.join(sys.argv[3], "bin", "python"), "w").close()
"""


@pytest.mark.nemo_rl
def test_venv_plan_names_classes_extras_and_paths(nemo_rl_src, tmp_path):
    from nemo_granular.nemo_rl.configs import load_resolved
    from nemo_granular.preflight import venvs

    plan = venvs.venv_plan(venvs.needed_actors(load_resolved(MOE), "grpo"))
    got = {e.role: (e.fqn, e.extra, e.path, e.built) for e in plan}
    base = str(tmp_path / "venvs")
    ext = "nemo_granular.nemo_rl.megatron_worker.GranularMegatronPolicyWorker"
    assert got["policy (nemo-granular worker extension)"] == (ext, "mcore", f"{base}/{ext}", False)
    gen = "nemo_rl.models.generation.vllm.vllm_worker.VllmGenerationWorker"
    assert got["generation"] == (gen, "vllm", f"{base}/{gen}", False)
    assert got["environment espo_math"][2] is None  # system Python, no venv
    sppo = {e.role: e for e in venvs.venv_plan(venvs.needed_actors(load_resolved(SPPO_7B), "sppo"))}
    assert sppo["policy"].fqn.endswith("DTensorPolicyWorkerV2") and sppo["policy"].extra == "automodel"
    assert sppo["critic"].fqn.endswith("DTensorValueWorkerV2")
    cur = {
        e.role: e
        for e in venvs.venv_plan(
            venvs.needed_actors(load_resolved(MOE, ["nemo_granular.entropy_source=current_logits"]), "grpo")
        )
    }
    assert cur["policy"].fqn.endswith("megatron_policy_worker.MegatronPolicyWorker")  # the stock worker then


@pytest.mark.nemo_rl
def test_build_venvs_runs_nemo_rls_builder_and_preflight_finds_them(nemo_rl_src, tmp_path, monkeypatch, capsys):
    from nemo_granular.nemo_rl.configs import load_resolved
    from nemo_granular.preflight import venvs

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "uv").write_text(FAKE_UV)
    (bin_dir / "uv").chmod(0o755)
    log = tmp_path / "uv.log"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_UV_LOG", str(log))
    rc, out, err = run_main(capsys, MOE, "--vocab-size", "151936")
    assert rc == 0 and "MISSING" in out and sum("worker venv missing" in line for line in err) == 2
    missing = [e for e in venvs.venv_plan(venvs.needed_actors(load_resolved(MOE), "grpo")) if e.needs_venv]
    rc, out, err = run_main(capsys, MOE, "--vocab-size", "151936", "--build-venvs")
    assert rc == 0 and "MISSING" not in out and not any("worker venv missing" in line for line in err)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    root = venvs.nemo_rl_root()
    for entry in missing:  # the commands NeMo-RL's create_local_venv ran = the ones preflight prints
        ran = [
            (f"UV_PROJECT_ENVIRONMENT={c['env']} " if c["env"] == entry.path else "")
            + "uv "
            + " ".join(c["argv"]).replace(
                "Finished creating venv " + entry.path, f"'Finished creating venv {entry.path}'"
            )
            for c in calls
            if entry.path in (c["env"], *c["argv"])
        ]
        assert ran == venvs.build_commands(entry, root), (ran, venvs.build_commands(entry, root))
        assert (Path(entry.path) / "bin" / "python").exists()
        assert f"nemo-granular preflight: $ {venvs.build_commands(entry, root)[1]}" in err
    # NeMo-RL's own switch rebuilds the built ones, with the same commands
    monkeypatch.setenv("NRL_FORCE_REBUILD_VENVS", "true")
    before = len(log.read_text().splitlines())
    rc, out, err = run_main(capsys, MOE, "--vocab-size", "151936", "--build-venvs")
    assert rc == 0 and len(log.read_text().splitlines()) == before + 3 * len(missing)


def test_missing_submodule_sources(tmp_path):
    from nemo_granular.preflight.venvs import missing_sources

    root = tmp_path / "nemo-rl"
    (root / "3rdparty" / "Bridge" / "3rdparty").mkdir(parents=True)
    (root / "pyproject.toml").write_text(
        '[tool.uv.sources]\nbridge = { path = "3rdparty/Bridge", editable = true }\n'
        'other = [{ index = "x" }]\n[tool.uv.workspace]\nmembers = ["3rdparty/Gym"]\n'
    )
    (root / "3rdparty" / "Bridge" / "pyproject.toml").write_text(
        '[tool.uv.sources]\nmegatron-core = { path = "3rdparty/Megatron-LM/", editable = true }\n'
    )
    assert missing_sources(str(root)) == ["3rdparty/Bridge/3rdparty/Megatron-LM", "3rdparty/Gym"]
    (root / "3rdparty" / "Gym").mkdir()
    (root / "3rdparty" / "Gym" / "pyproject.toml").write_text("[project]\nname='gym'\n")
    (root / "3rdparty" / "Bridge" / "3rdparty" / "Megatron-LM").mkdir()
    (root / "3rdparty" / "Bridge" / "3rdparty" / "Megatron-LM" / "pyproject.toml").write_text("")
    assert missing_sources(str(root)) == []
