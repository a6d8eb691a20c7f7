"""Every shipped Megatron config constructs NeMo-RL's real Megatron worker (with the plugin's
extension) and computes π_old log-probs and entropy, on CPU.

World: NeMo-RL (``nemo_rl_src``). Each ``examples/configs`` file whose policy runs on Megatron is
loaded as the launchers load it; the test changes only the model (a tiny HF checkpoint of the same
family: Qwen2 for Qwen2.5, Qwen3-MoE for Qwen3-30B-A3B), its paths, the cluster (every parallel
size 1, sequence parallelism off) and the sequence length the tiny model has, and turns off the
GPU-only fusions (``cases.tiny_overrides``). Precision, sequence packing, activation
checkpointing, the distributed optimizer, ``defer_fp32_logits`` and router replay stay as shipped
and are checked to have reached the worker. All configs are constructed one after another in one
process, as NeMo-RL's set-up tears the previous state down. The log-probs and entropy are compared
with the same checkpoint in float64 HF transformers (bfloat16 tolerance; MoE configs replay HF's
expert routes, as router replay replays vLLM's).
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.nemo_rl]

ROOT = Path(__file__).resolve().parents[1]
CFG = ROOT / "examples" / "configs"
B, S = 4, 32
TOL_BF16 = 0.1  # bfloat16 weights and activations vs float64, 2 layers


def _megatron_configs() -> list[str]:
    from nemo_granular.nemo_rl.configs import load_resolved

    names = sorted(p.relative_to(CFG).as_posix() for p in [*CFG.glob("*.yaml"), *(CFG / "nemo_rl").glob("*.yaml")])
    return [n for n in names if (load_resolved(CFG / n)["policy"].get("megatron_cfg") or {}).get("enabled")]


def _family(model_name: str) -> str:
    if "Qwen3" in model_name and "A3B" in model_name:
        return "moe"
    if "Qwen2" in model_name:
        return "qwen2"
    raise AssertionError(f"no tiny stand-in model for {model_name}: add one to tests/harness/megatron_cpu/models.py")


def _batch(g):
    from megatron_cpu.models import VOCAB

    lengths = torch.tensor([32, 19, 26, 11])
    ids = torch.randint(4, VOCAB, (B, S), generator=g)
    ids[torch.arange(S)[None, :] >= lengths[:, None]] = 0
    return ids, lengths


def test_every_shipped_megatron_config_constructs_the_worker(nemo_rl_src, megatron_workers, tmp_path):
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    from megatron_cpu import cases, models, reference, world
    from nemo_granular.nemo_rl.configs import load_resolved

    names = _megatron_configs()
    assert {"espo_qwen3_30b_a3b_megatron.yaml", "gspo_qwen3_30b_a3b_megatron.yaml", "nemo_rl/espo_math_1B.yaml"} <= set(
        names
    ) and len(names) >= 9, names
    dirs = {"qwen2": models.write(tmp_path / "qwen2", family="qwen2"), "moe": models.write(tmp_path / "moe", moe=True)}
    g = torch.Generator().manual_seed(0)
    items, refs = [], []
    for name in names:
        shipped = load_resolved(CFG / name)["policy"]
        family = _family(shipped["model_name"])
        overrides = cases.tiny_overrides(str(dirs[family]), seq_len=S)
        for key in (
            "train_global_batch_size",
            "train_micro_batch_size",
            "logprob_batch_size",
            "generation_batch_size",
            "make_sequence_length_divisible_by",
        ):
            overrides.pop(key)  # algorithm settings, kept as shipped
        hf = reference.load_hf(str(dirs[family]))
        ids, lengths = _batch(g)
        batch = {"input_ids": ids, "input_lengths": lengths}
        with torch.no_grad():
            mask = (torch.arange(S)[None, :] < lengths[:, None]).long()
            out = hf(input_ids=ids, attention_mask=mask, output_router_logits=family == "moe")
        if family == "moe" and (shipped.get("router_replay") or {}).get("enabled"):
            k = hf.config.num_experts_per_tok  # the routes HF took, replayed as vLLM's would be
            batch["routed_experts"] = torch.stack(
                [r.topk(k, dim=-1).indices.view(B, S, k) for r in out.router_logits], dim=2
            ).int()
        driver = cases.Driver(cases.merge(shipped, overrides), world=1)
        shards = driver.logprob_shards(BatchedDataDict(batch))
        items.append({"config": name, "overrides": overrides, "logprob_shards": pickle.dumps(shards)})
        refs.append((shipped, family, driver, *reference.logprobs_entropy(out.logits, ids, lengths), lengths))

    env = {
        "NRL_MEGATRON_CHECKPOINT_DIR": str(tmp_path / "mcore"),
        "HOME": str(tmp_path / "home"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TORCHDYNAMO_DISABLE": "1",
    }
    (results,) = world.run_world(1, cases.construct_each, items, env=env, preload=True)

    for res, (shipped, family, driver, lp, ent, lengths) in zip(results, refs):
        m = shipped["megatron_cfg"]
        assert res["reached"] == {
            "bf16": shipped["precision"] == "bfloat16",
            "recompute_granularity": m.get("recompute_granularity", "full") if m["activation_checkpointing"] else None,
            "defer_fp32_logits": bool(m.get("defer_fp32_logits")) and shipped["precision"] != "float32",
            "use_distributed_optimizer": m["optimizer"]["use_distributed_optimizer"],
            "overlap_param_gather": m["distributed_data_parallel_config"]["overlap_param_gather"],
            "packing": bool(shipped["sequence_packing"]["enabled"]),
            "num_moe_experts": 4 if family == "moe" else None,
            "router_replay": bool((shipped.get("router_replay") or {}).get("enabled")),
        }, res["config"]
        inside = torch.arange(S)[None, :] < lengths[:, None]
        d_lp = (driver.gather([res], "logprobs").double() - lp).abs()[inside].max().item()
        d_ent = (driver.gather([res], "entropy").double() - ent).abs().max().item()
        print(f"\n{res['config']}: init {res['init_s']:.1f}s, |Δlogprob| {d_lp:.2e}, |Δentropy| {d_ent:.2e}")
        assert d_lp < TOL_BF16 and d_ent < TOL_BF16, (res["config"], d_lp, d_ent)
