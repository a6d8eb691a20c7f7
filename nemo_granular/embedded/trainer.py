"""The embedded RL trainer: NeMo-RL's GRPO/PPO step on one machine, calling the same plugin objects.

Per step: sample prompts (a pure function of (seed, step): the data position is the step),
G responses each (N = 1 for SPPO), verify, π_old logprobs AND entropy in one pass, group ids,
advantages through the estimator's ``compute_advantage``, then several optimizer steps per
rollout (minibatches), each split into microbatches that call ``GranularPolicyLoss`` with
NeMo-RL's keys, ``[:, 1:]`` shift and global normalisation. SPPO's critic is trained on the
deduplicated prompts alone with ``SequenceValueLoss``.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import signal
import sys
import time
from pathlib import Path

import torch

from ..advantages import build_advantage_estimator
from ..core.clipping import calibrate_espo_alpha
from ..core.groups import group_ids_for
from ..losses import GranularPolicyLoss, SequenceValueLoss
from . import models as M
from .config import TrainConfig, dump_config
from .rollout import generate, next_token_logprobs, old_policy_pass, to_nemo_batch
from .task import build_task, verify
from .warmstart import decode_responses, greedy_accuracy, warm_start

PREEMPTED_EXIT_CODE = 99
_EXTREMA = ("probs_ratio_min", "probs_ratio_clamped_min", "probs_ratio_max", "probs_ratio_clamped_max")
# keys of every NeMo-RL batch the policy loss reads; the trainer builds exactly these
BATCH_KEYS = ("input_ids", "input_lengths", "token_mask", "sample_mask", "generation_logprobs", "prev_logprobs",
              "prev_entropy", "granular_group_ids", "advantages", "reference_policy_logprobs")


def merge_metrics(acc: dict, new: dict) -> dict:
    """NeMo-RL's reduction of per-microbatch metric dicts: sum, min/max for the ratio extrema."""
    for k, v in new.items():
        if k not in acc:
            acc[k] = v
        elif k in _EXTREMA:
            acc[k] = min(acc[k], v) if k.endswith("_min") else max(acc[k], v)
        else:
            acc[k] += v
    return acc


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


