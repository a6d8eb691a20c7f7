"""Each paper config in examples/configs/, loaded the way NeMo-RL loads it, against the values of
the paper / the official scripts.

The configs inherit NeMo-RL's example configs (``defaults: nemo_rl/upstream/...``), so the
values that matter are the MERGED ones: a key the file does not set comes from NeMo-RL's base
(``ppo.max_val_samples: 256`` was such a key and cut the validation set). The test copies the
configs next to a link ``nemo_rl/upstream`` -> ``$NEMO_RL_SRC/examples/configs`` and loads them
with NeMo-RL's own ``nemo_rl.utils.config.load_config`` (the loader ``run_grpo`` / ``run_sppo``
use), then resolves the interpolations with NeMo-RL's resolvers.

The tables below are the sources' values, written out by hand from
* SPPO (arXiv:2604.08865, Appendix E) and its official verl scripts
  (``run_scripts/run_ds1.5B_PPO_SEQUENCE_shuffle.sh``, ``run_R1-7B_DAPO_SEQUENCE.sh``,
  ``run_R1-7B_DAPO_SEQUENCE_small_critic.sh`` and verl's actor defaults in that repository:
  ``clip_ratio 0.2``, ``clip_ratio_c 3.0``, ``loss_agg_mode token-mean``, ``entropy_coeff 0``);
* GSPO (arXiv:2507.18071): ε = 3e-4 / 4e-4 on the length-normalised sequence ratio,
  sequence-mean aggregation;
* SSPO (arXiv:2511.04256) §6.1 and ESPO (arXiv:2512.00499) as summarised in
  docs/algorithms/math.md (SSPO 1.5B α = 0, β = 0.8, γ = 1.75; 7B α = 0.15 — the row of the
  reported result; ESPO α by the calibration rule of docs/algorithms/espo.md).
Where a config deliberately differs (a NeMo-RL convention), the difference is in DELIBERATE
below and in docs/sppo.md ("Against the official scripts").
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "examples" / "configs"

# ------------------------------------------------------------------ the sources' values -----------
# dotted key -> value; "≥N" for "a count that must cover N validation prompts" (checked below).
SPPO_COMMON = {
    "loss_fn.ratio_clip_min": 0.2,
    "loss_fn.ratio_clip_max": 0.2,  # actor clip_ratio 0.2
    "loss_fn.ratio_clip_c": 3.0,  # verl clip_ratio_c 3.0
    "loss_fn.token_level_loss": True,  # loss_agg_mode token-mean
    "loss_fn.reference_policy_kl_penalty": 0.0,  # use_kl_loss False
    "loss_fn.use_kl_in_reward": False,  # use_kl_in_reward False
    "ppo.num_generations_per_prompt": 1,  # N = 1 (rollout.n 1)
    "ppo.ppo_epochs": 1,
    "ppo.policy_training_start_step": 0,  # critic_warmup 0
    "ppo.val_at_start": True,  # val_before_train
    "ppo.adv_estimator.name": "sppo",  # sequence_level_adv
    "policy.generation.temperature": 0.6,
    "policy.generation.val_temperature": 0.6,  # val_kwargs.temperature
    "policy.generation.top_p": 1.0,
    "policy.generation.max_new_tokens": 8192,  # max_response_length
    "policy.generation.vllm_cfg.gpu_memory_utilization": 0.8,
    "policy.generation.vllm_cfg.enforce_eager": True,
    "policy.max_grad_norm": 1.0,  # grad_clip 1.0
    "data.shuffle": True,
}
VALIDATION_AIME8_MATH500 = [("AIME2024", 8), ("HuggingFaceH4/MATH-500", 1)]  # 240 + 500 prompts
VAL_PROMPTS = 30 * 8 + 500

PAPER = {
    "sppo_r1_distill_qwen_1.5b.yaml": {
        **SPPO_COMMON,
        "policy.model_name": "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B",
        "value.model_name": "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B",
        "ppo.num_prompts_per_step": 256,
        "policy.train_global_batch_size": 128,
        "value.train_global_batch_size": 128,
        "policy.optimizer.kwargs.lr": 1e-6,
        "policy.optimizer.kwargs.weight_decay": 0.01,
        "value.optimizer.kwargs.lr": 5e-6,
        "data.max_input_seq_length": 1024,
        "policy.max_total_sequence_length": 1024 + 8192,
        "policy.generation.vllm_cfg.max_model_len": 9216,
        "ppo.val_period": 10,
        "data.train.dataset_name": "DeepScaler",
        "_validation": VALIDATION_AIME8_MATH500,
    },
    "sppo_r1_distill_qwen_7b.yaml": {
        **SPPO_COMMON,
        "policy.model_name": "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
        "value.model_name": "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
        "ppo.num_prompts_per_step": 512,
        "policy.train_global_batch_size": 32,
        "value.train_global_batch_size": 32,
        "policy.optimizer.kwargs.lr": 1e-6,
        "policy.optimizer.kwargs.weight_decay": 0.1,
        "value.optimizer.kwargs.lr": 1e-5,
        "data.max_input_seq_length": 2048,
        "policy.max_total_sequence_length": 2048 + 8192,
        "policy.generation.vllm_cfg.tensor_parallel_size": 4,
        "policy.dtensor_cfg.cpu_offload": True,  # param/optimizer offload
        "ppo.val_period": 2,
        "ppo.max_num_steps": 200,
        "data.train.dataset_name": "DAPOMath17K",
        "_validation": VALIDATION_AIME8_MATH500,
    },
    "sppo_r1_distill_qwen_7b_small_critic.yaml": {
        **SPPO_COMMON,
        "policy.model_name": "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
        "value.model_name": "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B",  # the decoupled small critic
        "ppo.num_prompts_per_step": 512,
        "policy.train_global_batch_size": 32,
        "value.optimizer.kwargs.lr": 1e-5,
        "ppo.val_period": 2,
        "ppo.max_num_steps": 200,
        "_validation": VALIDATION_AIME8_MATH500,
    },
    # SPPO's GRPO baselines: the same actor (dual clip, ε 0.2, token-mean), N = 8
    "grpo_r1_distill_qwen_1.5b.yaml": {
        "grpo.num_prompts_per_step": 256,
        "grpo.num_generations_per_prompt": 8,
        "loss_fn.ratio_clip_min": 0.2,
        "loss_fn.ratio_clip_max": 0.2,
        "loss_fn.ratio_clip_c": 3.0,
        "loss_fn.token_level_loss": True,
        "loss_fn.reference_policy_kl_penalty": 0.0,
        "grpo.use_leave_one_out_baseline": False,
        "grpo.normalize_rewards": True,
        "policy.generation.temperature": 0.6,
        "policy.generation.val_temperature": 0.6,
        "policy.generation.vllm_cfg.gpu_memory_utilization": 0.8,
        "policy.generation.vllm_cfg.enforce_eager": True,
        "policy.optimizer.kwargs.lr": 1e-6,
        "data.max_input_seq_length": 1024,
        "_validation": VALIDATION_AIME8_MATH500,
    },
    "grpo_r1_distill_qwen_7b.yaml": {
        "grpo.num_prompts_per_step": 512,
        "grpo.num_generations_per_prompt": 8,
        "loss_fn.ratio_clip_min": 0.2,
        "loss_fn.ratio_clip_max": 0.2,
        "loss_fn.ratio_clip_c": 3.0,
        "loss_fn.token_level_loss": True,
        "policy.optimizer.kwargs.weight_decay": 0.1,
        "policy.generation.vllm_cfg.gpu_memory_utilization": 0.8,
        "policy.generation.vllm_cfg.enforce_eager": True,
        "data.max_input_seq_length": 2048,
        "_validation": VALIDATION_AIME8_MATH500,
    },
    # GSPO baselines: ε 3e-4 / 4e-4, sequence-level normalisation, no dual clip
    **{
        name: {
            "loss_fn.granular.algorithm": "gspo",
            "loss_fn.ratio_clip_min": 3e-4,
            "loss_fn.ratio_clip_max": 4e-4,
            "loss_fn.token_level_loss": False,
            "loss_fn.ratio_clip_c": None,
            "loss_fn.reference_policy_kl_penalty": 0.0,
        }
        for name in ("gspo_qwen2.5_math_1.5b.yaml", "gspo_qwen2.5_math_7b.yaml", "gspo_qwen3_30b_a3b_megatron.yaml")
    },
    # SSPO's GRPO baselines: token-level ratio, ε 0.2 / 0.2, token-mean (the GRPO of SSPO §6.1)
    **{
        name: {
            "loss_fn.granular.algorithm": "grpo",
            "loss_fn.ratio_clip_min": 0.2,
            "loss_fn.ratio_clip_max": 0.2,
            "loss_fn.token_level_loss": True,
            "grpo.num_generations_per_prompt": 8,
            "loss_fn.reference_policy_kl_penalty": 0.0,
        }
        for name in ("grpo_qwen2.5_math_1.5b.yaml", "grpo_qwen2.5_math_7b.yaml")
    },
    # SSPO §6.1
    "sspo_qwen2.5_math_1.5b.yaml": {
        "loss_fn.granular.algorithm": "sspo",
        "loss_fn.token_level_loss": False,
        "loss_fn.granular.sspo.alpha": 0.0,
        "loss_fn.granular.sspo.beta": 0.8,
        "loss_fn.granular.sspo.gamma": 1.75,
        "grpo.num_generations_per_prompt": 8,
    },
    "sspo_qwen2.5_math_7b.yaml": {
        "loss_fn.granular.algorithm": "sspo",
        "loss_fn.token_level_loss": False,
        "loss_fn.granular.sspo.alpha": 0.15,
        "loss_fn.granular.sspo.beta": 0.8,
        "loss_fn.granular.sspo.gamma": 2.2,
        "grpo.num_generations_per_prompt": 8,
    },
    "espo_qwen3_30b_a3b_megatron.yaml": {
        "loss_fn.granular.algorithm": "espo",
        "loss_fn.granular.entropy_top_fraction": 0.2,
        "grpo.adv_estimator.name": "espo",
        "loss_fn.token_level_loss": False,
    },
}
# NeMo-RL's router-replay (R3) recipe for Qwen3-30B-A3B, recipes/llm/grpo-qwen3-30ba3b-8n8g-megatron-cp2-r3.yaml:
# the MoE pair keeps its router-replay and parallel settings (tests/test_cluster_configs.py compares
# every key of the recipe; the deliberate differences are in the configs' headers)
R3_RECIPE = {
    "policy.router_replay.enabled": True,
    "policy.generation.vllm_kwargs.enable_chunked_prefill": False,
    "policy.generation.vllm_cfg.enable_prefix_caching": False,
    "policy.generation.vllm_cfg.precision": "bfloat16",
    "policy.generation.vllm_cfg.expert_parallel_size": 4,
    "policy.megatron_cfg.tensor_model_parallel_size": 4,
    "policy.megatron_cfg.pipeline_model_parallel_size": 2,
    "policy.megatron_cfg.context_parallel_size": 2,
    "policy.sequence_packing.enabled": True,
    "policy.logprob_batch_size": 1,
    "policy.make_sequence_length_divisible_by": 16,
}
for _name in ("espo_qwen3_30b_a3b_megatron.yaml", "gspo_qwen3_30b_a3b_megatron.yaml"):
    PAPER[_name].update(R3_RECIPE)
# What NeMo-RL itself requires of these settings (not a paper value): with no KL the reference
# log-probs are skipped (grpo/ppo.skip_reference_policy_logprobs_calculation), and a Megatron policy
# with logprob_chunk_size needs defer_fp32_logits (NeMo-RL rejects it at worker init otherwise:
# models/megatron/setup.py:_validate_chunking_config; tests/test_preflight_nemo_rl.py).
for _name, _row in PAPER.items():
    _algo = "ppo" if _name.startswith("sppo") else "grpo"
    if _row.get("loss_fn.reference_policy_kl_penalty", 0.0) == 0.0:
        _row[f"{_algo}.skip_reference_policy_logprobs_calculation"] = True
MEGATRON_CHUNKED = (
    "espo_qwen3_30b_a3b_megatron.yaml",
    "gspo_qwen3_30b_a3b_megatron.yaml",
    *(f"{a}_qwen2.5_math_{s}.yaml" for a in ("sspo", "grpo", "gspo") for s in ("1.5b", "7b")),
)
for _name in MEGATRON_CHUNKED:
    PAPER[_name].update({"policy.megatron_cfg.enabled": True, "policy.megatron_cfg.defer_fp32_logits": True})

# Deliberate differences from the official scripts (NeMo-RL conventions), documented in docs/sppo.md.
DELIBERATE = {
    "token-mean": "NeMo-RL normalises the token mean over the global batch (global_valid_toks), verl per micro-batch",
    "over-long prompts": "NeMo-RL's processor keeps an over-long prompt in the batch with loss "
    "multiplier 0 (the official 1.5B script filters it, the 7B script left-truncates)",
    "7B max_model_len": "10240 = 2048 prompt + 8192 response (official 20480, never reached)",
    "save period": "checkpointing.save_period 10 (official save_freq 2 for 1.5B): storage, not the algorithm",
    "max_num_batched_tokens": "vLLM scheduler budget (24576 / 32768 officially), NeMo-RL's default kept",
}

# ESPO α: one rule (docs/algorithms/espo.md): α = ε̄ · log|V| / H̄₀ with ε̄ = 3.5e-4 (the middle of
# GSPO's 3e-4 / 4e-4) and H̄₀ the mean π_old token entropy of the first rollout, in nats.
ESPO_TARGET_EPS = 3.5e-4
QWEN3_VOCAB = 151_936
ESPO_CONFIGS = ("espo_qwen3_30b_a3b_megatron.yaml",)  # α by the rule: espo.alpha: auto


# ------------------------------------------------------------------ loading -----------------------


@pytest.fixture(scope="module")
def load(nemo_rl_src, tmp_path_factory):
    """name -> the merged, resolved config dict, as NeMo-RL's load_config builds it."""
    from nemo_rl.utils.config import load_config, register_omegaconf_resolvers
    from omegaconf import OmegaConf

    register_omegaconf_resolvers()
    try:  # the launchers' loader: NeMo-RL's load_config with nemo_rl/upstream/ -> $NEMO_RL_SRC
        from nemo_granular.nemo_rl.configs import load_config as launcher_load_config
    except ImportError:
        launcher_load_config = None
    d = tmp_path_factory.mktemp("configs")
    for p in CONFIGS.glob("*.yaml"):
        shutil.copy(p, d / p.name)
    (d / "nemo_rl").mkdir()
    (d / "nemo_rl" / "upstream").symlink_to(nemo_rl_src / "examples" / "configs", target_is_directory=True)
    cache = {}

    def _load(name: str) -> dict:
        if name not in cache:
            # the documented link next to a copy: NeMo-RL's own loader, nothing in between
            cfg = OmegaConf.to_container(load_config(d / name), resolve=True)
            if launcher_load_config is not None:  # and what run_grpo / run_sppo load: the same
                mine = OmegaConf.to_container(launcher_load_config(CONFIGS / name), resolve=True)
                assert mine == cfg, f"{name}: nemo_granular.nemo_rl.configs.load_config differs from NeMo-RL's"
            cache[name] = cfg
        return cache[name]

    return _load


