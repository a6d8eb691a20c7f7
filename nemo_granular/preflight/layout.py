"""The GPU layout NeMo-RL builds from a config: nodes and GPUs for training and generation, the
policy's TP/PP/CP/EP/DP and vLLM's TP/PP/EP/DP.

:func:`cluster_layout` follows the "Cluster" section of NeMo-RL's ``setup()``
(``nemo_rl/algorithms/grpo.py:setup`` and ``nemo_rl/algorithms/ppo.py:setup``, identical rules;
PPO also refuses non-colocated generation on a backend other than vLLM) and reports the
assertions found there as findings instead of raising.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .findings import Finding, error

__all__ = ["dig", "Layout", "cluster_layout", "policy_parallel", "vllm_parallel"]


def dig(cfg: Any, path: str, default: Any = None) -> Any:
    """``cfg["a"]["b"]`` for ``path="a.b"``; ``default`` when a level is missing or not a mapping."""
    cur = cfg
    for part in path.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            return default
        cur = cur[part]
    return default if cur is None and default is not None else cur


@dataclass(frozen=True)
class Layout:
    """Ray clusters ``setup()`` creates: colocated = one cluster shared by training and generation."""

    nodes: int
    gpus_per_node: int
    colocated: bool
    train_nodes: int
    train_gpus_per_node: int
    inference_nodes: int
    inference_gpus_per_node: int
    reward_model_nodes: int = 0

    @property
    def train_world(self) -> int:
        return self.train_nodes * self.train_gpus_per_node

    @property
    def inference_world(self) -> int:
        return self.inference_nodes * self.inference_gpus_per_node


def _reward_model_resources(cfg: Mapping) -> tuple[int, int]:
    """``(rm_nodes, rm_gpus_per_node)`` when a data task uses the ``reward_model`` environment
    (NeMo-RL's own ``extract_necessary_env_names`` decides)."""
    from ..nemo_rl import compat

    extract_necessary_env_names = compat.get("extract_necessary_env_names")

    if "reward_model" not in extract_necessary_env_names(cfg.get("data") or {}):
        return 0, 0
    res = dig(cfg, "env.reward_model.resources", {}) or {}
    return int(res.get("num_nodes") or 0), int(res.get("gpus_per_node") or 0)


def cluster_layout(cfg: Mapping, algorithm: str) -> tuple[Layout | None, list[Finding]]:
    """The layout and the findings of the cluster section of ``setup()`` (``algorithm``: grpo | ppo)."""
    src = f"nemo_rl/algorithms/{algorithm}.py:setup"
    total = int(dig(cfg, "cluster.num_nodes", 0) or 0)
    gpn = int(dig(cfg, "cluster.gpus_per_node", 0) or 0)
    if total <= 0 or gpn <= 0:
        return None, [error(src, f"cluster.num_nodes={total}, cluster.gpus_per_node={gpn}: both must be > 0")]
    gen = dig(cfg, "policy.generation") or {}
    colocated = bool(dig(gen, "colocated.enabled", True))
    rm_nodes, rm_gpus = _reward_model_resources(cfg)
    policy_nodes = total if total == 1 else total - rm_nodes
    if policy_nodes <= 0:
        return None, [
            error(
                src,
                f"policy nodes = cluster.num_nodes {total} - reward-model nodes {rm_nodes} "
                f"= {policy_nodes}; must be > 0",
            )
        ]
    if algorithm == "ppo" and not colocated and gen.get("backend") != "vllm":
        return None, [
            error(
                src,
                f"non-colocated PPO generation supports only vLLM (policy.generation.backend={gen.get('backend')!r})",
            )
        ]
    if colocated:
        per_node = gpn - rm_gpus if total == 1 else gpn
        if per_node <= 0:
            return None, [
                error(
                    src,
                    f"cluster.gpus_per_node {gpn} - reward-model GPUs {rm_gpus} = {per_node} "
                    f"policy GPUs per node; must be > 0",
                )
            ]
        return Layout(total, gpn, True, policy_nodes, per_node, policy_nodes, per_node, rm_nodes), []
    res = dig(gen, "colocated.resources", {}) or {}
    inf_gpn, inf_nodes = res.get("gpus_per_node"), res.get("num_nodes")
    train_gpn, train_nodes = gpn, policy_nodes
    if policy_nodes == 1:
        if inf_gpn is None or inf_gpn <= 0:
            return None, [
                error(
                    src,
                    "policy.generation.colocated.resources.gpus_per_node must be set > 0 for "
                    f"non-colocated generation on one policy node (got {inf_gpn})",
                )
            ]
        if inf_nodes not in (None, 1):
            return None, [
                error(
                    src,
                    "policy.generation.colocated.resources.num_nodes must be 1 or null when the "
                    f"policy has one node and generation is non-colocated (got {inf_nodes})",
                )
            ]
        inf_nodes = 1
        train_gpn -= inf_gpn + (rm_gpus if total == 1 else 0)
        if train_gpn <= 0:
            return None, [
                error(
                    src,
                    f"no GPUs left for training: cluster.gpus_per_node {gpn} - generation "
                    f"{inf_gpn} - reward model {rm_gpus if total == 1 else 0} = {train_gpn}",
                )
            ]
    else:
        if inf_nodes is None or inf_nodes <= 0:
            return None, [
                error(
                    src,
                    "policy.generation.colocated.resources.num_nodes must be > 0 when "
                    f"cluster.num_nodes > 1 and generation is non-colocated (got {inf_nodes})",
                )
            ]
        if inf_gpn != gpn:
            return None, [
                error(
                    src,
                    "policy.generation.colocated.resources.gpus_per_node must equal "
                    f"cluster.gpus_per_node ({gpn}) on a multi-node non-colocated run "
                    f"(got {inf_gpn})",
                )
            ]
        train_nodes -= inf_nodes
    if train_nodes <= 0 or inf_nodes <= 0:
        return None, [
            error(
                src,
                f"non-colocated generation needs training and generation nodes > 0 "
                f"(train {train_nodes}, generation {inf_nodes})",
            )
        ]
    return Layout(total, gpn, False, train_nodes, train_gpn, int(inf_nodes), int(inf_gpn), rm_nodes), []


def policy_parallel(policy: Mapping) -> dict[str, int | str]:
    """The training backend and its parallel sizes (``tp pp cp ep etp``), as ``Policy.__init__`` reads them
    (``nemo_rl/models/policy/lm_policy.py``)."""
    meg = policy.get("megatron_cfg") or {}
    if bool(meg.get("enabled", False)):
        return dict(
            backend="megatron",
            tp=int(meg.get("tensor_model_parallel_size", 1) or 1),
            pp=int(meg.get("pipeline_model_parallel_size", 1) or 1),
            cp=int(meg.get("context_parallel_size", 1) or 1),
            ep=int(meg.get("expert_model_parallel_size", 1) or 1),
            etp=int(meg.get("expert_tensor_parallel_size", 1) or 1),
        )
    dt = policy.get("dtensor_cfg") or {}
    backend = "dtensor_v2" if dt.get("_v2") else "dtensor"
    return dict(
        backend=backend,
        tp=int(dt.get("tensor_parallel_size", 1) or 1),
        pp=1,
        cp=int(dt.get("context_parallel_size", 1) or 1),
        ep=int(dt.get("expert_parallel_size", 1) or 1),
        etp=1,
    )


def vllm_parallel(gen: Mapping) -> dict[str, int]:
    """vLLM's TP/PP/EP as ``VllmGeneration.__init__`` reads them; ``engine_dp`` = EP / TP (vLLM's
    EP = DP × TP inside one engine)."""
    v = gen.get("vllm_cfg") or {}
    tp, pp, ep = (
        int(v.get("tensor_parallel_size", 1) or 1),
        int(v.get("pipeline_parallel_size", 1) or 1),
        int(v.get("expert_parallel_size", 1) or 1),
    )
    return dict(tp=tp, pp=pp, ep=ep, engine_dp=max(ep // tp, 1) if tp else 1)
