"""Write NeMo-RL DTensor-v2 checkpoints of tiny HF models on CPU: one gloo rank per process.

    python tests/harness/export_cpu/automodel_writer.py RANK WORLD PORT JOBS_JSON

``JOBS_JSON`` is a list of ``{"hf_dir", "checkpoint_dir", "step", "ep", "formats"}``; all ranks run
every job, saving the model once per ``checkpointing.model_save_format`` in ``formats``
(``checkpoint_dir/<format>/step_N``). Per job, the steps ``DTensorPolicyWorkerV2`` takes, with
NeMo-RL's and Automodel's code:

1. ``FSDP2Config`` + Automodel's ``create_device_mesh`` as in NeMo-RL's
   ``automodel/setup.setup_distributed`` (backend ``gloo`` → a CPU mesh; the worker says ``nccl``);
2. ``NeMoAutoModelForCausalLM.from_pretrained(hf_dir, device_mesh, moe_mesh, distributed_config, ...)``:
   Automodel's own Qwen3-MoE implementation (its registry entry, as NeMo-RL gets it), FSDP2
   ``fully_shard`` over the 2 ranks (and experts over ``ep`` ranks when ``ep > 1``), HF weights loaded;
3. NeMo-RL's ``AutomodelCheckpointManager`` (``init_checkpointer`` with the worker's
   ``config_updates``), ``CheckpointManager.init_tmp_checkpoint``, the manager's ``save_checkpoint``
   with ``checkpointing_cfg`` = the recipe's ``checkpointing`` section, and ``finalize_checkpoint``.

The checkpointer is initialised with the worker's ``is_async: True``. Automodel turns async off here
(its version check compares strings: ``"2.13.0" >= "2.9.0"`` is False); ``async_wait`` is called
before the rename anyway, so an asynchronous save could not be renamed mid-write.
CPU stand-ins: :mod:`cpu_stand_ins`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

RECIPE = "examples/configs/grpo_math_1B.yaml"


def run_config(job: dict, checkpoint_dir: str, model_save_format: str) -> dict:
    """NeMo-RL's DTensor GRPO recipe, resolved, with the job's model and checkpoint settings."""
    from nemo_rl.utils.config import load_config, register_omegaconf_resolvers
    from omegaconf import OmegaConf

    register_omegaconf_resolvers()
    cfg = load_config(os.path.join(os.environ["NEMO_RL_SRC"], RECIPE))
    cfg.policy.model_name = job["hf_dir"]
    cfg.policy.tokenizer.name = job["hf_dir"]
    cfg.policy.precision = "float32"
    cfg.policy.dtensor_cfg.expert_parallel_size = job["ep"]
    cfg.checkpointing.checkpoint_dir = checkpoint_dir
    cfg.checkpointing.model_save_format = model_save_format
    return OmegaConf.to_container(cfg, resolve=True)


def main(argv: list[str]) -> None:
    rank, world, port, jobs = int(argv[0]), int(argv[1]), argv[2], json.loads(argv[3])
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/harness/, as under pytest
    import cpu_stand_ins

    cpu_stand_ins.install()
    start = time.time()

    def progress(what: str) -> None:
        print(f"[automodel_writer rank {rank}] {time.time() - start:6.1f}s {what}", flush=True)

    import torch
    import torch.distributed as dist
    from nemo_automodel import NeMoAutoModelForCausalLM
    from nemo_automodel.components.distributed.config import FSDP2Config
    from nemo_automodel.components.distributed.mesh_utils import create_device_mesh
    from nemo_automodel.components.moe.config import MoEParallelizerConfig
    from nemo_rl.models.automodel.checkpoint import AutomodelCheckpointManager
    from nemo_rl.utils.checkpoint import CheckpointManager
    from pydantic import BaseModel
    from torch.distributed.checkpoint.planner import SavePlanner
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from transformers import AutoTokenizer

    class RunConfig(BaseModel, extra="allow"):
        """What ``init_tmp_checkpoint`` dumps (NeMo-RL passes its MasterConfig, a pydantic model)."""

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    progress("imports done")
    for job in jobs:
        fsdp2_config = FSDP2Config(
            sequence_parallel=False,
            tp_plan=None,
            mp_policy=MixedPrecisionPolicy(
                param_dtype=torch.float32, reduce_dtype=torch.float32, output_dtype=torch.float32
            ),
            offload_policy=None,
            activation_checkpointing=False,
            defer_fsdp_grad_sync=True,
            backend="gloo",
        )
        device_mesh, moe_mesh = create_device_mesh(
            fsdp2_config, dp_replicate_size=1, tp_size=1, pp_size=1, cp_size=1, ep_size=job["ep"], world_size=world
        )
        model = NeMoAutoModelForCausalLM.from_pretrained(
            job["hf_dir"],
            device_mesh=device_mesh,
            moe_mesh=moe_mesh,
            distributed_config=fsdp2_config,
            moe_config=MoEParallelizerConfig() if job["ep"] > 1 else None,
            activation_checkpointing=False,
            attn_implementation="sdpa",
            torch_dtype="torch.float32",
            trust_remote_code=True,
            use_liger_kernel=False,
        )
        dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
        progress(f"built {type(model).__name__} EP{job['ep']} ({'/'.join(dtypes)} parameters)")
        tokenizer = AutoTokenizer.from_pretrained(job["hf_dir"])
        manager = AutomodelCheckpointManager(dp_mesh=device_mesh["dp"], tp_mesh=device_mesh["tp"], moe_mesh=moe_mesh)
        manager.init_checkpointer(
            config_updates={
                "model_repo_id": job["hf_dir"],
                "dequantize_base_checkpoint": False,
                "is_peft": False,
                "is_async": True,
            }
        )  # the worker's own values
        for fmt in job["formats"]:
            # a run saves in one format; saving twice from one process needs torch's process-wide
            # DCP plan cache (keyed by planner class, filled by enable_plan_caching) emptied first
            for cache in (
                SavePlanner._cached_save_plan,
                SavePlanner._cached_all_plans,
                SavePlanner._cached_global_plan,
                SavePlanner._cached_metadata,
                SavePlanner._cached_final_save_plan,
            ):
                cache.clear()
            checkpoint_dir = str(Path(job["checkpoint_dir"]) / fmt)
            config = run_config(job, checkpoint_dir, fmt)
            ckpt = CheckpointManager(config["checkpointing"])
            tmp = Path(checkpoint_dir) / f"tmp_step_{job['step']}"
            if rank == 0:
                ckpt.init_tmp_checkpoint(job["step"], {"step": job["step"], "consumed_samples": 0}, RunConfig(**config))
            dist.barrier()
            manager.save_checkpoint(
                model=model,
                weights_path=str(tmp / "policy" / "weights"),
                tokenizer=tokenizer,
                tokenizer_path=str(tmp / "policy" / "tokenizer"),
                checkpointing_cfg=config["checkpointing"],
            )
            manager.checkpointer.async_wait()  # no-op for a synchronous save
            dist.barrier()
            if rank == 0:
                ckpt.finalize_checkpoint(tmp)
            dist.barrier()
            progress(f"saved {checkpoint_dir} ({fmt})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
