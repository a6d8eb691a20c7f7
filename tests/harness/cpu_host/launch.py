"""Test launcher: ``python -m cpu_host.launch {grpo|sppo} --config ... [overrides]``.

Runs ``nemo_granular.run_grpo.main`` / ``nemo_granular.run_sppo.main`` unchanged, after two
test-only substitutions at the seam where NeMo-RL builds its generation engine:

* ``VllmGeneration`` in ``nemo_rl.algorithms.grpo`` / ``ppo`` is replaced by a function that runs
  the REAL ``VllmGeneration.__init__`` (config checks, placement groups, worker builder) until it
  creates its vLLM worker group, records what that group would be started with, and returns
  :class:`cpu_host.generation.CpuHFGeneration` instead (vLLM needs a GPU);
* ``setup`` is wrapped only to pick the stand-in's refit by the policy's backend and to hand it
  the built policy (NeMo-RL's own synchronizers receive it at construction, which happens before
  the policy here; :mod:`cpu_host.refit`).

Facts for the tests (the vLLM arguments, what each ``Policy.train`` call received, the weights
after each refit) are appended as JSON lines to ``$NEMO_GRANULAR_CPU_HOST_FACTS``.
Any exception ends the process hard (``os._exit``), so no Ray driver outlives a failed run.
"""

from __future__ import annotations

import json
import os
import sys
import traceback


