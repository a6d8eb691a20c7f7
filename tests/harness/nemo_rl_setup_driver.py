"""Drive NeMo-RL's REAL start-up code on CPU until the first GPU/Ray call, to learn what it accepts.

Used by tests/test_preflight_nemo_rl.py to prove that preflight's findings agree with NeMo-RL's own
behaviour, config by config. Real: ``MasterConfig``, ``grpo.setup`` / ``ppo.setup`` (logger,
checkpoint manager, dataloaders, every assertion), ``VllmGeneration.__init__``, ``Policy.__init__``,
``Value.__init__`` and the Megatron worker's set-up validators. Stand-ins, test-side only, for what
needs Ray's GPU placement or a GPU (docs/nemo-rl.md §7):

* ``RayVirtualCluster`` → :class:`FakeCluster` (``world_size()`` and ``num_gpus_per_node`` of the
  bundles NeMo-RL asked for; placement groups need Ray with GPUs);
* ``RayWorkerGroup`` / ``RayQueue`` → inert objects (they start Ray actors on GPUs); the worker
  group reports the DP size of the sharding it was given, as the real one does;
* ``VllmGeneration._get_tied_worker_bundle_indices`` / ``_post_init`` / ``_report_*`` /
  ``finish_generation`` and ``Policy.offload_to_cpu`` → no-ops (placement-group and actor calls,
  all after the constructor's checks);
* ``FLOPTracker.from_config`` → "unsupported model" (it would download the model's config).

The drive stops right after the policy (GRPO) or the critic (PPO) has been constructed: the next
step of ``setup()`` talks to the workers.
"""

from __future__ import annotations

import copy
import os
import types
from pathlib import Path


class Reached(Exception):
    """The drive got past every check up to the named stage."""


class FakeCluster:
    def __init__(self, *args, bundle_ct_per_node_list=(), num_gpus_per_node=None, **kwargs):
        self.bundles = list(bundle_ct_per_node_list)
        self.num_gpus_per_node = num_gpus_per_node
        self._sorted_bundle_indices = None

    def world_size(self) -> int:
        return int(sum(self.bundles))

    def _init_placement_groups(self, *args, **kwargs):
        return None

    def get_placement_groups(self):
        return []


class FakeWorkerGroup:
    def __init__(self, cluster, builder, *args, sharding_annotations=None, **kwargs):
        self.builder = builder
        self.dp_size = sharding_annotations.get_axis_size("data_parallel") if sharding_annotations else 1

    def shutdown(self, *args, **kwargs):  # Policy.__del__
        return True


def _patch_ray_edges(monkeypatch) -> None:
    import nemo_rl.models.generation.vllm.vllm_generation as vg
    import nemo_rl.models.policy.lm_policy as lp
    import nemo_rl.models.value.lm_value as lv
    import ray.util.queue as rq

    monkeypatch.setattr(vg, "RayWorkerGroup", FakeWorkerGroup)
    monkeypatch.setattr(vg.VllmGeneration, "_get_tied_worker_bundle_indices", lambda self, cluster: [])
    monkeypatch.setattr(vg.VllmGeneration, "finish_generation", lambda self, *a, **k: True)
    for name in ("_post_init", "_report_dp_openai_server_base_urls", "_report_device_id"):
        monkeypatch.setattr(vg.VllmGeneration, name, lambda self, *a, **k: None)
    monkeypatch.setattr(lp, "RayWorkerGroup", FakeWorkerGroup)
    monkeypatch.setattr(lp, "RayQueue", lambda *a, **k: None)
    monkeypatch.setattr(
        lp.FLOPTracker,
        "from_config",
        classmethod(lambda cls, *a, **k: (_ for _ in ()).throw(ValueError("not probed in tests"))),
    )
    monkeypatch.setattr(lp, "get_default_hf_config", lambda name: None)
    monkeypatch.setattr(lv, "RayWorkerGroup", FakeWorkerGroup)
    monkeypatch.setattr(rq, "Queue", lambda *a, **k: None)