def _get(cfg: dict, dotted: str):
    cur = cfg
    for part in dotted.split("."):
        assert isinstance(cur, dict) and part in cur, f"missing key {dotted}"
        cur = cur[part]
    return cur


def _same(a, b) -> bool:
    if isinstance(b, float) and isinstance(a, (int, float)) and not isinstance(a, bool):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
    return a == b


@pytest.mark.nemo_rl
def test_nemo_rl_requirements_hold_for_every_config(load):
    """Independently of the rows above: every config with KL 0 skips the reference log-probs, and every
    Megatron config with a logprob chunk defers the fp32 logits (the pair NeMo-RL's worker demands)."""
    for name in sorted(PAPER):
        cfg = load(name)
        algo = "ppo" if "ppo" in cfg and "grpo" not in cfg else "grpo"
        if _get(cfg, "loss_fn.reference_policy_kl_penalty") == 0:
            assert _get(cfg, f"{algo}.skip_reference_policy_logprobs_calculation") is True, name
        meg = cfg["policy"].get("megatron_cfg") or {}
        if meg.get("enabled") and (cfg["policy"].get("logprob_chunk_size") or 0) > 0:
            assert meg.get("defer_fp32_logits") is True, name
    assert {n for n in PAPER if PAPER[n].get("policy.megatron_cfg.defer_fp32_logits")} == set(MEGATRON_CHUNKED)