def record(kind: str, **payload) -> None:
    path = os.environ.get("NEMO_GRANULAR_CPU_HOST_FACTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"kind": kind, **payload}, default=str) + "\n")


BUILT: dict = {}


def _vllm_arguments(config, cluster, builder, kwargs) -> dict:
    vcfg = config["vllm_cfg"]
    return {
        "worker_cls": builder.ray_actor_class_fqn,
        "cluster_world_size": cluster.world_size(),
        "num_gpus_per_node": cluster.num_gpus_per_node,
        "bundle_indices_list": kwargs.get("bundle_indices_list"),
        "workers_per_node": kwargs.get("workers_per_node"),
        "env_vars": kwargs.get("env_vars"),
        "model_name": config["model_name"],
        "vllm_cfg": {
            k: vcfg.get(k)
            for k in (
                "tensor_parallel_size",
                "pipeline_parallel_size",
                "expert_parallel_size",
                "max_model_len",
                "gpu_memory_utilization",
                "precision",
                "load_format",
                "async_engine",
                "enforce_eager",
                "kv_cache_dtype",
            )
        },
        "colocated": config["colocated"]["enabled"],
        "max_new_tokens": config["max_new_tokens"],
        "temperature": config["temperature"],
        "stop_token_ids": config["stop_token_ids"],
        "pad_token_id": config["_pad_token_id"],
        "hf_overrides": (config.get("vllm_kwargs") or {}).get("hf_overrides"),
    }


def install_generation_seam(algo_module) -> None:
    """``algo_module.VllmGeneration(cluster=..., config=...)`` → the real init up to its workers, then the CPU stand-in."""
    from cpu_host.generation import CpuHFGeneration, vllm_init_up_to_workers

    def vllm_generation(cluster, config, **kw):
        def on_workers(cluster_, builder, kwargs):
            record("vllm_arguments", **_vllm_arguments(config, cluster_, builder, kwargs))

        vllm_init_up_to_workers(cluster, config, on_workers, **kw)
        return CpuHFGeneration(config, refit=BUILT["refit"])

    algo_module.VllmGeneration = vllm_generation
    real_setup = algo_module.setup

    def setup(*args, **kwargs):
        master = args[0] if args else kwargs["master_config"]
        policy_cfg = master.policy if hasattr(master, "policy") else master["policy"]
        megatron = bool((policy_cfg.get("megatron_cfg") or {}).get("enabled"))
        # NeMo-RL v0.7.0 has no weight synchronizer (grpo's refit, which ppo uses too, goes through IPC/ZMQ
        # itself): then NeMo-RL's own path
        from cpu_host.refit import dtensor_refit_path

        BUILT["refit"] = "ipc_zmq" if megatron else dtensor_refit_path()
        out = real_setup(*args, **kwargs)
        policy, generation = out[0], out[1]
        sharding = policy.sharding_annotations  # the layout NeMo-RL's Policy built its workers with
        record(
            "policy_layout",
            workers=len(policy.worker_group.workers),
            **{name: sharding.get_axis_size(name) for name in sharding.names},
        )
        if isinstance(generation, CpuHFGeneration):
            generation.attach(policy)
        BUILT["generation"] = generation
        return out

    algo_module.setup = setup


def _stats(x, mask):
    import torch

    sel = x[mask]
    return {
        "finite": bool(torch.isfinite(x).all()),
        "n": int(sel.numel()),
        "min": float(sel.min()) if sel.numel() else None,
        "max": float(sel.max()) if sel.numel() else None,
        "mean": float(sel.float().mean()) if sel.numel() else None,
    }


def _logprobs_vs_hf(generation, data, mask) -> dict:
    """|worker π_old log-probs − a plain transformers forward of the same weights| on response
    tokens (the generation copy holds the weights of the last refit, i.e. π_old; same autocast)."""
    import torch

    ids, lengths = data["input_ids"], data["input_lengths"]
    att = (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).long()
    with torch.no_grad(), generation.precision():
        logits = generation.model(input_ids=ids, attention_mask=att).logits.float()
    # NeMo-RL's log-probs are those of softmax(logits / T) (apply_temperature_scaling)
    logp = torch.log_softmax(logits[:, :-1] / float(generation.cfg["temperature"]), -1)
    lp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    diff = (lp - data["prev_logprobs"][:, 1:].float()).abs()[mask[:, 1:]]
    out = {"max": float(diff.max()), "mean": float(diff.mean())}
    if "prev_entropy" in data:  # π_old entropy of the same distribution, token columns
        ent = -(logp.exp() * logp).sum(-1)
        d = (ent - data["prev_entropy"][:, 1:].float()).abs()[mask[:, 1:]]
        out["entropy_max"] = float(d.max())
    return out


def _collect_loss_records(n: int) -> int:
    """Move the loss records the policy workers wrote during ``Policy.train`` call ``n``
    (``cpu_host.hooks._record_policy_loss``) into their own folder; returns how many."""
    from pathlib import Path

    facts = os.environ.get("NEMO_GRANULAR_CPU_HOST_FACTS")
    if not facts:
        return 0
    src = Path(f"{facts}.loss")
    files = sorted(src.glob("*.pt")) if src.is_dir() else []
    dest = src / f"train_{n}"
    dest.mkdir(parents=True, exist_ok=True)
    for f in files:
        f.rename(dest / f.name)
    return len(files)


def install_train_recorder() -> None:
    """Record, for each ``Policy.train`` / ``Value.train`` call, the keys and checks of the batch it received."""
    import torch
    from nemo_rl.models.policy.lm_policy import Policy

    real_train = Policy.train
    calls = [0]

    def train(self, data, loss_fn, *args, **kwargs):
        mask = data["token_mask"].bool() if "token_mask" in data else None
        fact = {"loss_fn": type(loss_fn).__name__, "keys": sorted(data.keys()), "shape": list(data["input_ids"].shape)}
        if mask is not None:
            fact["response_tokens"] = int((mask & data["sample_mask"].bool()[:, None]).sum())
        if "prev_entropy" in data:
            fact["prev_entropy"] = _stats(data["prev_entropy"], mask)
            cols = torch.arange(mask.shape[1])[None, :]
            outside = (cols == 0) | (cols >= data["input_lengths"][:, None])
            fact["prev_entropy_zero_outside_sequence"] = bool((data["prev_entropy"][outside] == 0).all())
        if "granular_group_ids" in data:
            ids = data["granular_group_ids"]
            fact["group_ids"] = {
                "outside_is_minus_one": bool((ids[~mask] == -1).all()),
                "inside_nonneg": bool((ids[mask] >= 0).all()),
                "max": int(ids.max()),
                "rows_with_two_groups": int(((ids.max(1).values) >= 1).sum()),
            }
        if "prev_logprobs" in data and "generation" in BUILT:
            fact["prev_logprobs_vs_hf"] = _logprobs_vs_hf(BUILT["generation"], data, mask)
        if "advantages" in data:
            fact["advantages_nonzero"] = int((data["advantages"][mask] != 0).sum())
        if "values" in data and "rewards" in data and mask is not None:
            # PPO: per row, what the estimator read (the critic logit at the first response column, the
            # reward) and the advantage it wrote there, for the test's own A = R − σ(v)
            has = mask.any(-1)
            first = torch.argmax(mask.to(torch.int8), dim=-1)

            def at(x, first=first):
                return x.double().reshape(x.shape[0], -1).gather(1, first[:, None]).squeeze(1)

            fact["critic_rows"] = {
                "has_response": has.tolist(),
                "sample_mask": data["sample_mask"].tolist(),
                "rewards": data["rewards"].double().reshape(-1).tolist(),
                "value_logit": at(data["values"]).tolist(),
                "advantage": at(data["advantages"]).tolist(),
                "advantage_constant_per_row": bool(
                    all(
                        (data["advantages"][b][mask[b]] == data["advantages"][b][first[b]]).all()
                        for b in range(mask.shape[0])
                    )
                ),
            }
        _collect_loss_records(-1)  # anything written outside a train call is not this call's
        out = real_train(self, data, loss_fn, *args, **kwargs)
        fact["loss"] = float(torch.as_tensor(out["loss"]).float().mean())
        fact["grad_norm"] = float(torch.as_tensor(out["grad_norm"]).float().max())
        fact["loss_records"] = _collect_loss_records(calls[0])
        fact["train_call"] = calls[0]
        calls[0] += 1
        record("policy_train", **fact)
        return out

    Policy.train = train

    from nemo_rl.models.value.lm_value import Value

    real_value_train = Value.train

    def value_train(self, data, loss_fn, *args, **kwargs):
        fact = {"loss_fn": type(loss_fn).__name__, "keys": sorted(data.keys()), "shape": list(data["input_ids"].shape)}
        out = real_value_train(self, data, loss_fn, *args, **kwargs)
        fact["loss"] = float(torch.as_tensor(out["loss"]).float().mean())
        record("value_train", **fact)
        return out

    Value.train = value_train


def install_environment_recorder() -> None:
    """The environment actor each task's data goes to (``setup_response_data``'s ``task_to_env``)."""
    import nemo_rl.data.utils as data_utils

    real = data_utils.setup_response_data

    def setup_response_data(*args, **kwargs):
        out = real(*args, **kwargs)
        record("environments", train={k: repr(v) for k, v in out[2].items()})
        return out

    data_utils.setup_response_data = setup_response_data


def install_refit_recorder() -> None:
    """After each refit: a digest of the generation model's weights (they are the policy's), and the whole
    state dict in ``$NEMO_GRANULAR_CPU_HOST_FACTS.refit/sync_<n>.safetensors``."""
    import torch

    from cpu_host.generation import CpuHFGeneration

    real = CpuHFGeneration.load_weights

    def load_weights(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        facts = os.environ.get("NEMO_GRANULAR_CPU_HOST_FACTS")
        if facts:  # the whole state dict the generation now holds, for the export test
            from safetensors.torch import save_file

            folder = f"{facts}.refit"
            os.makedirs(folder, exist_ok=True)
            save_file(
                {k: v.detach().contiguous() for k, v in self.model.state_dict().items()},
                os.path.join(folder, f"sync_{self.syncs}.tmp"),
            )
            os.replace(
                os.path.join(folder, f"sync_{self.syncs}.tmp"), os.path.join(folder, f"sync_{self.syncs}.safetensors")
            )
        params = torch.cat([p.detach().float().flatten() for p in self.model.parameters()])
        record(
            "refit",
            sync=self.syncs,
            norm=float(params.norm()),
            head=params[:8].tolist(),
            sum=float(params.double().sum()),
            refit=self.last_refit,
            workers_agree=self.refit_agreement[-1] if self.refit_agreement else None,
        )
        return out

    CpuHFGeneration.load_weights = load_weights


def main(argv: list[str]) -> int:
    which, rest = argv[0], argv[1:]
    if which == "grpo":
        import nemo_rl.algorithms.grpo as algo

        from nemo_granular import run_grpo as launcher
    elif which == "sppo":
        from cpu_host.hooks import PPO_LOSSES_ENV

        os.environ[PPO_LOSSES_ENV] = "1"  # the workers (which copy this environment) record both PPO losses
        import nemo_rl.algorithms.ppo as algo

        from nemo_granular import run_sppo as launcher
    else:
        raise SystemExit(f"usage: python -m cpu_host.launch {{grpo|sppo}} --config ... (got {which!r})")
    install_generation_seam(algo)
    install_train_recorder()
    install_refit_recorder()
    install_environment_recorder()
    return launcher.main(rest)


if __name__ == "__main__":
    try:
        code = main(sys.argv[1:])
    except BaseException:  # noqa: BLE001 - any failure ends the driver hard (no Ray left behind)
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
