"""Driver: build the policy (and value) workers of shipped configs the way NeMo-RL's setup() does.

    python -m cpu_host.construct CONFIG [CONFIG ...]   (each CONFIG a child YAML of a shipped config)

For each config: our loader + NeMo-RL's ``MasterConfig`` (GRPO or PPO by its sections), a
``RayVirtualCluster`` with the config's GPUs, the tokenizer, then the workers through NeMo-RL's
own classes — ``GranularPolicy`` on our DTensor-v2 extension for GRPO configs (the policy factory
``run_grpo`` hands to ``setup``), NeMo-RL's ``Policy`` and ``Value`` for PPO configs (what
``ppo.setup`` builds) — with the keywords ``setup`` passes. The actors' ``__init__`` runs
NeMo-RL's own worker-init checks on the config. NeMo-RL's ``Policy`` reports its workers
initialised even when an actor's ``__init__`` died, so one real call follows (π_old log-probs
and entropy; critic values). One JSON line per config on stdout (``CONSTRUCTED {...}``), or
``REJECTED {...}`` with NeMo-RL's first error line.
"""

from __future__ import annotations

import json
import sys
import traceback


def _tiny_batch(tokenizer, rows: int = 4, length: int = 12):
    import torch
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, len(tokenizer), (rows, length), generator=g)
    lengths = torch.tensor([length - i for i in range(rows)])
    ids[torch.arange(length)[None, :] >= lengths[:, None]] = tokenizer.pad_token_id
    return BatchedDataDict(
        input_ids=ids,
        input_lengths=lengths,
        token_mask=torch.ones_like(ids, dtype=torch.float32),
        sample_mask=torch.ones(rows),
    )


def construct(path: str) -> dict:
    import ray
    import torch
    from nemo_rl.algorithms.utils import get_tokenizer
    from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
    from nemo_rl.models.generation import configure_generation_config

    from nemo_granular.nemo_rl.configs import load_resolved

    cfg = load_resolved(path, [])
    ppo = "ppo" in cfg and "value" in cfg
    if ppo:
        from nemo_rl.algorithms.ppo import MasterConfig
    else:
        from nemo_rl.algorithms.grpo import MasterConfig
    master = MasterConfig(**cfg)
    gpus = int(master.cluster["gpus_per_node"])
    cluster = RayVirtualCluster(
        bundle_ct_per_node_list=[gpus],
        use_gpus=True,
        num_gpus_per_node=gpus,
        max_colocated_worker_groups=2,
        name="construct",
    )
    tokenizer = get_tokenizer(master.policy["tokenizer"])
    master.policy["generation"] = configure_generation_config(master.policy["generation"], tokenizer)
    kl = master.loss_fn.reference_policy_kl_penalty > 0
    rows = 4 * gpus  # whole micro-batches on every data-parallel rank (the shrunk configs use ≤ 4)
    fact = {"config": path, "gpus": gpus, "kind": "ppo" if ppo else "grpo", "rows": rows}
    try:
        if ppo:
            from nemo_rl.models.policy.lm_policy import Policy
            from nemo_rl.models.value.lm_value import Value

            policy = Policy(cluster=cluster, config=master.policy, tokenizer=tokenizer, init_optimizer=True)
            value = Value(
                cluster=cluster,
                config=master.value,
                tokenizer=get_tokenizer(master.value["tokenizer"]),
                name_prefix="lm_value",
                init_optimizer=True,
            )
            lp = policy.get_logprobs(_tiny_batch(tokenizer, rows))["logprobs"]
            values = value.get_values(_tiny_batch(tokenizer, rows))
            fact.update(
                policy_workers=len(policy.worker_group.workers),
                value_workers=len(value.worker_group.workers),
                logprobs_shape=list(lp.shape),
                values_keys=sorted(values.keys()),
            )
            value.shutdown()
        else:
            from nemo_granular.nemo_rl.policy import make_policy_factory

            policy = make_policy_factory(master)(
                cluster=cluster, config=master.policy, tokenizer=tokenizer, init_optimizer=True, init_reference_model=kl
            )
            data = _tiny_batch(tokenizer, rows)
            lp = policy.get_logprobs(data)["logprobs"]
            ent = policy._entropy_for(data)
            cols = torch.arange(ent.shape[1])[None, :]
            inside = (cols >= 1) & (cols < data["input_lengths"][:, None])  # token columns of each row
            fact.update(
                policy_workers=len(policy.worker_group.workers),
                logprobs_shape=list(lp.shape),
                entropy_positive=bool((ent[inside] > 0).all()),
            )
        fact["worker_cls"] = type(policy).__name__
        policy.shutdown()
        print("CONSTRUCTED " + json.dumps(fact), flush=True)
    except ray.exceptions.RayError as err:
        first = [ln for ln in str(err).splitlines() if ln.strip() and not ln.startswith(" ")][-1]
        fact["error"] = first
        print("REJECTED " + json.dumps(fact), flush=True)
        traceback.print_exc()
    finally:
        cluster.shutdown()
    return fact


def main(argv: list[str]) -> int:
    from nemo_rl.distributed.virtual_cluster import init_ray

    init_ray()
    for path in argv:
        construct(path)
    return 0


if __name__ == "__main__":
    import os

    try:
        code = main(sys.argv[1:])
    except BaseException:  # noqa: BLE001 - end hard, no Ray driver left behind
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(code)