def test_every_paper_config_is_in_the_table():
    on_disk = {p.name for p in CONFIGS.glob("*.yaml")}
    assert on_disk == set(PAPER), (
        f"configs without a table of the paper's values: {sorted(on_disk - set(PAPER))}; "
        f"table rows without a config: {sorted(set(PAPER) - on_disk)}"
    )


@pytest.mark.nemo_rl
@pytest.mark.parametrize("name", sorted(PAPER))
def test_config_matches_the_paper_and_official_scripts(load, name):
    cfg = load(name)
    wrong = []
    for key, want in PAPER[name].items():
        if key.startswith("_"):
            continue
        got = _get(cfg, key)
        if not _same(got, want):
            wrong.append(f"{key}: config {got!r}, paper/official {want!r}")
    assert not wrong, f"{name}:\n  " + "\n  ".join(wrong)


@pytest.mark.nemo_rl
@pytest.mark.parametrize("name", sorted(n for n, t in PAPER.items() if "_validation" in t))
def test_validation_set_and_that_nemo_rl_validates_all_of_it(load, name):
    cfg = load(name)
    algo = "ppo" if "ppo" in cfg and "grpo" not in cfg else "grpo"
    val = _get(cfg, "data.validation")
    val = [val] if isinstance(val, dict) else val
    got = [(v.get("data_path") or v["dataset_name"], v.get("repeat", 1)) for v in val]
    assert got == PAPER[name]["_validation"], f"{name}: validation {got}"
    # NeMo-RL validates max_val_samples // val_batch_size batches of val_batch_size prompts
    batches = _get(cfg, f"{algo}.max_val_samples") // _get(cfg, f"{algo}.val_batch_size")
    covered = batches * _get(cfg, f"{algo}.val_batch_size")
    assert covered >= VAL_PROMPTS, f"{name}: validation stops after {covered} of {VAL_PROMPTS} prompts"
    # the MATH500 entry reads the right keys; every entry gets a prompt and the math environment
    math500 = next(v for v in val if v.get("data_path") == "HuggingFaceH4/MATH-500")
    assert (math500["dataset_name"], math500["split"], math500["input_key"], math500["output_key"]) == (
        "ResponseDataset",
        "test",
        "problem",
        "answer",
    )
    default = _get(cfg, "data.default")
    for v in val:
        assert {**default, **v}.get("prompt_file"), f"{name}: validation entry {v} has no prompt"