def _quiet_io(cfg: dict, tmp: Path) -> dict:
    """Logger/checkpoint I/O into ``tmp`` (keys that no check reads)."""
    cfg = copy.deepcopy(cfg)
    log = cfg.setdefault("logger", {})
    log.update(
        log_dir=str(tmp / "logs"),
        wandb_enabled=False,
        tensorboard_enabled=False,
        mlflow_enabled=False,
        swanlab_enabled=False,
        monitor_gpus=False,
    )
    cfg.setdefault("checkpointing", {})["checkpoint_dir"] = str(tmp / "ckpt")
    return cfg


def drive_setup(cfg: dict, driver: str, tmp: Path, monkeypatch) -> str:
    """``"reached"`` when NeMo-RL's real start-up accepted ``cfg`` up to the policy/critic workers,
    else what it raised, on one line (``AssertionError``/``ValueError``/…, or pydantic's first error)."""
    from pydantic import ValidationError

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", os.environ.get("TORCH_CUDA_ARCH_LIST", "9.0"))
    _patch_ray_edges(monkeypatch)
    cfg = _quiet_io(cfg, tmp)
    rows = [{"idx": i} for i in range(64)]
    try:
        if driver == "sppo":
            import nemo_rl.algorithms.ppo as algo

            master = algo.MasterConfig(**cfg)
            real_policy, real_value = algo.Policy, algo.Value

            def policy(*a, **k):
                p = real_policy(*a, **k)
                # the calls setup() makes on the workers between policy and value (main: offload_to_cpu;
                # v0.7.0: offload_after_refit); the fake worker group has no workers to call
                p.offload_to_cpu = p.offload_after_refit = lambda *a, **k: None
                return p

            def value(*a, **k):
                real_value(*a, **k)
                raise Reached("value")

            monkeypatch.setattr(algo, "Policy", policy)
            monkeypatch.setattr(algo, "Value", value)
            monkeypatch.setattr(algo, "RayVirtualCluster", FakeCluster)
            algo.setup(master, None, rows, rows)
        else:
            import nemo_rl.algorithms.grpo as algo
            from nemo_rl.models.policy.lm_policy import Policy

            master = algo.MasterConfig(**cfg)

            def policy_factory(*a, **k):
                Policy(*a, **k)
                raise Reached("policy")

            monkeypatch.setattr(algo, "RayVirtualCluster", FakeCluster)
            algo.setup(master, None, rows, rows, policy_factory=policy_factory)
    except Reached:
        return "reached"
    except ValidationError as err:
        first = err.errors()[0]
        return f"{'.'.join(str(x) for x in first['loc'])}: {first['msg']}"
    except (AssertionError, ValueError, NotImplementedError, RuntimeError, KeyError, TypeError) as err:
        return " ".join(str(err).split()) or type(err).__name__
    return "returned without reaching the workers"


def drive_megatron_validators(policy_cfg: dict) -> str:
    """The Megatron worker's config validators in ``setup_model_config``'s order (needs the
    ``megatron_workers`` fixture): ``"accepted"`` or the first line of what they raised."""
    import nemo_rl.models.megatron.setup as ms
    from nemo_rl.models.megatron.router_replay import validate_router_replay_config

    cfg = copy.deepcopy(policy_cfg)
    model_cfg = types.SimpleNamespace(gated_linear_unit=True, activation_func=None)
    try:
        validate_router_replay_config(cfg)
        ms._apply_parallelism_config(model_cfg, cfg)
        ms._apply_performance_config(model_cfg, cfg)
        ms._validate_optimizer_config(cfg)
        ms._validate_chunking_config(cfg)
    except (AssertionError, ValueError, NotImplementedError, KeyError) as err:
        text = str(err).strip()
        return text.splitlines()[0] if text else type(err).__name__
    return "accepted"