class Trainer:
    def __init__(self, cfg: TrainConfig, resume: bool = False, log=None):
        self.cfg = cfg
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        torch.set_num_threads(max(1, cfg.threads))
        try:  # the checkpoint writer's per-shard progress bar is noise next to ours
            from transformers.utils import logging as hf_logging
            hf_logging.disable_progress_bar()
        except ImportError:
            pass
        self.device = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available() else
                                   ("cpu" if cfg.device == "auto" else cfg.device))
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device: 'cuda' requested but no CUDA device is available")
        self.autocast = torch.bfloat16 if self.device.type == "cuda" else None
        self.out = Path(cfg.output_dir)
        self.ckpt_dir = self.out / "checkpoints"
        self.out.mkdir(parents=True, exist_ok=True)
        self._stop_signal = None
        # handlers first: a preemption signal during model set-up or the warm start is honoured too
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        self.step = 0
        self.samples = 0
        self.wall = 0.0
        self.espo_alpha = None
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)

        latest = self.latest_checkpoint() if resume else None
        tok_src = (latest / "tokenizer") if latest else M.tokenizer_dir(cfg.model.path or cfg.model.init_from)
        self.tokenizer = M.load_tokenizer(str(tok_src)) if tok_src else M.build_tokenizer()
        self.task = build_task(cfg.task, cfg.seed)
        self.sppo = cfg.algorithm == "sppo"
        self.warmstart_info = None
        if latest:
            self.policy = M.load_pretrained_policy(str(latest / "policy"))
        elif cfg.model.init_from:
            self.policy = M.load_pretrained_policy(cfg.model.init_from)
        else:
            self.policy = M.build_policy(cfg.model, self.tokenizer)
        self.policy.to(self.device)
        if not latest and not cfg.model.init_from and cfg.warmstart.enabled:
            self.warmstart_info = warm_start(self.policy, self.tokenizer, self.task, cfg.warmstart, cfg.rl,
                                             self.device, cfg.seed, self.log, self.autocast, cfg.task.answer_pattern)
        self.vocab_size = self.policy.config.vocab_size
        self.loss_fn = GranularPolicyLoss(cfg.loss_fn.model_dump(), tokenizer=self.tokenizer,
                                          vocab_size=self.vocab_size)
        self.estimator = build_advantage_estimator(cfg.grpo.adv_estimator.model_dump())
        self.opt = torch.optim.AdamW(self.policy.parameters(), lr=cfg.rl.lr, weight_decay=cfg.rl.weight_decay)
        self.critic = self.critic_opt = None
        if self.sppo:
            critic_cfg = (cfg.critic.model_copy(update={"path": str(latest / "critic")})
                          if latest and (latest / "critic").exists() else cfg.critic)
            self.critic = M.build_critic(critic_cfg, self.policy, self.tokenizer).to(self.device)
            if len(self.tokenizer) > self.critic.config.vocab_size:
                raise ValueError("critic: its vocabulary is smaller than the policy tokenizer's (the critic must "
                                 "share the policy's tokenizer)")
            self.value_loss_fn = SequenceValueLoss()
            self.critic_opt = torch.optim.AdamW(self.critic.parameters(), lr=cfg.critic.lr)
        if latest:
            self._load_state(latest)
        self.sinks = MetricSinks(self.out, cfg, resume_step=self.step if latest else None)
        atomic_write_text(self.out / "config.yaml", dump_config(cfg))

    # ------------------------------------------------------------------ checkpoints
    def latest_checkpoint(self) -> Path | None:
        pointer = self.ckpt_dir / "latest"
        if not pointer.is_file():
            return None
        path = self.ckpt_dir / pointer.read_text().strip()
        if not (path / "trainer_state.json").is_file():
            raise FileNotFoundError(f"{pointer} names {path}, which is not a complete checkpoint")
        return path

    def save_checkpoint(self) -> Path:
        name = f"step_{self.step:06d}"
        final = self.ckpt_dir / name
        tmp = self.ckpt_dir / f".tmp_{name}_{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        self.policy.save_pretrained(str(tmp / "policy"), safe_serialization=True)
        self.tokenizer.save_pretrained(str(tmp / "tokenizer"))
        if self.critic is not None:
            self.critic.save_pretrained(str(tmp / "critic"), safe_serialization=True)
        torch.save({"policy": self.opt.state_dict(),
                    "critic": self.critic_opt.state_dict() if self.critic_opt else None}, tmp / "optimizer.pt")
        torch.save({"torch": torch.get_rng_state(), "python": random.getstate(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}, tmp / "rng.pt")
        state = {"step": self.step, "samples": self.samples, "wall_time": self.wall, "algorithm": self.cfg.algorithm,
                 "data_position": self.step, "espo_alpha": self.espo_alpha, "seed": self.cfg.seed}
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))
        (tmp / "config.yaml").write_text(dump_config(self.cfg))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        atomic_write_text(self.ckpt_dir / "latest", name + "\n")
        self._prune()
        return final

    def _prune(self):
        keep = max(1, self.cfg.checkpoint.keep)
        steps = sorted(p for p in self.ckpt_dir.glob("step_*") if p.is_dir())
        for old in steps[:-keep]:
            shutil.rmtree(old, ignore_errors=True)

    def _load_state(self, path: Path):
        state = json.loads((path / "trainer_state.json").read_text())
        self.step, self.samples, self.wall = state["step"], state["samples"], state["wall_time"]
        self.espo_alpha = state.get("espo_alpha")
        if self.espo_alpha is not None:
            self.loss_fn.granular.espo.alpha = self.espo_alpha
        opt = torch.load(path / "optimizer.pt", weights_only=True)
        self.opt.load_state_dict(opt["policy"])
        if self.critic_opt is not None and opt.get("critic"):
            self.critic_opt.load_state_dict(opt["critic"])
        rng = torch.load(path / "rng.pt", weights_only=False)  # python's RNG state is a tuple of ints
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if rng.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        self.log(f"resumed from {path} at step {self.step}")

    # ------------------------------------------------------------------ one RL step
    def rollout(self, step: int) -> dict:
        cfg = self.cfg.rl
        G = 1 if self.sppo else cfg.generations_per_prompt
        P = cfg.prompts_per_step * cfg.generations_per_prompt // G  # SPPO: same samples, one per prompt
        data_gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + step)
        problems = [p for p in self.task.sample(P, data_gen) for _ in range(G)]
        self.policy.eval()
        gen = generate(self.policy, self.tokenizer, [p.prompt for p in problems], max_new_tokens=cfg.max_new_tokens,
                       temperature=cfg.temperature, greedy=False, device=self.device, autocast_dtype=self.autocast)
        batch = to_nemo_batch(gen, self.tokenizer.pad_token_id)
        texts = decode_responses(self.tokenizer, gen)
        rewards, failed = verify(texts, [p.answer for p in problems], self.cfg.task.answer_pattern)
        batch["rewards"], batch["verification_failed"] = rewards.to(self.device), failed.to(self.device)
        old_policy_pass(self.policy, batch, cfg.temperature, cfg.entropy_chunk_size, self.autocast)
        g = self.loss_fn.granular
        batch["granular_group_ids"] = group_ids_for(
            g.granularity, batch["token_mask"] > 0, token_ids=batch["input_ids"], entropy=batch["prev_entropy"],
            delimiter_table=self.loss_fn.delimiter_table, entropy_cut_points=g.entropy_cut_points)
        batch["reference_policy_logprobs"] = torch.zeros_like(batch["prev_logprobs"])
        mask = batch["token_mask"] * batch["sample_mask"][:, None]
        kwargs = dict(repeated_batch={"verification_failed": batch["verification_failed"]},
                      logprobs_policy=batch["prev_logprobs"], logprobs_reference=batch["reference_policy_logprobs"])
        if self.sppo:
            with torch.no_grad():
                kwargs["values"] = self.critic_values(batch)
            batch["values"] = kwargs["values"]
        adv = self.estimator.compute_advantage(batch["prompt_ids"], batch["rewards"], mask, **kwargs)
        if isinstance(adv, tuple):
            adv, batch["returns"] = adv
        batch["advantages"] = adv
        return batch

    def critic_values(self, batch: dict) -> torch.Tensor:
        """V(s_p) logits as NeMo-RL's right-shifted values ``[B, S]``: at the first response column.

        Only the unique prompts are forwarded (causality: the value at the last prompt token does
        not depend on the response), then scattered back to every row.
        """
        prompts = prompt_only(batch["input_ids"], batch["token_mask"], self.tokenizer.pad_token_id)
        unique, inverse = torch.unique(prompts, dim=0, return_inverse=True)
        attention = (unique != self.tokenizer.pad_token_id).long()
        with torch.autocast(self.device.type, dtype=self.autocast, enabled=self.autocast is not None):
            v = self.critic(input_ids=unique, attention_mask=attention).logits[:, 0].float()
        v = v[inverse]
        col = (batch["token_mask"] > 0).float().argmax(-1)
        values = torch.zeros_like(batch["token_mask"], dtype=v.dtype)
        return values.scatter(1, col[:, None], v[:, None])

    def optimizer_step(self, batch: dict, rows: slice) -> tuple[dict, dict]:
        """One global batch (optimizer step): microbatches with NeMo-RL's global normalisation."""
        cfg = self.cfg.rl
        token_mask, sample_mask = batch["token_mask"][rows], batch["sample_mask"][rows]
        global_valid_seqs = sample_mask.sum()
        global_valid_toks = (token_mask[:, 1:] * sample_mask[:, None]).sum()
        metrics, critic_metrics = {}, {}
        if self.critic is not None:
            self.critic.train()
            self.critic_opt.zero_grad(set_to_none=True)
        self.policy.train()
        self.opt.zero_grad(set_to_none=True)
        width = batch["input_ids"].shape[1]
        for start in range(rows.start, rows.stop, cfg.micro_batch_size):  # loop over microbatches
            micro = slice(start, min(start + cfg.micro_batch_size, rows.stop))
            S = int(batch["input_lengths"][micro].max())  # dynamic-batching style: trim to the longest row
            # NeMo-RL's shape rule: per-token keys [B, S] (trimmed together), per-sample keys [B]
            data = {k: (v[micro, :S] if v.dim() == 2 else v[micro]) for k, v in batch.items()
                    if torch.is_tensor(v) and (v.dim() == 1 or v.shape[1] == width)}
            if self.critic is not None:
                values = self.critic_values(data)
                closs, cm = self.value_loss_fn(logits=values, data=data, global_valid_seqs=global_valid_seqs,
                                               global_valid_toks=global_valid_toks)
                closs.backward()
                merge_metrics(critic_metrics, cm)
            logp = next_token_logprobs(self.policy, data, cfg.temperature, self.autocast)
            loss, m = self.loss_fn(next_token_logprobs=logp, data=data, global_valid_seqs=global_valid_seqs,
                                   global_valid_toks=global_valid_toks)
            loss.backward()
            merge_metrics(metrics, m)
        metrics["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.policy.parameters(), cfg.max_grad_norm))
        self.opt.step()
        if self.critic is not None:
            critic_metrics["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.critic.parameters(),
                                                                               self.cfg.critic.max_grad_norm))
            self.critic_opt.step()
        return metrics, critic_metrics

    def train_step(self) -> dict:
        cfg = self.cfg.rl
        t0 = time.time()
        batch = self.rollout(self.step)
        t_gen = time.time() - t0
        if self.step == 0 and self.cfg.rl.calibrate_espo_alpha_to and self.espo_alpha is None:
            self._calibrate_espo(batch)
        B = batch["input_ids"].shape[0]
        per = B // cfg.minibatches_per_rollout
        per_step, per_critic = [], []
        for k in range(cfg.minibatches_per_rollout):  # several optimizer steps per rollout
            m, cm = self.optimizer_step(batch, slice(k * per, (k + 1) * per))
            per_step.append(m)
            per_critic.append(cm)
        t_all = time.time() - t0
        self.step += 1
        self.samples += B
        self.wall += t_all
        return self._step_record(batch, per_step, per_critic, t_gen, t_all)

    def _calibrate_espo(self, batch):
        mask = batch["token_mask"] > 0
        mean_h = batch["prev_entropy"][mask].mean().item()
        self.espo_alpha = calibrate_espo_alpha(mean_h, self.vocab_size, self.cfg.rl.calibrate_espo_alpha_to)
        self.loss_fn.granular.espo.alpha = self.espo_alpha
        self.log(f"espo.alpha calibrated to {self.espo_alpha:.4g} (mean π_old entropy {mean_h:.3f} nats, "
                 f"target mean ε {self.cfg.rl.calibrate_espo_alpha_to})")

    def _step_record(self, batch, per_step, per_critic, t_gen, t_all) -> dict:
        rec = {"step": self.step, "samples": self.samples, "wall_time": round(self.wall, 4)}
        mask = batch["token_mask"] > 0
        rec["train/reward"] = batch["rewards"].mean().item()
        rec["train/verification_failed_frac"] = batch["verification_failed"].float().mean().item()
        rec["train/response_length"] = mask.sum(-1).float().mean().item()
        rec["train/truncated_frac"] = batch["truncated"].float().mean().item()
        rec["train/prev_entropy"] = batch["prev_entropy"][mask].mean().item() if mask.any() else 0.0
        n = len(per_step)
        for k in per_step[0]:
            vals = [m[k] for m in per_step]
            rec[f"train/{k}"] = (min(vals) if k.endswith("_min") else max(vals)) if k in _EXTREMA else sum(vals) / n
        if per_critic and per_critic[0]:
            for k in per_critic[0]:
                rec[f"train/critic/{k}"] = sum(m[k] for m in per_critic) / n
        if self.espo_alpha is not None:
            rec["train/espo_alpha"] = self.espo_alpha
        rec["timing/train/generation"] = t_gen
        rec["timing/train/total_step_time"] = t_all
        return rec

    # ------------------------------------------------------------------ loop
    def evaluate(self) -> float:
        return greedy_accuracy(self.policy, self.tokenizer, self.task.heldout, self.cfg.rl.max_new_tokens,
                               self.device, self.autocast, self.cfg.task.answer_pattern)

    def _on_signal(self, signum, frame):
        self._stop_signal = signum
        self.log(f"received signal {signum}: will checkpoint after this step and exit {PREEMPTED_EXIT_CODE}")

    def run(self) -> int:
        cfg = self.cfg
        if self._stop_signal is not None:  # preempted before the first step: keep the warm start
            self.save_checkpoint()
            self.sinks.close()
            return PREEMPTED_EXIT_CODE
        if self.step == 0:
            acc0 = self.evaluate()
            rec0 = {"step": 0, "samples": 0, "wall_time": 0.0, "validation/accuracy": acc0}
            if self.warmstart_info:
                rec0.update({f"warmstart/{k}": v for k, v in self.warmstart_info.items()})
            self.sinks.write(rec0)
        bar = None
        if cfg.logger.progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=cfg.rl.steps, initial=self.step, desc=f"{cfg.algorithm}", dynamic_ncols=True,
                       file=sys.stderr)
        while self.step < cfg.rl.steps:
            rec = self.train_step()
            if not math.isfinite(rec.get("train/loss", 0.0)):
                raise RuntimeError(f"non-finite loss at step {self.step}")
            if self.step % cfg.rl.eval_every == 0 or self.step == cfg.rl.steps:
                rec["validation/accuracy"] = self.evaluate()
            self.sinks.write(rec)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(reward=f"{rec['train/reward']:.2f}",
                                clip=f"{rec['train/clip_frac_low'] + rec['train/clip_frac_high']:.3f}",
                                acc=f"{rec.get('validation/accuracy', float('nan')):.2f}")
            every = cfg.checkpoint.every
            if (every and self.step % every == 0) or self._stop_signal is not None:
                self.save_checkpoint()
            if self._stop_signal is not None:
                self.sinks.close()
                return PREEMPTED_EXIT_CODE
        if bar is not None:
            bar.close()
        if not (cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0):
            self.save_checkpoint()
        self.sinks.close()
        return 0