@pytest.mark.nemo_rl
def test_dapo_validation_covers_aime_x32(load):
    """The Qwen3-30B ESPO/GSPO pair validates on DAPO's AIME-2024 (30 problems x 32 = 960 rows)."""
    for name in ("espo_qwen3_30b_a3b_megatron.yaml", "gspo_qwen3_30b_a3b_megatron.yaml"):
        g = _get(load(name), "grpo")
        assert (g["max_val_samples"] // g["val_batch_size"]) * g["val_batch_size"] >= 960, name


@pytest.mark.nemo_rl
@pytest.mark.parametrize("name", ESPO_CONFIGS)
def test_espo_alpha_follows_the_documented_rule(load, name):
    """`espo.alpha: auto` applies the rule to the first rollout's entropy (the loss computes it:
    test_espo_alpha_auto.py); the config states the rule and its log|V|."""
    cfg = load(name)
    assert _get(cfg, "loss_fn.granular.espo.alpha") == "auto", name
    header = (CONFIGS / name).read_text()
    assert "3.5e-4" in header and f"{math.log(QWEN3_VOCAB):.2f}" in header, "the config must state the rule"
    from nemo_granular.core.clipping import ESPO_AUTO_TARGET_EPS

    assert ESPO_AUTO_TARGET_EPS == ESPO_TARGET_EPS  # the rule `auto` applies is the documented one


def test_espo_alpha_rule_is_the_one_documented_everywhere():
    """README, docs/algorithms/espo.md and docs/algorithms/math.md state the same rule."""
    for doc in ("README.md", "docs/algorithms/espo.md", "docs/algorithms/math.md"):
        text = (ROOT / doc).read_text()
        assert "3.5e-4" in text and "log|V|" in text, f"{doc} does not state the ESPO α rule"


def test_deliberate_differences_are_documented():
    text = (ROOT / "docs" / "sppo.md").read_text()
    for topic in DELIBERATE:
        assert topic in text, f"docs/sppo.md does not explain the deliberate difference '{topic}'"


# ------------------------------------------------------------------ one launch story -------------


@pytest.mark.parametrize("name", sorted(PAPER))
def test_config_header_gives_the_one_launch_story(name):
    """Every cluster config's header launches it the way docs/slurm.md ("One launch story") and
    the README do: NeMo-RL as WORKDIR, `uv run python -m nemo_granular.run_*` through launch.sh,
    and the comparison through submit_comparison.sh with the training resources in --train-sbatch."""
    header = (CONFIGS / name).read_text().split("\ndefaults:")[0]
    driver = "run_sppo" if name.startswith("sppo") else "run_grpo"
    for needle in (
        'docs/slurm.md, "One launch story"',
        "NeMo-RL 7ea279abf",
        "uv pip install --no-deps -e",
        "HF_HUB_OFFLINE=1",
        "WORKDIR=/lustre/NeMo-RL",
        "slurm/launch.sh uv run python -m nemo_granular." + driver,
        f"--config /lustre/nemo-granular/examples/configs/{name}",
        "slurm/submit_comparison.sh",
        '--train-sbatch "--gres=gpu:',
    ):
        assert needle in header, f"{name}: header lacks {needle!r}"
    assert "PYTHONPATH" not in header, f"{name}: the launch story installs nemo-granular, no PYTHONPATH"
    # the nodes and GPUs of the command are the config's own cluster section
    from omegaconf import OmegaConf

    cl = (
        OmegaConf.load(CONFIGS / name).get("cluster")
        or OmegaConf.load(CONFIGS / str(OmegaConf.load(CONFIGS / name).defaults)).cluster
    )
    assert f"--nodes={cl.num_nodes} --gres=gpu:{cl.gpus_per_node}" in header, name


def test_readme_and_slurm_doc_tell_the_same_launch_story():
    slurm = (ROOT / "docs" / "slurm.md").read_text()
    readme = (ROOT / "README.md").read_text()
    for needle in (
        "7ea279abf",
        "uv pip install --no-deps -e",
        "HF_HUB_OFFLINE=1",
        "huggingface-cli download",
        "submit_comparison.sh",
        "ray.sub",
        "NEMO_GRANULAR_SLURM_TESTS=0",
    ):
        assert needle in slurm, f"docs/slurm.md lacks {needle!r}"
    for needle in (
        "7ea279abf",
        "uv pip install --no-deps -e",
        "HF_HUB_OFFLINE=1",
        "submit_comparison.sh",
        "one-launch-story",
        "NEMO_GRANULAR_SLURM_TESTS=0",
        "/etc/hosts",
    ):
        assert needle in readme, f"README.md lacks {needle!r}"
