"""The cluster configs in ``examples/configs/`` (Qwen3-30B-A3B ESPO/GSPO, Qwen2.5-Math SSPO/GRPO/GSPO).

Checked here, without NeMo-RL installed:
* every file parses, inherits a NeMo-RL example through ``nemo_rl/upstream/`` and passes our
  config contract (``parse_policy_loss_config``, ``parse_advantage_config``, run_grpo's mode checks);
* the algorithm settings are those of docs/algorithms/math.md (ESPO 20/80 + adaptive eps, GSPO 3e-4/4e-4, SSPO
  alpha/beta/gamma per model size);
* configs of one comparison differ ONLY in loss / advantage keys and run names;
* the parallel layout fits the allocation and the model (TP | heads, EP | experts, ...);
* NeMo-RL world (``nemo_rl_src``): the full inheritance chain resolves through NeMo-RL's own
  ``load_config`` (``nemo_granular.nemo_rl.configs``, no link) and every key we set already exists
  in NeMo-RL's base config, except the plugin's own keys — this catches misspelt keys that
  NeMo-RL would silently keep (tests/test_host_configs.py checks the typed dicts as well);
* NeMo-RL world: the MoE pair inherits NeMo-RL's router-replay recipe and keeps every key it sets
  except the deliberate differences its header states.

The other tests run in both worlds (they read the YAML files only).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from nemo_granular.config import parse_advantage_config, parse_policy_loss_config

ROOT = Path(__file__).resolve().parents[1]
CFG = ROOT / "examples" / "configs"

MOE_PAIR = ("espo_qwen3_30b_a3b_megatron.yaml", "gspo_qwen3_30b_a3b_megatron.yaml")
MATH = {size: tuple(f"{a}_qwen2.5_math_{size}.yaml" for a in ("sspo", "grpo", "gspo")) for size in ("1.5b", "7b")}
ALL = [*MOE_PAIR, *MATH["1.5b"], *MATH["7b"]]
# model facts the layout must respect: attention heads, KV heads, experts, layers
MODELS = {
    "Qwen/Qwen3-30B-A3B-Base": dict(heads=32, kv=4, experts=128, layers=48, ctx=32768),
    "Qwen/Qwen2.5-Math-1.5B": dict(heads=12, kv=2, experts=0, layers=28, ctx=4096),
    "Qwen/Qwen2.5-Math-7B": dict(heads=28, kv=4, experts=0, layers=28, ctx=4096),
}
# keys allowed to differ between configs of one comparison
RUN_NAME_KEYS = {"checkpointing.checkpoint_dir", "logger.log_dir", "logger.wandb.name"}
LOSS_PREFIXES = ("loss_fn.", "grpo.adv_estimator.")
# keys that are ours (not in NeMo-RL's base config)
PLUGIN_KEYS = (
    "loss_fn.granular",
    "grpo.adv_estimator.verification_failed_key",
    "nemo_granular.",
    "env.espo_math.",
    "data.default.env_name",
    "data.train.",
    "data.validation.",
)
# NeMo-RL keys that are read with .get() and absent from the example configs
OPTIONAL_NEMO_RL_KEYS = {
    "policy.generation.vllm_cfg.enable_prefix_caching",  # vllm_worker.py:84
    # a GRPOConfig field (grpo.py) that NeMo-RL's example YAMLs leave at its default
    "grpo.skip_reference_policy_logprobs_calculation",
}


def load(name: str) -> dict:
    return yaml.safe_load((CFG / name).read_text())


def flatten(d, prefix=""):
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def get(cfg, dotted, default=None):
    cur = cfg
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return default
        cur = cur[part]
    return cur


@pytest.mark.parametrize("name", ALL)
def test_config_parses_and_meets_contract(name):
    cfg = load(name)
    assert cfg["defaults"].startswith("nemo_rl/upstream/"), cfg["defaults"]
    loss = parse_policy_loss_config(cfg["loss_fn"])
    adv = parse_advantage_config(cfg["grpo"]["adv_estimator"])
    algo = name.split("_")[0]
    assert loss.granular.algorithm == algo
    assert adv.name == ("espo" if algo == "espo" else "grpo")
    from nemo_granular.run_grpo import check_supported_modes, runtime_options

    check_supported_modes(cfg)
    runtime_options(cfg)
    header = (CFG / name).read_text().split("\ndefaults:")[0]
    assert "nemo_granular.nemo_rl.configs" in header and "NEMO_RL_SRC" in header, (
        "header must say how the NeMo-RL parent is found"
    )
    assert "slurm/launch.sh" in header


def test_algorithm_settings_follow_the_spec():
    espo = parse_policy_loss_config(load(MOE_PAIR[0])["loss_fn"]).granular
    assert (espo.granularity, espo.ratio, espo.clip, espo.aggregation) == (
        "entropy_group",
        "token_decomposed",
        "espo_entropy",
        "seq_mean_group_mean",
    )
    assert espo.entropy_cut_points == [0.2] and espo.espo.alpha == "auto"  # the 3.5e-4 rule (docs/algorithms/espo.md)
    gspo = parse_policy_loss_config(load(MOE_PAIR[1])["loss_fn"])
    assert gspo.granular.granularity == "sequence" and (gspo.eps_low, gspo.eps_high) == (3e-4, 4e-4)
    expected_sspo = {"1.5b": (0.0, 0.8, 1.75), "7b": (0.15, 0.8, 2.2)}
    for size, (s, g, gs) in MATH.items():
        sspo = parse_policy_loss_config(load(s)["loss_fn"]).granular
        assert (
            sspo.granularity == "segment" and sspo.clip == "sspo_entropy" and list(sspo.segment_delimiters) == ["\n\n"]
        )
        assert (sspo.sspo.alpha, sspo.sspo.beta, sspo.sspo.gamma) == expected_sspo[size]
        grpo = parse_policy_loss_config(load(g)["loss_fn"])
        assert grpo.granular.granularity == "token" and (grpo.eps_low, grpo.eps_high) == (0.2, 0.2)
        assert load(g)["loss_fn"]["token_level_loss"] is True
        gs_ = parse_policy_loss_config(load(gs)["loss_fn"])
        assert (gs_.eps_low, gs_.eps_high) == (3e-4, 4e-4)
        cfg = load(s)  # the paper's setting (docs/algorithms/math.md §3)
        assert cfg["grpo"]["num_generations_per_prompt"] == 8 and cfg["grpo"]["num_prompts_per_step"] == 128
        assert cfg["policy"]["generation"]["max_new_tokens"] == 3000
        assert "math_level3to5" in cfg["data"]["train"]["data_path"]


@pytest.mark.parametrize("group", [MOE_PAIR, MATH["1.5b"], MATH["7b"]], ids=["qwen3-30b", "math-1.5b", "math-7b"])
def test_comparison_configs_differ_only_in_loss_and_names(group):
    flat = [flatten(load(n)) for n in group]
    base = flat[0]
    for name, other in zip(group[1:], flat[1:]):
        keys = set(base) | set(other)
        diff = {k for k in keys if base.get(k, "<absent>") != other.get(k, "<absent>")}
        bad = sorted(k for k in diff if k not in RUN_NAME_KEYS and not k.startswith(LOSS_PREFIXES))
        assert not bad, f"{group[0]} vs {name} differ outside the loss/advantage keys: {bad}"
        assert diff & {"loss_fn.granular.algorithm"}, "they must differ in the algorithm"
        assert diff >= RUN_NAME_KEYS, f"run names must differ: {sorted(RUN_NAME_KEYS - diff)}"
        # same seed and data, explicitly
        for k in ("grpo.seed", "data.train.dataset_name", "data.train.data_path", "data.shuffle"):
            assert base.get(k) == other.get(k)


@pytest.mark.parametrize("name", ALL)
def test_parallel_layout_fits_allocation_and_model(name):
    cfg = load(name)
    p, m = cfg["policy"], cfg["policy"]["megatron_cfg"]
    model = MODELS[p["model_name"]]
    tp, pp, cp = m["tensor_model_parallel_size"], m["pipeline_model_parallel_size"], m["context_parallel_size"]
    ep, etp = m["expert_model_parallel_size"], m["expert_tensor_parallel_size"]
    world = cfg["cluster"]["num_nodes"] * cfg["cluster"]["gpus_per_node"]
    assert world % (tp * pp * cp) == 0
    dp = world // (tp * pp * cp)
    assert model["heads"] % tp == 0 and model["kv"] % tp == 0, "TP must divide the attention and KV heads"
    assert model["layers"] % pp == 0
    if tp > 1:
        assert m["sequence_parallel"] is True
    if model["experts"]:
        assert ep > 1 and model["experts"] % ep == 0 and (world // pp) % (ep * etp) == 0
        assert cfg["cluster"]["gpus_per_node"] % ep == 0, "keep the expert all-to-all inside a node"
    else:
        assert ep == 1
    assert p["make_sequence_length_divisible_by"] % (tp * (2 * cp if cp > 1 else 1)) == 0
    assert p["sequence_packing"]["enabled"] is True and p["dynamic_batching"]["enabled"] is False
    assert p["generation"]["backend"] == "vllm"
    assert cfg["data"]["max_input_seq_length"] + p["generation"]["max_new_tokens"] <= p["max_total_sequence_length"]
    assert p["max_total_sequence_length"] <= model["ctx"]
    responses = cfg["grpo"]["num_prompts_per_step"] * cfg["grpo"]["num_generations_per_prompt"]
    assert responses % p["train_global_batch_size"] == 0
    assert p["train_global_batch_size"] % (dp * p["train_micro_batch_size"]) == 0
    assert p["train_global_batch_size"] % cfg["grpo"]["num_generations_per_prompt"] == 0
    vt = p["generation"]["vllm_cfg"]["tensor_parallel_size"]
    assert cfg["cluster"]["gpus_per_node"] % vt == 0 and model["kv"] % vt == 0


# ------------------------------------------------------ full inheritance (NeMo-RL world) ---


@pytest.mark.nemo_rl
@pytest.mark.parametrize("name", ALL)
def test_inheritance_resolves_against_nemo_rl(name, nemo_rl_src):
    from nemo_rl.utils.config import load_config as nemo_rl_load_config
    from omegaconf import OmegaConf

    from nemo_granular.nemo_rl.configs import load_resolved

    own = load(name)
    parent = nemo_rl_src / "examples" / "configs" / own["defaults"].removeprefix("nemo_rl/upstream/")
    base_keys = set(flatten(OmegaConf.to_container(nemo_rl_load_config(parent), resolve=False)))
    base_prefixes = {k.rsplit(".", 1)[0] for k in base_keys}
    resolved = load_resolved(CFG / name)
    unknown = sorted(
        k
        for k in flatten({k: v for k, v in own.items() if k != "defaults"})
        if k not in base_keys
        and k not in base_prefixes
        and k not in OPTIONAL_NEMO_RL_KEYS
        and not k.startswith(PLUGIN_KEYS)
    )
    assert not unknown, f"{name} sets keys NeMo-RL's base does not have (typo?): {unknown}"
    assert (
        resolved["policy"]["sequence_packing"]["train_mb_tokens"]
        == resolved["policy"]["max_total_sequence_length"] * resolved["policy"]["train_micro_batch_size"]
    )
    assert (
        resolved["policy"]["megatron_cfg"]["enabled"] is True and resolved["policy"]["dtensor_cfg"]["enabled"] is False
    )
    # Megatron's asynchronous checkpoint save, inherited from NeMo-RL main's grpo_math_1B.yaml: a periodic
    # or time-limit save costs the step the copy to host memory, not the write (docs/slurm.md)
    assert resolved["policy"]["megatron_cfg"]["checkpoint"]["async_save"] is True
    parse_policy_loss_config(resolved["loss_fn"])


def test_math_data_preparation_extracts_the_last_boxed_answer():
    import importlib.util

    spec = importlib.util.spec_from_file_location("prep", ROOT / "slurm" / "prepare_math_level3to5.py")
    prep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prep)
    assert prep.last_boxed(r"so $x=\boxed{2}$, hence \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert prep.last_boxed(r"\boxed{ \{1, 2\} }") == r"\{1, 2\}"
    assert prep.last_boxed(r"answer \fbox{7}") == "7"
    assert prep.last_boxed("no box") is None and prep.last_boxed(r"\boxed{unclosed") is None


# ------------------------------------------- NeMo-RL's router-replay recipe (NeMo-RL world) ---

R3_RECIPE = "recipes/llm/grpo-qwen3-30ba3b-8n8g-megatron-cp2-r3.yaml"
# keys NeMo-RL's router-replay recipe sets that the MoE pair sets differently, and the word of the
# header's "Deliberate differences" list that explains each
R3_DELIBERATE = {
    "grpo.num_prompts_per_step": "batch",
    "policy.train_global_batch_size": "batch",
    "grpo.val_period": "schedule",
    "policy.generation.max_new_tokens": "length",
    "policy.generation.vllm_cfg.max_model_len": "length",
    "data.max_input_seq_length": "length",
    "policy.megatron_cfg.expert_model_parallel_size": "experts",
}


@pytest.mark.nemo_rl
@pytest.mark.parametrize("name", MOE_PAIR)
def test_moe_pair_keeps_nemo_rl_router_replay_recipe(name, nemo_rl_src):
    """Every key NeMo-RL's R3 recipe sets has the recipe's value in our resolved config, except the
    deliberate differences, each of which the header states; run names aside."""
    from nemo_rl.utils.config import load_config as nemo_rl_load_config
    from nemo_rl.utils.config import register_omegaconf_resolvers
    from omegaconf import OmegaConf

    from nemo_granular.nemo_rl.configs import load_resolved

    register_omegaconf_resolvers()
    own = load(name)
    assert own["defaults"] == f"nemo_rl/upstream/{R3_RECIPE}"
    recipe_file = nemo_rl_src / "examples" / "configs" / R3_RECIPE
    recipe_keys = {k for k in flatten(yaml.safe_load(recipe_file.read_text())) if k != "defaults"}
    recipe = OmegaConf.to_container(nemo_rl_load_config(recipe_file), resolve=True)
    ours = load_resolved(CFG / name)
    header = (CFG / name).read_text().split("\ndefaults:")[0]
    kept, differ = [], []
    for key in sorted(recipe_keys - RUN_NAME_KEYS):
        if key in R3_DELIBERATE:
            assert get(ours, key) != get(recipe, key), f"{key} is listed as deliberate but equals the recipe"
            assert f"#   {R3_DELIBERATE[key]}" in header, f"header does not state the '{R3_DELIBERATE[key]}' difference"
            differ.append(key)
        else:
            assert get(ours, key) == get(recipe, key), f"{key}: ours {get(ours, key)!r}, recipe {get(recipe, key)!r}"
            kept.append(key)
    assert "policy.generation.vllm_kwargs.enable_chunked_prefill" in kept and "policy.router_replay.enabled" in kept
    assert set(differ) == set(R3_DELIBERATE)
    # the router-replay vLLM keys are written in our file too (not only inherited)
    assert own["policy"]["generation"]["vllm_kwargs"]["enable_chunked_prefill"] is False
    assert own["policy"]["router_replay"]["enabled"] is True