def prompt_only(input_ids: torch.Tensor, token_mask: torch.Tensor, pad_id: int) -> torch.Tensor:
    """The prompt of each row (tokens before the first response token), right padded, trimmed."""
    first = (token_mask > 0).to(torch.int8).argmax(-1)
    width = max(1, int(first.max()))
    col = torch.arange(width, device=input_ids.device)[None, :]
    return torch.where(col < first[:, None], input_ids[:, :width], torch.full_like(input_ids[:, :width], pad_id))


class MetricSinks:
    """metrics.jsonl (always), TensorBoard and wandb (when enabled and installed)."""

    def __init__(self, out: Path, cfg: TrainConfig, resume_step: int | None):
        self.path = out / "metrics.jsonl"
        if resume_step is not None and self.path.exists():  # drop records past the checkpoint
            keep = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= resume_step]
            atomic_write_text(self.path, "".join(line + "\n" for line in keep))
        elif resume_step is None and self.path.exists():
            self.path.unlink()
        self.fh = self.path.open("a")
        self.tb = self.wandb = None
        if cfg.logger.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(str(out / "tensorboard"))
            except ImportError:
                self.tb = None
        if cfg.logger.wandb:
            try:
                import wandb
                self.wandb = wandb.init(project=cfg.logger.wandb_project, name=cfg.name, dir=str(out),
                                        mode=cfg.logger.wandb_mode, config=cfg.model_dump(mode="json"))
            except ImportError:
                self.wandb = None

    def write(self, rec: dict) -> None:
        self.fh.write(json.dumps(rec) + "\n")
        self.fh.flush()
        scalars = {k: v for k, v in rec.items() if isinstance(v, (int, float)) and k != "step" and math.isfinite(v)}
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, rec["step"])
        if self.wandb is not None:
            self.wandb.log(scalars, step=rec["step"])

    def close(self):
        self.fh.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
