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
from . import models as M
from .checkpoint import (
    CheckpointError,
    CheckpointWriteError,
    NothingToResume,
    find_resumable,
    fsync_dir,
    is_write_failure,
    ordinary_file_modes,
    step_dirs,
    write_failure_reason,
    write_manifest,
)
from .config import TrainConfig, dump_config
from .mismatch import generation_seed, perturbed_copy
from .rollout import generate, next_token_logprobs, old_policy_pass, to_nemo_batch
from .task import build_task, verify
from .warmstart import check_worked_solutions, decode_responses, greedy_accuracy, warm_start

PREEMPTED_EXIT_CODE = 99
_EXTREMA = ("probs_ratio_min", "probs_ratio_clamped_min", "probs_ratio_max", "probs_ratio_clamped_max")
# the policy batch's keys (nemo_granular.batch_schema) the trainer builds on every rollout: all but NeMo-RL's
# curr_logprobs_unfiltered (optional: the loss's KL then reads π_θ itself)
BATCH_KEYS = tuple(k.name for k in POLICY_BATCH if k.name != "curr_logprobs_unfiltered")


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


# what a run writes into its output directory; a fresh run refuses a directory holding any of them
RUN_ARTIFACTS = ("metrics.jsonl", "metrics.superseded.jsonl", "checkpoints", "tensorboard")
STOP_EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: PREEMPTED_EXIT_CODE, signal.SIGUSR1: PREEMPTED_EXIT_CODE}


def existing_run_artifacts(out: Path) -> list[str]:
    """The artifacts of an earlier run in ``out`` (empty directories do not count)."""
    found = []
    for name in RUN_ARTIFACTS:
        p = out / name
        if p.is_file() or (p.is_dir() and any(p.iterdir())):
            found.append(name + ("/" if p.is_dir() else ""))
    return found


