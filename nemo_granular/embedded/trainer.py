"""The embedded RL trainer: NeMo-RL's GRPO/PPO step on one machine, calling the same plugin objects.

Per step: sample prompts (a pure function of (seed, step): the data position is the step),
G responses each (N = 1 for SPPO), verify, π_old logprobs AND entropy in one pass, group ids,
advantages through the estimator's ``compute_advantage``, then several optimizer steps per
rollout (minibatches), each split into microbatches that call ``GranularPolicyLoss`` with
NeMo-RL's keys, ``[:, 1:]`` shift and global normalisation. SPPO's critic is trained on the
deduplicated prompts alone with ``SequenceValueLoss``.

This module is the RL step and the loop around it; where the records go (:mod:`.sinks`), what
the run says on stderr (:mod:`.progress`), the run directory (:mod:`.output_dir`) and the
checkpoints (:mod:`.checkpoint`) live beside it.
"""

from __future__ import annotations

import math
import random
import signal
import sys
import threading
import time
from pathlib import Path

import torch

from .. import atomic
from ..advantages import build_advantage_estimator
from ..batch_schema import POLICY_BATCH
from ..cli_common import check_writable_dir
from ..core.advantages import first_response_index
from ..core.clipping import ESPO_AUTO_TARGET_EPS
from ..core.groups import group_ids_for
from ..core.offpolicy import batch_mismatch_extrema
from ..losses import GranularPolicyLoss, SequenceValueLoss
from ..sppo.critic import unique_prompts
from . import models as M
from .checkpoint import CheckpointWriter, restore_optimizers_and_rng
from .config import TrainConfig, dump_config
from .mismatch import generation_seed, perturbed_copy
from .output_dir import plan_start, prepare_output_dir
from .progress import Progress, start_line
from .rollout import generate, next_token_logprobs, old_policy_pass, to_nemo_batch
from .sinks import RATIO_EXTREMA, MetricSinks, merge_metrics
from .task import build_task, verify
from .warmstart import check_worked_solutions, decode_responses, greedy_accuracy, warm_start

PREEMPTED_EXIT_CODE = 99
STOP_EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: PREEMPTED_EXIT_CODE, signal.SIGUSR1: PREEMPTED_EXIT_CODE}
# the policy batch's keys (nemo_granular.batch_schema) the trainer builds on every rollout: all but NeMo-RL's
# curr_logprobs_unfiltered (optional: the loss's KL then reads π_θ itself)
BATCH_KEYS = tuple(k.name for k in POLICY_BATCH if k.name != "curr_logprobs_unfiltered")


