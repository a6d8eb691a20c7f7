"""vLLM stand-in for the loops on CPU: NeMo-RL's ``GenerationInterface`` with transformers ``generate``.

Test code only (vLLM needs a GPU). :class:`CpuHFGeneration` lives in the driver process and
holds a transformers copy of the policy (read from ``policy.model_name``). Whenever the policy
trained, ``grpo_train`` / ``ppo_train`` refit it with the training workers' current weights
(:mod:`cpu_host.refit`: NeMo-RL's ZMQ refit for the Megatron worker, a ``WeightSynchronizer``
through ``save_checkpoint`` for the DTensor worker). Output follows
``GenerationOutputSpec``: right-padded ``output_ids``, lengths, ``truncated`` and the log-probs
of the sampled tokens under softmax(logits / T), as the training side computes them.

Sampling is a deterministic function of (prompts, weights): the RNG is seeded from a digest of
both, so a run resumed from a checkpoint samples what the uninterrupted run sampled.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import zlib
from pathlib import Path

import torch


class VllmWorkersReached(Exception):
    """Raised where ``VllmGeneration.__init__`` would start its vLLM workers."""


def vllm_init_up_to_workers(cluster, config, on_workers=None, **kw) -> None:
    """NeMo-RL's real ``VllmGeneration.__init__`` (its config checks, cluster and placement logic)
    up to the point where it creates its worker group (vLLM's GPU workers), then stop;
    ``on_workers(cluster, builder, kwargs)`` sees the arguments of that call."""
    from nemo_rl.models.generation.vllm import vllm_generation as vg

    real_cls, real_group = vg.VllmGeneration, vg.RayWorkerGroup

    def reached(cluster_, builder, **kwargs):
        if on_workers is not None:
            on_workers(cluster_, builder, kwargs)
        raise VllmWorkersReached

    vg.RayWorkerGroup = reached
    half_built = real_cls.__new__(real_cls)
    half_built.shutdown = lambda: True  # its __del__ would shut down workers it never had
    try:
        half_built.__init__(cluster=cluster, config=config, **kw)
        raise AssertionError("VllmGeneration.__init__ never created its worker group")
    except VllmWorkersReached:
        pass
    finally:
        vg.RayWorkerGroup = real_group


def _digest(model: torch.nn.Module, input_ids: torch.Tensor) -> int:
    h = zlib.crc32(input_ids.to(torch.int64).numpy().tobytes())
    for p in model.parameters():
        h = zlib.crc32(p.detach().float().numpy().tobytes(), h)
    return h


class CpuHFGeneration:
    """``GenerationInterface`` on CPU (transformers ``generate``), built from NeMo-RL's generation config."""

    def __init__(self, config: dict, refit: str = "checkpoint"):
        """``refit``: ``"checkpoint"`` (a ``weight_synchronizer``) or ``"ipc_zmq"`` (none: ``grpo_train``
        runs NeMo-RL's colocated refit, which calls :meth:`update_weights_via_ipc_zmq`)."""
        from transformers import AutoModelForCausalLM

        from cpu_host.refit import StateDictSynchronizer

        self.cfg = config
        self.model_dir = config["model_name"]
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32).eval()
        self.pad_id = int(config["_pad_token_id"])
        self.stop_ids = [int(t) for t in (config.get("stop_token_ids") or [])]
        # vLLM runs the policy in policy.precision: emulated with CPU autocast
        self.autocast_dtype = getattr(torch, (config.get("vllm_cfg") or {}).get("precision") or "float32")
        self.weight_synchronizer = StateDictSynchronizer(self) if refit == "checkpoint" else None
        self.refit_addresses: list[str] | None = None  # the policy workers' ZMQ sockets (attach)
        self.state_dict_info: dict | None = None
        self.syncs = 0
        self.refit_agreement: list[float] = []  # max |worker i − worker 0| per ZMQ refit
        # how the last weights arrived: {"path", "workers", "tensors", "payloads"}, set by the receiving code
        self.last_refit: dict | None = None
        self.calls: list[dict] = []

    def attach(self, policy) -> None:
        """After ``setup()``: the policy the refit reads from."""
        if self.weight_synchronizer is not None:
            self.weight_synchronizer.policy = policy
        else:
            import ray

            # asked now: during a refit the workers are busy streaming (an actor runs one call at a time)
            self.refit_addresses = ray.get(policy.worker_group.run_all_workers_single_data("get_zmq_address"))

    def update_weights_via_ipc_zmq(self) -> list:
        """vLLM's receiving side of the colocated refit (the workers are already streaming)."""
        import ray

        from cpu_host.refit import IpcZmqReceiver

        if self.refit_addresses is None or self.state_dict_info is None:
            raise RuntimeError("refit before attach() / prepare_refit_info()")
        receiver = IpcZmqReceiver(self.refit_addresses, self.state_dict_info)
        per_worker = receiver.receive()
        first = per_worker[0]
        if set(first) != set(self.state_dict_info):
            raise RuntimeError(f"refit: {len(first)} tensors received, {len(self.state_dict_info)} announced")
        # every worker sends the whole HF model (Bridge gathers the tensor/expert-parallel shards)
        self.refit_agreement.append(
            max(
                (float((w[k].float() - first[k].float()).abs().max()) for w in per_worker[1:] for k in first),
                default=0.0,
            )
        )
        self.last_refit = {
            "path": "ipc_zmq",
            "workers": len(per_worker),
            "tensors": [len(w) for w in per_worker],
            "payloads": receiver.payloads,
        }
        scratch = Path(tempfile.mkdtemp(prefix="refit_"))
        try:
            self.load_weights(first, scratch)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return [ray.put(True)]

    def load_weights(self, state_dict: dict, scratch) -> None:
        """A new transformers model of ``model_name``'s config with ``state_dict`` (HF names; transformers
        converts checkpoint layouts it knows, e.g. per-expert MoE weights)."""
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM

        scratch = Path(scratch)
        scratch.mkdir(parents=True, exist_ok=True)
        for name in ("config.json", "generation_config.json"):
            if (Path(self.model_dir) / name).is_file():
                shutil.copy(Path(self.model_dir) / name, scratch / name)
        save_file({k: v.detach().contiguous() for k, v in state_dict.items()}, str(scratch / "model.safetensors"))
        model, info = AutoModelForCausalLM.from_pretrained(str(scratch), dtype=torch.float32, output_loading_info=True)
        if info["missing_keys"] or info["unexpected_keys"]:
            raise RuntimeError(
                f"refit: weights do not fit the model (missing {sorted(info['missing_keys'])[:4]}, "
                f"unexpected {sorted(info['unexpected_keys'])[:4]})"
            )
        self.model = model.eval()
        self.syncs += 1

    def precision(self):
        if self.autocast_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast("cpu", dtype=self.autocast_dtype)

    # -- lifecycle (nothing to move on CPU) ------------------------------------------------------------
    def init_collective(self, *args, **kwargs):
        return []

    def prepare_refit_info(self, state_dict_info) -> None:
        """The policy's refit metadata (HF name → shape, dtype), handed over by NeMo-RL's setup; the
        ZMQ refit cuts the staging buffers with it."""
        self.state_dict_info = dict(state_dict_info or {})

    def prepare_for_generation(self, *args, **kwargs) -> bool:
        return True

    def finish_generation(self, *args, **kwargs) -> bool:
        return True

    def shutdown(self) -> bool:
        return True

    @property
    def requires_kv_scale_sync(self) -> bool:
        return False

    def invalidate_kv_cache(self) -> bool:
        return False

    def blocks_training(self) -> bool:
        return False

    def wake_carries_weight_updates(self) -> bool:
        return False

    def clear_logger_metrics(self) -> None:
        return None

    def get_logger_metrics(self) -> dict:
        return {}

    # -- generation -------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, data, greedy: bool = False):
        from nemo_rl.distributed.batched_data_dict import BatchedDataDict

        ids, lengths = data["input_ids"].cpu(), data["input_lengths"].cpu().long()
        B, L = ids.shape
        engine = self.cfg.get("vllm_cfg") or {}
        max_total = int(engine.get("max_model_len") or self.cfg["max_total_sequence_length"])
        max_new = min(int(self.cfg["max_new_tokens"]), max_total - int(lengths.max()))
        # right-padded → left-padded for a batched decoder-only generate
        left = torch.full((B, L), self.pad_id, dtype=ids.dtype)
        mask = torch.zeros((B, L), dtype=torch.long)
        for i in range(B):
            n = int(lengths[i])
            left[i, L - n :] = ids[i, :n]
            mask[i, L - n :] = 1
        temperature = float(self.cfg["temperature"])
        top_k = self.cfg.get("top_k")
        kwargs = dict(
            max_new_tokens=max_new,
            min_new_tokens=0,
            pad_token_id=self.pad_id,
            eos_token_id=self.stop_ids or None,
            return_dict_in_generate=True,
            output_logits=True,
            do_sample=not greedy,
        )
        if not greedy:
            kwargs.update(
                temperature=temperature,
                top_p=float(self.cfg["top_p"]),
                top_k=int(top_k) if top_k not in (None, -1) else 0,
            )
        with torch.random.fork_rng(devices=[]), self.precision():
            torch.manual_seed(_digest(self.model, ids))
            out = self.model.generate(input_ids=left, attention_mask=mask, **kwargs)
        new = out.sequences[:, L:]  # [B, T]
        logits = torch.stack(out.logits, dim=1).float()  # [B, T, V]
        logp = torch.log_softmax(logits / (1.0 if greedy else temperature), dim=-1)
        tok_logp = logp.gather(-1, new.unsqueeze(-1)).squeeze(-1)
        T = new.shape[1]
        is_stop = torch.zeros_like(new, dtype=torch.bool)
        for s in self.stop_ids:
            is_stop |= new == s
        # length = up to and including the first stop token
        first_stop = torch.where(is_stop.any(1), is_stop.float().argmax(1) + 1, torch.full((B,), T))
        gen_len = first_stop.long()
        width = L + T
        out_ids = torch.full((B, width), self.pad_id, dtype=ids.dtype)
        out_logp = torch.zeros((B, width), dtype=torch.float32)
        for i in range(B):
            n, g = int(lengths[i]), int(gen_len[i])
            out_ids[i, :n] = ids[i, :n]
            out_ids[i, n : n + g] = new[i, :g]
            out_logp[i, n : n + g] = tok_logp[i, :g]
        truncated = ~is_stop.any(1)
        self.calls.append({"rows": B, "max_new": max_new, "greedy": greedy})
        return BatchedDataDict(
            output_ids=out_ids,
            generation_lengths=gen_len,
            unpadded_sequence_lengths=lengths + gen_len,
            logprobs=out_logp,
            truncated=truncated,
        )
