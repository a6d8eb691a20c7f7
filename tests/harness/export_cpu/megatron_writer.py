"""Write NeMo-RL Megatron checkpoints of tiny HF models on CPU: one gloo rank per process.

    python tests/harness/export_cpu/megatron_writer.py RANK WORLD PORT JOBS_JSON

``JOBS_JSON`` is a list of ``{"hf_dir", "checkpoint_dir", "step", "tp", "pp", "ep", "precision"}``
(+ optional ``"hf_config_overrides"``, set as ``policy.hf_config_overrides``); all ranks run every
job. A job with ``"config"`` (a run's whole resolved config, e.g. from a stand-in driver) uses it
instead of the recipe, keeps its model name, precision and overrides, and loads the weights of
``hf_dir`` (the run's "trained" weights; same architecture); optional ``"training_info"`` (what
``init_tmp_checkpoint`` records) and ``"scratch_dir"`` (where the HF import goes; default: next to
``checkpoint_dir``). Per job, the steps NeMo-RL's Megatron policy worker takes, with its code:

1. HF → Megatron import, once per HF model: ``community_import.import_model_from_hf_name`` with
   the job's ``megatron_cfg`` (what ``setup.handle_model_import`` runs, collectively);
2. ``setup.setup_model_config`` on NeMo-RL's Qwen3-30B-A3B recipe
   (``examples/configs/grpo_math_qwen30ba3b_megatron.yaml``) with the job's model, precision and
   TP/EP → Megatron-Bridge ``ConfigContainer`` + model provider;
3. the provider builds the model at that TP/EP and loads the imported checkpoint (Bridge's
   weight loader: the EP1 import is resharded onto the job's layout);
4. ``CheckpointManager.init_tmp_checkpoint`` (``tmp_step_N/{training_info.json, config.yaml}``),
   Bridge's ``save_checkpoint(state, [model], ...)`` into ``tmp_step_N/policy/weights`` — the call
   ``MegatronPolicyWorkerImpl.save_checkpoint`` makes — and ``finalize_checkpoint`` (→ ``step_N``).

Not done: DDP wrapping, the optimizer and its state (the export reads model weights only), the
tokenizer (the Megatron worker does not save one). CPU stand-ins: :mod:`cpu_stand_ins`.
Everything heavy is imported inside ``main`` (Bridge's checkpoint save starts a ``spawn`` process
that re-imports this module).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

RECIPE = "examples/configs/grpo_math_qwen30ba3b_megatron.yaml"


def policy_config(job: dict) -> dict:
    """NeMo-RL's Qwen3-30B-A3B Megatron recipe, resolved, with the job's model and layout."""
    from nemo_rl.utils.config import load_config, register_omegaconf_resolvers
    from omegaconf import OmegaConf

    register_omegaconf_resolvers()
    if "config" in job:  # a run's own config: its model, precision and overrides
        cfg = OmegaConf.create(job["config"])
        p = cfg.policy
        if p.get("hf_config_overrides") is None:
            p.hf_config_overrides = {}
        p.megatron_cfg.context_parallel_size = 1  # one process per model replica here
    else:
        cfg = load_config(os.path.join(os.environ["NEMO_RL_SRC"], RECIPE))
        p = cfg.policy
        p.model_name = job["hf_dir"]
        p.tokenizer.name = job["hf_dir"]
        p.precision = job["precision"]
        p.hf_config_overrides = job.get("hf_config_overrides") or {}
    m = p.megatron_cfg
    m.tensor_model_parallel_size = job["tp"]
    m.pipeline_model_parallel_size = job["pp"]
    m.expert_model_parallel_size = job["ep"]
    m.expert_tensor_parallel_size = 1
    m.train_iters = 10  # set by GRPO's setup in a real run
    # config-level CPU settings (layout-neutral): the local spec's torch norms refuse sequence
    # parallelism; the fusions need TE; async save needs nvidia-resiliency-ext
    m.sequence_parallel = False
    m.apply_rope_fusion = False
    m.moe_permute_fusion = False
    m.bias_activation_fusion = False
    m.checkpoint.async_save = False
    m.optimizer.bf16 = p.precision == "bfloat16"
    cfg.checkpointing.checkpoint_dir = job["checkpoint_dir"]
    return OmegaConf.to_container(cfg, resolve=True)


def main(argv: list[str]) -> None:
    rank, world, port, jobs = int(argv[0]), int(argv[1]), argv[2], json.loads(argv[3])
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/harness/, as under pytest
    import cpu_stand_ins

    cpu_stand_ins.install()
    print(f"[megatron_writer rank {rank}] imports done", flush=True)

    import torch
    import torch.distributed as dist
    from megatron.bridge.training.checkpointing import (
        _load_model_weights_from_checkpoint,
        init_checkpointing_context,
        save_checkpoint,
    )
    from megatron.bridge.training.state import GlobalState
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom
    from nemo_rl.models.megatron import setup as nrl_setup
    from nemo_rl.models.megatron.community_import import import_model_from_hf_name
    from nemo_rl.utils.checkpoint import CheckpointManager
    from pydantic import BaseModel

    class RunConfig(BaseModel, extra="allow"):
        """What ``init_tmp_checkpoint`` dumps (NeMo-RL passes its MasterConfig, a pydantic model)."""

    start = time.time()

    def progress(what: str) -> None:  # timestamps in the rank's log
        print(f"[megatron_writer rank {rank}] {time.time() - start:6.1f}s {what}", flush=True)

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    imported: dict[str, str] = {}
    for job in jobs:
        config = policy_config(job)
        pcfg = config["policy"]
        dtype = torch.bfloat16 if pcfg["precision"] == "bfloat16" else torch.float32
        overrides = pcfg["hf_config_overrides"]
        key = json.dumps([job["hf_dir"], overrides], sort_keys=True)
        pretrained = imported.get(key)
        if pretrained is None:  # NeMo-RL caches the import per model and overrides; same here
            scratch = Path(job.get("scratch_dir") or Path(job["checkpoint_dir"]).parent)
            pretrained = imported[key] = str(scratch / f"pretrained-{len(imported)}")
            # what setup.handle_model_import runs: the overrides go to AutoBridge.from_hf_pretrained
            import_model_from_hf_name(job["hf_dir"], pretrained, pcfg["megatron_cfg"], **overrides)
            if parallel_state.model_parallel_is_initialized():
                parallel_state.destroy_model_parallel()
            progress(f"imported {job['hf_dir']}")
        megatron_cfg, model_cfg = nrl_setup.setup_model_config(pcfg, rank, dtype, job["hf_dir"], pretrained)
        model_cfg.initialize_model_parallel(seed=0)
        model = model_cfg.provide_distributed_model(wrap_with_ddp=False)
        _load_model_weights_from_checkpoint(os.path.join(pretrained, "iter_0000000"), model)
        progress(f"built TP{job['tp']} PP{job['pp']} EP{job['ep']} {pcfg['precision']}")

        manager = CheckpointManager(config["checkpointing"])
        tmp = Path(job["checkpoint_dir"]) / f"tmp_step_{job['step']}"
        if rank == 0:
            info = job.get("training_info") or {"step": job["step"], "consumed_samples": 0}
            # config.yaml: the run's config as given (not the CPU layout), as NeMo-RL records its MasterConfig
            manager.init_tmp_checkpoint(job["step"], info, RunConfig(**job.get("config", config)))
        dist.barrier()
        state = GlobalState()
        state.cfg = megatron_cfg
        megatron_cfg.checkpoint.save = str(tmp / "policy" / "weights")
        save_checkpoint(
            state=state,
            model=model,
            optimizer=None,
            opt_param_scheduler=None,
            num_floating_point_operations_so_far=0,
            checkpointing_context=init_checkpointing_context(megatron_cfg.checkpoint),
        )
        dist.barrier()
        if rank == 0:
            manager.finalize_checkpoint(tmp)
        progress(f"saved {job['checkpoint_dir']}")
        dist.barrier()
        parallel_state.destroy_model_parallel()
        mrandom._CUDA_RNG_STATE_TRACKER = None
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
