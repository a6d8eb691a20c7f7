"""vLLM stand-in for the loops on CPU: NeMo-RL's ``GenerationInterface`` with transformers ``generate``.

Test code only (vLLM needs a GPU). :class:`CpuHFGeneration` lives in the driver process and
holds a transformers copy of the policy (read from ``policy.model_name``). Its
:class:`StateDictSynchronizer` is a real NeMo-RL ``WeightSynchronizer``: ``grpo_train`` /
``ppo_train`` call ``sync_weights`` whenever the policy trained (the refit), and it brings the
training workers' current weights into the generation model. Output follows
``GenerationOutputSpec``: right-padded ``output_ids``, lengths, ``truncated`` and the log-probs
of the sampled tokens under softmax(logits / T), as the training side computes them.

Sampling is a deterministic function of (prompts, weights): the RNG is seeded from a digest of
both, so a run resumed from a checkpoint samples what the uninterrupted run sampled.
"""

from __future__ import annotations

import zlib
import torch


def _digest(model: torch.nn.Module, input_ids: torch.Tensor) -> int:
    h = zlib.crc32(input_ids.to(torch.int64).numpy().tobytes())
    for p in model.parameters():
        h = zlib.crc32(p.detach().float().numpy().tobytes(), h)
    return h


def _weight_synchronizer_base():
    from nemo_rl.weight_sync.interfaces import WeightSynchronizer

    return WeightSynchronizer


REFIT_CHECKPOINT = {"model_save_format": "safetensors", "save_consolidated": False}


class StateDictSynchronizer(_weight_synchronizer_base()):
    """Refit on CPU: the training workers' weights → the generation model, through NeMo-RL's own
    ``Policy.save_checkpoint`` (every rank its FSDP shard, Automodel's HF key names, custom
    models such as Automodel's Qwen3-MoE converted by its state-dict adapter) read back whole
    with the export reader, then loaded by transformers (no CUDA IPC / NCCL on CPU)."""

    def __init__(self, generation: "CpuHFGeneration"):
        self.generation = generation
        self.policy = None            # set once setup() built the policy (the test launcher does it)
        self.syncs = 0
        self._stale = True

    @property
    def is_stale(self) -> bool:
        return self._stale

    def init_communicator(self) -> None:
        return None

    def sync_weights(self, *, timer=None, kv_scales=None):
        import shutil
        import tempfile
        from pathlib import Path

        from nemo_granular.export.dcp import find_dcp_dir, read_dcp

        if self.policy is None:
            raise RuntimeError("StateDictSynchronizer: no policy attached (the launcher attaches it after setup())")
        scratch = Path(tempfile.mkdtemp(prefix="refit_"))
        try:
            # every rank writes its shard through NeMo-RL's own save path (HF key names)
            self.policy.save_checkpoint(weights_path=str(scratch / "weights"), checkpointing_cfg=REFIT_CHECKPOINT)
            path, layout = find_dcp_dir(scratch / "weights")
            full = read_dcp(path, safetensors=layout == "safetensors")
            self.generation.load_weights(full, scratch / "hf")
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        self.syncs += 1
        self._stale = False
        return {"cpu_refit_tensors": float(len(full))}

    def shutdown(self) -> None:
        return None


class CpuHFGeneration:
    """``GenerationInterface`` on CPU (transformers ``generate``), built from NeMo-RL's generation config."""

    def __init__(self, config: dict):
        from transformers import AutoModelForCausalLM

        self.cfg = config
        self.model_dir = config["model_name"]
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32).eval()
        self.pad_id = int(config["_pad_token_id"])
        self.stop_ids = [int(t) for t in (config.get("stop_token_ids") or [])]
        # vLLM runs the policy in policy.precision: emulated with CPU autocast
        self.autocast_dtype = getattr(torch, (config.get("vllm_cfg") or {}).get("precision") or "float32")
        self.weight_synchronizer = StateDictSynchronizer(self)
        self.calls: list[dict] = []

    def load_weights(self, state_dict: dict, scratch) -> None:
        """A new transformers model of ``model_name``'s config with ``state_dict`` (HF names; transformers
        converts checkpoint layouts it knows, e.g. per-expert MoE weights)."""
        import shutil
        from pathlib import Path

        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM

        scratch = Path(scratch)
        scratch.mkdir(parents=True, exist_ok=True)
        for name in ("config.json", "generation_config.json"):
            if (Path(self.model_dir) / name).is_file():
                shutil.copy(Path(self.model_dir) / name, scratch / name)
        save_file({k: v.detach().contiguous() for k, v in state_dict.items()}, str(scratch / "model.safetensors"))
        model, info = AutoModelForCausalLM.from_pretrained(str(scratch), dtype=torch.float32,
                                                           output_loading_info=True)
        if info["missing_keys"] or info["unexpected_keys"]:
            raise RuntimeError(f"refit: weights do not fit the model (missing {sorted(info['missing_keys'])[:4]}, "
                               f"unexpected {sorted(info['unexpected_keys'])[:4]})")
        self.model = model.eval()

    def precision(self):
        import contextlib

        if self.autocast_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast("cpu", dtype=self.autocast_dtype)

    # -- lifecycle (nothing to move on CPU) ------------------------------------------------------------
    def init_collective(self, *args, **kwargs):
        return []

    def prepare_refit_info(self, state_dict_info) -> None:
        """NeMo-RL's PPO setup always hands the policy's refit metadata over; the CPU refit needs none."""
        self.refit_info_keys = len(state_dict_info or {})

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
            left[i, L - n:] = ids[i, :n]
            mask[i, L - n:] = 1
        temperature = float(self.cfg["temperature"])
        top_k = self.cfg.get("top_k")
        kwargs = dict(max_new_tokens=max_new, min_new_tokens=0, pad_token_id=self.pad_id,
                      eos_token_id=self.stop_ids or None, return_dict_in_generate=True, output_logits=True,
                      do_sample=not greedy)
        if not greedy:
            kwargs.update(temperature=temperature, top_p=float(self.cfg["top_p"]),
                          top_k=int(top_k) if top_k not in (None, -1) else 0)
        with torch.random.fork_rng(devices=[]), self.precision():
            torch.manual_seed(_digest(self.model, ids))
            out = self.model.generate(input_ids=left, attention_mask=mask, **kwargs)
        new = out.sequences[:, L:]                                   # [B, T]
        logits = torch.stack(out.logits, dim=1).float()              # [B, T, V]
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
            out_ids[i, n:n + g] = new[i, :g]
            out_logp[i, n:n + g] = tok_logp[i, :g]
        truncated = ~is_stop.any(1)
        self.calls.append({"rows": B, "max_new": max_new, "greedy": greedy})
        return BatchedDataDict(output_ids=out_ids, generation_lengths=gen_len, unpadded_sequence_lengths=lengths + gen_len,
                               logprobs=out_logp, truncated=truncated)