def checkpoint_plan(start: int, steps: int, every: int) -> str:
    """What the checkpoints of steps ``start+1..steps`` will be, as the start line says it: a run
    shorter than ``checkpoint.every`` writes one checkpoint, at the end."""
    if not every or (start // every + 1) * every >= steps:  # no multiple of ``every`` before the last step
        return "checkpoint at the end"
    return f"checkpoints every {every} steps" + ("" if steps % every == 0 else " and at the end")


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
        self._stop_signal = None
        self._old_handlers: dict = {}
        self.step = 0
        self.samples = 0
        self.wall = 0.0
        self.espo_alpha = None
        self.last_checkpoint: Path | None = None
        self._saved_step: int | None = None
        self.sinks = None

        # 1. where to write and what to start from: only reads, so a refusal leaves everything as it was
        check_writable_dir(self.out, "output_dir")
        latest, self._unusable = self._plan_start(resume, force)
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
        self.log(self._start_line(latest))
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
            self.warmstart_info = warm_start(self.policy, self.tokenizer, self.task, cfg.warmstart, cfg.rl,
                                             self.device, cfg.seed, self.log, self.autocast, cfg.task.answer_pattern)
        self.vocab_size = self.policy.config.vocab_size
        self.loss_fn = GranularPolicyLoss(cfg.loss_fn.model_dump(), tokenizer=self.tokenizer,
                                          vocab_size=self.vocab_size)
        self.estimator = build_advantage_estimator(cfg.grpo.adv_estimator.model_dump())
        self.opt = torch.optim.AdamW(self.policy.parameters(), lr=cfg.rl.lr, weight_decay=cfg.rl.weight_decay)
        self.critic = self.critic_opt = None
        if self.sppo:
            critic_cfg = (cfg.critic.model_copy(update={"path": str(latest.path / "critic")})
                          if latest and (latest.path / "critic").exists() else cfg.critic)
            self.critic = M.build_critic(critic_cfg, self.policy, self.tokenizer).to(self.device)
            if len(self.tokenizer) > self.critic.config.vocab_size:
                raise ValueError("critic: its vocabulary is smaller than the policy tokenizer's (the critic must "
                                 "share the policy's tokenizer)")
            self.value_loss_fn = SequenceValueLoss()
            self.critic_opt = torch.optim.AdamW(self.critic.parameters(), lr=cfg.critic.lr)
        if latest:
            self._load_state(latest)
        # 4. the first write: only now is an earlier run's output replaced (--force) or extended
        self._prepare_output_dir()
        self.sinks = MetricSinks(self.out, cfg, resume_step=self.step if latest else None, log=self.log)
        atomic.write_text(self.out / "config.yaml", dump_config(cfg))

    def _plan_start(self, resume, force):
        """(checkpoint to resume or None, unusable checkpoints newer than it); raises one-line errors."""
        if resume:
            try:
                loaded, unusable = find_resumable(self.ckpt_dir, warn=self.log)
            except NothingToResume:
                if resume != "auto":
                    raise
            else:
                state = loaded.state
                for key in ("algorithm", "seed"):
                    mine = self.cfg.algorithm if key == "algorithm" else self.cfg.seed
                    if key in state and state[key] != mine:
                        raise ValueError(f"--resume: {loaded.path} was written with {key}={state[key]!r}, the "
                                         f"config says {key}={mine!r} (a different run: choose another output_dir)")
                return loaded, unusable
        existing = existing_run_artifacts(self.out)
        if existing and not force:
            raise FileExistsError(
                f"output_dir {self.out} already holds a run ({', '.join(existing)}): add --resume to continue "
                "it, --force to start over (deletes them), or choose another output_dir=")
        return None, []

    def _start_line(self, latest) -> str:
        cfg = self.cfg
        dev = self.device.type + (f" ({torch.cuda.get_device_name(self.device)})" if self.device.type == "cuda" else "")
        head = f"train {cfg.algorithm} (seed {cfg.seed}) on {dev}"
        if latest:
            start = int(latest.state["step"])
            return (f"{head}: resuming at step {start} of {cfg.rl.steps} from {latest.path} "
                    f"→ {self.out}/ (metrics.jsonl; {checkpoint_plan(start, cfg.rl.steps, cfg.checkpoint.every)})")
        warm = not cfg.model.init_from and cfg.warmstart.enabled
        steps = f"{cfg.rl.steps} RL step{'s' if cfg.rl.steps != 1 else ''}"
        if warm:  # rl.steps=0: a warm start alone, as compare starts one (not "then 0 RL steps")
            steps = "warm start only, no RL steps" if cfg.rl.steps == 0 else f"warm start, then {steps}"
        return (f"{head}: {steps} → {self.out}/ (metrics.jsonl; "
                f"{checkpoint_plan(0, cfg.rl.steps, cfg.checkpoint.every)})")

    def _prepare_output_dir(self):
        self.out.mkdir(parents=True, exist_ok=True)
        if self.force:
            removed = existing_run_artifacts(self.out)
            for name in removed:
                p = self.out / name.rstrip("/")
                shutil.rmtree(p) if p.is_dir() else p.unlink()
            if removed:
                self.log(f"--force: removed the earlier run's {', '.join(removed)} from {self.out}")
        if self.ckpt_dir.is_dir():  # leftovers of a write that was killed
            for tmp in self.ckpt_dir.glob(".tmp_*"):
                shutil.rmtree(tmp, ignore_errors=True)
            for bad in self._unusable:  # kept for inspection, out of the way of resume and pruning
                aside = bad.with_name(bad.name + ".unusable")
                shutil.rmtree(aside, ignore_errors=True)
                os.replace(bad, aside)
                self.log(f"moved the unusable checkpoint {bad.name} to {aside.name}")

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
    def save_checkpoint(self) -> Path:
        """Write ``checkpoints/step_N`` atomically. A write that fails (disk full, quota, I/O error) removes
        its temporary directory and raises :class:`CheckpointWriteError`: one line naming the checkpoint."""
        final = self.ckpt_dir / f"step_{self.step:06d}"
        try:
            return self._save_checkpoint()
        except BaseException as err:  # a second Ctrl-C mid-write too: no half-written directory left behind
            reason = write_failure_reason(err, self.ckpt_dir) if is_write_failure(err) else None
            shutil.rmtree(self.ckpt_dir / f".tmp_{final.name}_{os.getpid()}", ignore_errors=True)
            if reason is None:
                raise
            kept = (f"the newest complete checkpoint is {self.last_checkpoint}" if self.last_checkpoint
                    else "no checkpoint of this run was written")
            raise CheckpointWriteError(f"cannot write checkpoint {final}: {reason} ({kept})") from err

    def _save_checkpoint(self) -> Path:
        name = f"step_{self.step:06d}"
        final = self.ckpt_dir / name
        if self._saved_step == self.step and final.is_dir():
            return final  # already on disk (e.g. the checkpoint this run resumed from)
        tmp = self.ckpt_dir / f".tmp_{name}_{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        self.policy.save_pretrained(str(tmp / "policy"), safe_serialization=True)
        self.tokenizer.save_pretrained(str(tmp / "tokenizer"))
        if self.critic is not None:
            self.critic.save_pretrained(str(tmp / "critic"), safe_serialization=True)
        ordinary_file_modes(tmp)  # safetensors creates its files 0600; every other file is 0666 - umask
        if os.environ.get("NEMO_GRANULAR_TEST_CHECKPOINT_DELAY"):  # test hook: widen the write window
            time.sleep(float(os.environ["NEMO_GRANULAR_TEST_CHECKPOINT_DELAY"]))
        torch.save({"policy": self.opt.state_dict(),
                    "critic": self.critic_opt.state_dict() if self.critic_opt else None}, tmp / "optimizer.pt")
        torch.save({"torch": torch.get_rng_state(), "python": random.getstate(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}, tmp / "rng.pt")
        state = {"step": self.step, "samples": self.samples, "wall_time": self.wall, "algorithm": self.cfg.algorithm,
                 "data_position": self.step, "espo_alpha": self.espo_alpha, "seed": self.cfg.seed}
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))
        (tmp / "config.yaml").write_text(dump_config(self.cfg))
        write_manifest(tmp)  # fsyncs every file, then records the sizes
        if final.exists():  # a same-step leftover (e.g. an unusable one): set aside, never half-replaced
            old = self.ckpt_dir / f".tmp_old_{name}_{os.getpid()}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        fsync_dir(self.ckpt_dir)
        atomic.write_text(self.ckpt_dir / "latest", name + "\n")
        self._saved_step = self.step
        self.last_checkpoint = final
        self._prune()
        return final

    def _prune(self):
        for old in step_dirs(self.ckpt_dir)[self.cfg.checkpoint.keep:]:
            shutil.rmtree(old, ignore_errors=True)

    def _load_state(self, loaded):
        path, state = loaded.path, loaded.state
        self.step, self.samples, self.wall = int(state["step"]), int(state["samples"]), float(state["wall_time"])
        self.espo_alpha = state.get("espo_alpha")
        if self.espo_alpha is not None:
            self.loss_fn.set_espo_alpha(self.espo_alpha)
        try:
            self.opt.load_state_dict(loaded.optimizer["policy"])
            if self.critic_opt is not None and loaded.optimizer.get("critic"):
                self.critic_opt.load_state_dict(loaded.optimizer["critic"])
        except (ValueError, KeyError, RuntimeError) as err:
            raise CheckpointError(f"{path / 'optimizer.pt'}: does not fit this model "
                                  f"({str(err).splitlines()[0]})") from None
        rng = loaded.rng
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if rng.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        self._saved_step = self.step
        self.last_checkpoint = path  # the start line said "resuming at step … from <path>": not said twice

    # ------------------------------------------------------------------ one RL step
    def rollout(self, step: int) -> dict:
        cfg = self.cfg.rl
        G = 1 if self.sppo else cfg.generations_per_prompt
        P = cfg.prompts_per_step * cfg.generations_per_prompt // G  # SPPO: same samples, one per prompt
        data_gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + step)
        problems = [p for p in self.task.sample(P, data_gen) for _ in range(G)]
        self.policy.eval()
        engine = (self.policy if cfg.generation_mismatch == 0 else  # π_gen ≠ π_old (docs/algorithms/offpolicy.md)
                  perturbed_copy(self.policy, cfg.generation_mismatch, generation_seed(self.cfg.seed, step)))
        gen = generate(engine, self.tokenizer, [p.prompt for p in problems], max_new_tokens=cfg.max_new_tokens,
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
        missing = [k for k in BATCH_KEYS if k not in batch]
        if missing:  # a key the batch schema declares and the trainer failed to build
            raise RuntimeError(f"the rollout batch lacks {missing} (nemo_granular.batch_schema.POLICY_BATCH)")
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
        col = first_response_index(batch["token_mask"] > 0)
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
        t0, cpu0 = time.time(), time.process_time()
        batch = self.rollout(self.step)
        t_gen = time.time() - t0
        if self.espo_alpha is None and (self.loss_fn.espo_alpha_pending
                                        or (self.step == 0 and self.cfg.rl.calibrate_espo_alpha_to)):
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
        self.log(f"espo.alpha calibrated to {self.espo_alpha:.4g} (mean π_old entropy {mean_h:.3f} nats, "
                 f"target mean ε {target})")

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
            rec.update({f"train/{k}": v for k, v in batch_mismatch_extrema(
                batch, g.granularity, g.entropy_cut_points[0]).items()})
        n = len(per_step)
        for k in per_step[0]:
            vals = [m[k] for m in per_step]
            if k not in _EXTREMA:
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
        return greedy_accuracy(self.policy, self.tokenizer, self.task.heldout, self.cfg.rl.max_new_tokens,
                               self.device, self.autocast, self.cfg.task.answer_pattern)

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
        self.summary(f"done: {cfg.algorithm} step {self.step}/{cfg.rl.steps} ({self.samples} samples, "
                     f"{self.wall:.0f} s of RL); held-out accuracy {accuracy}; checkpoint {self.last_checkpoint}; "
                     f"metrics {self.sinks.path}")
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


class Progress:
    """A tqdm bar when stderr is a terminal and ``logger.progress`` is on; else one plain line
    every ``logger.log_every`` steps (and at the last step). Accuracy shows its latest value."""

    def __init__(self, cfg: TrainConfig, step: int, accuracy: float | None, log):
        self.total, self.every, self.log = cfg.rl.steps, cfg.logger.log_every, log
        self.acc = accuracy
        self.t0, self.step0 = time.time(), step
        self.bar = None
        if cfg.logger.progress and sys.stderr.isatty() and step < cfg.rl.steps:
            from tqdm.auto import tqdm
            self.bar = tqdm(total=cfg.rl.steps, initial=step, desc=cfg.algorithm, dynamic_ncols=True, file=sys.stderr)

    def update(self, rec: dict) -> None:
        self.acc = rec.get("validation/accuracy", self.acc)
        clip = rec.get("train/clip_frac_low", 0.0) + rec.get("train/clip_frac_high", 0.0)
        fields = {"reward": f"{rec['train/reward']:.3f}", "clip": f"{clip:.4f}"}
        if self.acc is not None:
            fields["acc"] = f"{self.acc:.3f}"
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(fields)
            return
        step = rec["step"]
        if self.every and (step % self.every == 0 or step == self.total):
            rate = (time.time() - self.t0) / max(1, step - self.step0)
            self.log(f"step {step}/{self.total}: " + ", ".join(f"{k} {v}" for k, v in fields.items())
                     + f" ({rate:.2f} s/step)")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def prompt_only(input_ids: torch.Tensor, token_mask: torch.Tensor, pad_id: int) -> torch.Tensor:
    """The prompt of each row (tokens before the first response token), right padded, trimmed."""
    first = first_response_index(token_mask > 0)
    width = max(1, int(first.max()))
    col = torch.arange(width, device=input_ids.device)[None, :]
    return torch.where(col < first[:, None], input_ids[:, :width], torch.full_like(input_ids[:, :width], pad_id))


class MetricSinks:
    """metrics.jsonl (always), TensorBoard and wandb (when enabled and installed).

    On resume the records past the checkpoint's step (steps that are redone) move to
    ``metrics.superseded.jsonl``: nothing already written is lost."""

    def __init__(self, out: Path, cfg: TrainConfig, resume_step: int | None, log=None):
        self.path = out / "metrics.jsonl"
        self.last_step = self.first_accuracy = self.last_accuracy = None
        if resume_step is not None and self.path.exists():
            keep, drop = [], []
            for line in self.path.read_text().splitlines():
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                    ok = int(rec["step"]) <= resume_step
                except (ValueError, KeyError, TypeError):  # e.g. a line cut short by a kill
                    rec, ok = None, False
                (keep if ok else drop).append(line)
                if ok:
                    self._track(rec)
            if drop:
                with (out / "metrics.superseded.jsonl").open("a") as fh:
                    fh.write("".join(line + "\n" for line in drop))
                if log:
                    log(f"{len(drop)} metrics.jsonl record(s) past step {resume_step} moved to "
                        "metrics.superseded.jsonl (those steps are redone)")
            atomic.write_text(self.path, "".join(line + "\n" for line in keep))
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

    def _track(self, rec: dict) -> None:
        self.last_step = rec["step"]
        acc = rec.get("validation/accuracy")
        if isinstance(acc, (int, float)):
            self.first_accuracy = acc if self.first_accuracy is None else self.first_accuracy
            self.last_accuracy = acc

    def write(self, rec: dict) -> None:
        self.fh.write(json.dumps(rec) + "\n")
        self.fh.flush()
        self._track(rec)
        # a Unix time is no curve (and float32 TensorBoard scalars would round it to minutes): metrics.jsonl only
        scalars = {k: v for k, v in rec.items() if isinstance(v, (int, float)) and k != "step" and math.isfinite(v)
                   and not k.endswith("_unix")}
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, rec["step"])
        if self.wandb is not None:
            self.wandb.log(scalars, step=rec["step"])

    def close(self):
        if self.fh.closed:
            return
        self.fh.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