class Trainer:
    """One run. ``resume``: False (fresh; refuses a directory holding a run unless ``force``),
    True (continue from the newest complete checkpoint; error when there is none) or ``"auto"``
    (continue when there is a checkpoint, else start fresh: for requeueing launchers)."""

    def __init__(self, cfg: TrainConfig, resume: bool | str = False, log=None, force: bool = False, summary=None):
        self.cfg = cfg
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.summary = summary or self.log  # the closing `done:` line (the CLI prints it on stdout)
        if resume is True and force:
            raise ValueError("--resume and --force exclude each other (--force starts over)")
        torch.set_num_threads(max(1, cfg.threads))
        try:  # the checkpoint writer's per-shard progress bar is noise next to ours
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        except ImportError:
            pass
        if cfg.device == "auto":
            self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            self.device = torch.device(cfg.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device: 'cuda' requested but no CUDA device is available")
        self.autocast = torch.bfloat16 if self.device.type == "cuda" else None
        self.out = Path(cfg.output_dir)
        self.ckpt_dir = self.out / "checkpoints"
        self.checkpoints = CheckpointWriter(self.ckpt_dir, cfg.checkpoint.keep)
        self._stop_signal = None
        self._old_handlers: dict = {}
        self.step = 0
        self.samples = 0
        self.wall = 0.0
        self.espo_alpha = None
        self.sinks = None

        # 1. where to write and what to start from: only reads, so a refusal leaves everything as it was
        check_writable_dir(self.out, "output_dir")
        latest, self._unusable = plan_start(
            self.out, self.ckpt_dir, resume, force, {"algorithm": cfg.algorithm, "seed": cfg.seed}, self.log
        )
        self.resumed = latest is not None
        self.force = force and not self.resumed
        # 2. inputs that can be missing or malformed, before the start line
        model_src = cfg.model.path or cfg.model.init_from
        if not latest and model_src and not (Path(model_src) / "config.json").is_file():
            key = "model.path" if cfg.model.path else "model.init_from"
            raise FileNotFoundError(f"{key}: {model_src} is not a Hugging Face model directory (no config.json)")
        tok_src = (latest.path / "tokenizer") if latest else M.tokenizer_dir(model_src)
        self.tokenizer = M.load_tokenizer(str(tok_src)) if tok_src else M.build_tokenizer()
        self.task = build_task(cfg.task, cfg.seed)
        if not latest and not cfg.model.init_from and cfg.warmstart.enabled:
            check_worked_solutions(self.task)
        self.sppo = cfg.algorithm == "sppo"
        self.warmstart_info = None
        # 3. the start line; from here a stop signal is honoured (checkpoint, then exit)
        self.log(start_line(cfg, self.device, self.out, latest))
        self._install_signal_handlers()
        try:
            self._set_up(latest)
        except BaseException:
            self._restore_signal_handlers()
            if self.sinks is not None:
                self.sinks.close()
            raise

    def _set_up(self, latest):
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        if latest:
            self.policy = M.load_pretrained_policy(str(latest.path / "policy"))
        elif cfg.model.init_from:
            self.policy = M.load_pretrained_policy(cfg.model.init_from)
        else:
            self.policy = M.build_policy(cfg.model, self.tokenizer)
        self.policy.to(self.device)
        if not latest and not cfg.model.init_from and cfg.warmstart.enabled:
            self.warmstart_info = warm_start(
                self.policy,
                self.tokenizer,
                self.task,
                cfg.warmstart,
                cfg.rl,
                self.device,
                cfg.seed,
                self.log,
                self.autocast,
                cfg.task.answer_pattern,
            )
        self.vocab_size = self.policy.config.vocab_size
        self.loss_fn = GranularPolicyLoss(
            cfg.loss_fn.model_dump(), tokenizer=self.tokenizer, vocab_size=self.vocab_size
        )
        self.estimator = build_advantage_estimator(cfg.grpo.adv_estimator.model_dump())
        self.opt = torch.optim.AdamW(self.policy.parameters(), lr=cfg.rl.lr, weight_decay=cfg.rl.weight_decay)
        self.critic = self.critic_opt = None
        if self.sppo:
            critic_cfg = (
                cfg.critic.model_copy(update={"path": str(latest.path / "critic")})
                if latest and (latest.path / "critic").exists()
                else cfg.critic
            )
            self.critic = M.build_critic(critic_cfg, self.policy, self.tokenizer).to(self.device)
            if len(self.tokenizer) > self.critic.config.vocab_size:
                raise ValueError(
                    "critic: its vocabulary is smaller than the policy tokenizer's (the critic must "
                    "share the policy's tokenizer)"
                )
            self.value_loss_fn = SequenceValueLoss()
            self.critic_opt = torch.optim.AdamW(self.critic.parameters(), lr=cfg.critic.lr)
        if latest:
            self._load_state(latest)
        # 4. the first write: only now is an earlier run's output replaced (--force) or extended
        prepare_output_dir(self.out, self.ckpt_dir, self.force, self._unusable, self.log)
        self.sinks = MetricSinks(self.out, cfg, resume_step=self.step if latest else None, log=self.log)
        atomic.write_text(self.out / "config.yaml", dump_config(cfg))

    # ------------------------------------------------------------------ signals
    def _install_signal_handlers(self):
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for sig in STOP_EXIT_CODES:
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)

    def _restore_signal_handlers(self):
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers = {}

    def _on_signal(self, signum, frame):
        name = signal.Signals(signum).name
        if self._stop_signal is not None:
            if signum == signal.SIGINT:  # a second Ctrl-C: abort at once, without a checkpoint
                self._restore_signal_handlers()
                raise KeyboardInterrupt
            return
        self._stop_signal = signum
        when = "after this step" if self.sinks is not None else "once set-up is done"
        more = " (Ctrl-C again aborts at once, without a checkpoint)" if signum == signal.SIGINT else ""
        self.log(f"{name} received: will save a checkpoint {when} and exit {STOP_EXIT_CODES[signum]}{more}")

    # ------------------------------------------------------------------ checkpoints
    @property
    def last_checkpoint(self) -> Path | None:
        """The newest complete checkpoint of this run (the one it resumed from, until it writes one)."""
        return self.checkpoints.last

    def save_checkpoint(self) -> Path:
        """Write ``checkpoints/step_N`` of the current step (:meth:`.checkpoint.CheckpointWriter.save`:
        atomic; a failed write raises ``CheckpointWriteError``, one line naming the checkpoint)."""
        state = {
            "step": self.step,
            "samples": self.samples,
            "wall_time": self.wall,
            "algorithm": self.cfg.algorithm,
            "data_position": self.step,
            "espo_alpha": self.espo_alpha,
            "seed": self.cfg.seed,
        }
        return self.checkpoints.save(
            self.step,
            policy=self.policy,
            tokenizer=self.tokenizer,
            critic=self.critic,
            opt=self.opt,
            critic_opt=self.critic_opt,
            state=state,
            config=dump_config(self.cfg),
        )

    def _load_state(self, loaded):
        state = loaded.state
        self.step, self.samples, self.wall = int(state["step"]), int(state["samples"]), float(state["wall_time"])
        self.espo_alpha = state.get("espo_alpha")
        if self.espo_alpha is not None:
            self.loss_fn.set_espo_alpha(self.espo_alpha)
        restore_optimizers_and_rng(loaded, self.opt, self.critic_opt)
        # the start line said "resuming at step … from <path>": not said twice
        self.checkpoints.resumed_from(loaded.path, self.step)

    # ------------------------------------------------------------------ one RL step
    def rollout(self, step: int) -> dict:
        cfg = self.cfg.rl
        G = 1 if self.sppo else cfg.generations_per_prompt
        P = cfg.prompts_per_step * cfg.generations_per_prompt // G  # SPPO: same samples, one per prompt
        data_gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + step)
        problems = [p for p in self.task.sample(P, data_gen) for _ in range(G)]
        self.policy.eval()
        engine = (
            self.policy
            if cfg.generation_mismatch == 0
            # π_gen ≠ π_old (docs/algorithms/offpolicy.md)
            else perturbed_copy(self.policy, cfg.generation_mismatch, generation_seed(self.cfg.seed, step))
        )
        gen = generate(
            engine,
            self.tokenizer,
            [p.prompt for p in problems],
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            greedy=False,
            device=self.device,
            autocast_dtype=self.autocast,
        )
        batch = to_nemo_batch(gen, self.tokenizer.pad_token_id)
        texts = decode_responses(self.tokenizer, gen)
        rewards, failed = verify(texts, [p.answer for p in problems], self.cfg.task.answer_pattern)
        batch["rewards"], batch["verification_failed"] = rewards.to(self.device), failed.to(self.device)
        old_policy_pass(self.policy, batch, cfg.temperature, cfg.entropy_chunk_size, self.autocast)
        g = self.loss_fn.granular
        batch["granular_group_ids"] = group_ids_for(
            g.granularity,
            batch["token_mask"] > 0,
            token_ids=batch["input_ids"],
            entropy=batch["prev_entropy"],
            delimiter_table=self.loss_fn.delimiter_table,
            entropy_cut_points=g.entropy_cut_points,
        )
        batch["reference_policy_logprobs"] = torch.zeros_like(batch["prev_logprobs"])
        mask = batch["token_mask"] * batch["sample_mask"][:, None]
        kwargs = dict(
            repeated_batch={"verification_failed": batch["verification_failed"]},
            logprobs_policy=batch["prev_logprobs"],
            logprobs_reference=batch["reference_policy_logprobs"],
        )
        if self.sppo:
            with torch.no_grad():
                kwargs["values"] = self.critic_values(batch)
            batch["values"] = kwargs["values"]
        adv = self.estimator.compute_advantage(batch["prompt_ids"], batch["rewards"], mask, **kwargs)
        if isinstance(adv, tuple):
            adv, batch["returns"] = adv
        batch["advantages"] = adv
        missing = [k for k in BATCH_KEYS if k not in batch]
        if missing:  # a key the batch schema declares and the trainer failed to build
            raise RuntimeError(f"the rollout batch lacks {missing} (nemo_granular.batch_schema.POLICY_BATCH)")
        return batch

    def critic_values(self, batch: dict) -> torch.Tensor:
        """V(s_p) logits as NeMo-RL's right-shifted values ``[B, S]``: at the first response column.

        Only the unique prompts are forwarded (causality: the value at the last prompt token does
        not depend on the response), then scattered back to every row: ``sppo.critic.unique_prompts``
        (the de-duplication of the NeMo-RL critic path), each row's prompt being the tokens before its
        first response token.
        """
        col = first_response_index(batch["token_mask"] > 0)  # each row's prompt length
        unique, inverse = unique_prompts(batch["input_ids"], self.tokenizer.pad_token_id, lengths=col)
        lengths = torch.zeros(unique.shape[0], dtype=col.dtype, device=col.device).scatter(0, inverse, col)
        attention = (torch.arange(unique.shape[1], device=col.device)[None, :] < lengths[:, None]).long()
        with torch.autocast(self.device.type, dtype=self.autocast, enabled=self.autocast is not None):
            v = self.critic(input_ids=unique, attention_mask=attention).logits[:, 0].float()
        v = v[inverse]
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
            data = {
                k: (v[micro, :S] if v.dim() == 2 else v[micro])
                for k, v in batch.items()
                if torch.is_tensor(v) and (v.dim() == 1 or v.shape[1] == width)
            }
            if self.critic is not None:
                values = self.critic_values(data)
                closs, cm = self.value_loss_fn(
                    logits=values, data=data, global_valid_seqs=global_valid_seqs, global_valid_toks=global_valid_toks
                )
                closs.backward()
                merge_metrics(critic_metrics, cm)
            logp = next_token_logprobs(self.policy, data, cfg.temperature, self.autocast)
            loss, m = self.loss_fn(
                next_token_logprobs=logp,
                data=data,
                global_valid_seqs=global_valid_seqs,
                global_valid_toks=global_valid_toks,
            )
            loss.backward()
            merge_metrics(metrics, m)
        metrics["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.policy.parameters(), cfg.max_grad_norm))
        self.opt.step()
        if self.critic is not None:
            critic_metrics["grad_norm"] = float(
                torch.nn.utils.clip_grad_norm_(self.critic.parameters(), self.cfg.critic.max_grad_norm)
            )
            self.critic_opt.step()
        return metrics, critic_metrics

    def train_step(self) -> dict:
        cfg = self.cfg.rl
        t0, cpu0 = time.time(), time.process_time()
        batch = self.rollout(self.step)
        t_gen = time.time() - t0
        if self.espo_alpha is None and (
            self.loss_fn.espo_alpha_pending or (self.step == 0 and self.cfg.rl.calibrate_espo_alpha_to)
        ):
            self._calibrate_espo(batch)
        B = batch["input_ids"].shape[0]
        per = B // cfg.minibatches_per_rollout
        per_step, per_critic = [], []
        for k in range(cfg.minibatches_per_rollout):  # several optimizer steps per rollout
            m, cm = self.optimizer_step(batch, slice(k * per, (k + 1) * per))
            per_step.append(m)
            per_critic.append(cm)
        t_all, cpu = time.time() - t0, time.process_time() - cpu0
        self.step += 1
        self.samples += B
        self.wall += t_all
        rec = self._step_record(batch, per_step, per_critic, t_gen, t_all)
        # whether runs shared the CPU equally, for the report's wall-time verdicts (report/cpu.py)
        rec["timing/train/cpu_time"], rec["timing/train/step_end_unix"] = cpu, t0 + t_all
        return rec

    def _calibrate_espo(self, batch):
        """α from this (first) rollout's π_old entropy: `espo.alpha: auto` (the 3.5e-4 rule) or
        `rl.calibrate_espo_alpha_to`; kept in trainer_state.json, so a resume reuses it."""
        mask = batch["token_mask"] * batch["sample_mask"][:, None]
        target = self.cfg.rl.calibrate_espo_alpha_to or ESPO_AUTO_TARGET_EPS
        self.espo_alpha = self.loss_fn.calibrate_espo_alpha(batch["prev_entropy"], mask, target)
        mean_h = batch["prev_entropy"][mask > 0].mean().item()
        self.log(
            f"espo.alpha calibrated to {self.espo_alpha:.4g} (mean π_old entropy {mean_h:.3f} nats, "
            f"target mean ε {target})"
        )

    def _step_record(self, batch, per_step, per_critic, t_gen, t_all) -> dict:
        rec = {"step": self.step, "samples": self.samples, "wall_time": round(self.wall, 4)}
        mask = batch["token_mask"] > 0
        rec["train/reward"] = batch["rewards"].mean().item()
        rec["train/verification_failed_frac"] = batch["verification_failed"].float().mean().item()
        rec["train/response_length"] = mask.sum(-1).float().mean().item()
        rec["train/truncated_frac"] = batch["truncated"].float().mean().item()
        rec["train/prev_entropy"] = batch["prev_entropy"][mask].mean().item() if mask.any() else 0.0
        # whole-batch mismatch maxima and entropy split (math.md §10.3): a max does not add over microbatches
        # (diagnostics: at metrics_level minimal only with the correction on, as the loss's own)
        g, lcfg = self.loss_fn.granular, self.loss_fn.cfg
        if lcfg.metrics_level == "full" or lcfg.use_importance_sampling_correction:
            rec.update(
                {
                    f"train/{k}": v
                    for k, v in batch_mismatch_extrema(batch, g.granularity, g.entropy_cut_points[0]).items()
                }
            )
        n = len(per_step)
        for k in per_step[0]:
            vals = [m[k] for m in per_step]
            if k not in RATIO_EXTREMA:
                rec[f"train/{k}"] = sum(vals) / n
            else:
                rec[f"train/{k}"] = min(vals) if k.endswith("_min") else max(vals)
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
        return greedy_accuracy(
            self.policy,
            self.tokenizer,
            self.task.heldout,
            self.cfg.rl.max_new_tokens,
            self.device,
            self.autocast,
            self.cfg.task.answer_pattern,
        )

    def run(self) -> int:
        """Train to ``rl.steps``; 0 when done, 130 after Ctrl-C, 99 after SIGTERM/SIGUSR1 (checkpoint saved)."""
        try:
            return self._run()
        finally:
            self.close()

    def close(self) -> None:
        """Give the signal handlers back and close the metric sinks (``run`` does this itself)."""
        self._restore_signal_handlers()
        if self.sinks is not None:
            self.sinks.close()

    def _run(self) -> int:
        cfg = self.cfg
        if self._stop_signal is not None:  # stopped during set-up: keep the warm start and its outcome
            if self.warmstart_info and self.sinks.last_step is None:
                self._write_start_record()  # the warmstart/* keys exist only in this process
            return self._stop()
        if self.sinks.last_step is None:  # a fresh run: the starting accuracy
            self._write_start_record()
        progress = Progress(cfg, self.step, self.sinks.last_accuracy, self.log)
        try:
            while self.step < cfg.rl.steps:
                rec = self.train_step()
                if not math.isfinite(rec.get("train/loss", 0.0)):
                    raise RuntimeError(f"non-finite loss at step {self.step}")
                if self.step % cfg.rl.eval_every == 0 or self.step == cfg.rl.steps:
                    rec["validation/accuracy"] = self.evaluate()
                self.sinks.write(rec)
                progress.update(rec)
                every = cfg.checkpoint.every
                if (every and self.step % every == 0) or self._stop_signal is not None:
                    self.save_checkpoint()
                if self._stop_signal is not None:
                    progress.close()
                    return self._stop()
        finally:
            progress.close()
        self.save_checkpoint()  # no-op when the last step's checkpoint is already written
        acc0, acc = self.sinks.first_accuracy, self.sinks.last_accuracy
        if acc is None:
            accuracy = "n/a"
        else:
            accuracy = f"{acc:.3f}" if acc0 is None or self.step == 0 else f"{acc0:.3f} → {acc:.3f}"
        self.summary(
            f"done: {cfg.algorithm} step {self.step}/{cfg.rl.steps} ({self.samples} samples, "
            f"{self.wall:.0f} s of RL); held-out accuracy {accuracy}; checkpoint {self.last_checkpoint}; "
            f"metrics {self.sinks.path}"
        )
        return 0

    def _write_start_record(self) -> None:
        """The step-0 record: the starting accuracy and, after a warm start, its outcome (warmstart/*)."""
        rec0 = {"step": 0, "samples": 0, "wall_time": 0.0, "validation/accuracy": self.evaluate()}
        if self.warmstart_info:
            rec0.update({f"warmstart/{k}": v for k, v in self.warmstart_info.items()})
        self.sinks.write(rec0)

    def _stop(self) -> int:
        self.save_checkpoint()
        name = signal.Signals(self._stop_signal).name
        # how to continue is the launcher's to say (train: one `resume with:` line; compare: `compare --resume`)
        self.log(f"stopped by {name} at step {self.step}/{self.cfg.rl.steps}: checkpoint {self.last_checkpoint}")
        return STOP_EXIT_CODES[self._stop_signal]
