"""Every shipped DTensor config builds its NeMo-RL workers on CPU (NeMo-RL's own worker-init checks run).

World: NeMo-RL + the CPU host of ``tests/harness/cpu_host``. A config that loads is not a config that runs:
NeMo-RL's workers check the config again in their ``__init__``. Each shipped config whose policy
backend is DTensor (``examples/configs/*.yaml``, ``examples/configs/nemo_rl/*.yaml``) goes through
the real worker construction with only the model (a tiny local Qwen3), paths, sizes and cluster
shrunk, plus ``policy.sequence_packing.enabled: false`` (packing loads flash-attention 2, CUDA
only). Three of them are the parents of the loop runs (``test_loop_grpo``, ``test_loop_sppo``), which
construct their workers in ``setup()``; the others are built here by ``python -m cpu_host.construct``,
in one driver: ``GranularPolicy`` on our extension (GRPO configs) or NeMo-RL's ``Policy`` + ``Value``
(PPO configs), each followed by one real worker call. A config whose workers read exactly what a loop
parent's or an earlier config's read (:func:`worker_signature`: with the model shrunk, the shipped
configs of one recipe at two model sizes often differ only in the model) is covered by that one and
not built again: each construction is a driver's worth of worker actors (~20 s of imports each on
CI's two cores; issue #32).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from cpu_host import configs, models
from cpu_host.cluster import RayHead, run_driver

pytestmark = [pytest.mark.slow, pytest.mark.nemo_rl]

# shipped DTensor configs whose workers a loop run builds (in NeMo-RL's setup())
LOOP_PARENTS = {
    "nemo_rl/sspo_math_1B.yaml": "test_loop_grpo.py (SSPO, ESPO)",
    "grpo_r1_distill_qwen_1.5b.yaml": "test_loop_grpo.py (GSPO, 2 workers)",
    "sppo_r1_distill_qwen_7b_small_critic.yaml": "test_loop_sppo.py",
}


def shipped_dtensor_configs() -> list[str]:
    from nemo_granular.nemo_rl.configs import load_resolved

    out = []
    for path in sorted([*configs.CONFIGS.glob("*.yaml"), *(configs.CONFIGS / "nemo_rl").glob("*.yaml")]):
        policy = load_resolved(str(path), []).get("policy") or {}
        if (policy.get("dtensor_cfg") or {}).get("enabled") and not (policy.get("megatron_cfg") or {}).get("enabled"):
            out.append(str(path.relative_to(configs.CONFIGS)))
    return out


def worker_signature(config: str) -> str:
    """What the workers of a shrunk config read that the shrink leaves as shipped: the algorithm's
    kind (GRPO: the policy; PPO: policy + value), the DTensor settings and the precision of each."""
    from nemo_granular.nemo_rl.configs import load_resolved

    cfg = load_resolved(str(configs.CONFIGS / config), [])
    sections = {k: cfg[k] for k in ("policy", "value") if k in cfg}
    return json.dumps(
        {k: {"dtensor_cfg": v.get("dtensor_cfg"), "precision": v.get("precision")} for k, v in sections.items()},
        sort_keys=True,
        default=str,
    )


def covered_by() -> dict[str, str]:
    """Each shipped DTensor config → the config whose workers cover it (itself when it is built here)."""
    out: dict[str, str] = {}
    first: dict[str, str] = {worker_signature(c): c for c in LOOP_PARENTS}
    for c in shipped_dtensor_configs():
        out[c] = c if c in LOOP_PARENTS else first.setdefault(worker_signature(c), c)
    return out


@pytest.fixture(scope="module")
def constructed(nemo_rl_src):
    from nemo_granular.nemo_rl.configs import load_resolved

    todo = [c for c, by in covered_by().items() if by == c and c not in LOOP_PARENTS]
    root = Path(tempfile.mkdtemp(prefix="nship", dir="/tmp"))
    try:
        model = models.write_model(root / "qwen3")
        critic = models.write_model(root / "critic", hidden=16, layers=1, seed=1)
        data = models.write_math_data(root / "math.jsonl")
        children = []
        for i, parent in enumerate(todo):
            cfg = load_resolved(str(configs.CONFIGS / parent), [])
            # NeMo-RL refuses cpu_offload on a single worker: such configs get two
            gpus = 2 if cfg["policy"]["dtensor_cfg"].get("cpu_offload") else 1
            run = root / f"c{i}"
            run.mkdir()
            over = (
                configs.shrink_ppo(run, model, critic, data, gpus=gpus)
                if "value" in cfg
                else configs.shrink(run, model, data, gpus=gpus)
            )
            children.append(configs.write_child(run / "child.yaml", configs.CONFIGS / parent, over))
        with RayHead(root, num_cpus=8, num_gpus=2) as head:
            proc = run_driver(head, ["-m", "cpu_host.construct", *map(str, children)], root / "construct.log", 1500)
        facts = {}
        for line in proc.stdout.splitlines():
            for tag in ("CONSTRUCTED ", "REJECTED "):
                if line.startswith(tag):
                    fact = json.loads(line[len(tag) :])
                    fact["status"] = tag.strip()
                    facts[todo[children.index(Path(fact["config"]))]] = fact
        yield {"todo": todo, "facts": facts, "rc": proc.returncode, "log": proc.stdout}
    finally:
        if not os.environ.get("NEMO_GRANULAR_KEEP_LOOP_RUNS"):
            shutil.rmtree(root, ignore_errors=True)


def test_every_shipped_dtensor_config_is_covered(nemo_rl_src, constructed):
    found = shipped_dtensor_configs()
    assert set(LOOP_PARENTS) <= set(found), "a loop parent is no longer a shipped DTensor config"
    by = covered_by()
    # what the construction driver reported building (its CONSTRUCTED/REJECTED lines), not the list it was given
    built = set(constructed["facts"])
    for config in found:
        cover = by[config]
        assert cover in built | set(LOOP_PARENTS), (config, cover, sorted(built))
        if cover != config:  # not built: its workers read exactly what its cover's read
            assert worker_signature(config) == worker_signature(cover), (config, cover)
    assert len(found) >= 6 and len(built) >= 2, (found, sorted(built))


def test_shipped_dtensor_configs_build_their_workers(constructed):
    assert constructed["rc"] == 0, constructed["log"][-6000:]
    for parent in constructed["todo"]:
        fact = constructed["facts"].get(parent)
        assert fact is not None, (parent, constructed["log"][-4000:])
        assert fact["status"] == "CONSTRUCTED", fact
        assert fact["policy_workers"] == fact["gpus"] and fact["logprobs_shape"] == [fact["rows"], 12]
        if fact["kind"] == "ppo":
            assert fact["value_workers"] == fact["gpus"] and "values" in fact["values_keys"]
        else:
            assert fact["worker_cls"] == "GranularPolicy" and fact["entropy_positive"]
