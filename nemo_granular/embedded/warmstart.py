"""Supervised warm start on worked solutions, until greedy held-out accuracy reaches a target.

RL needs some successes. Accuracy jumps abruptly at a seed-dependent step on this task, so
the stop rule is an accuracy threshold, not a fixed step count.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path

import torch

from .rollout import generate
from .task import ANSWER_RE, verify


def sft_batch(tokenizer, problems, device):
    """Right-padded prompt+solution+eos with a loss mask on the solution tokens only."""
    texts = [p.prompt + p.solution for p in problems]
    enc = tokenizer(texts, add_special_tokens=False)["input_ids"]
    plen = [len(tokenizer(p.prompt, add_special_tokens=False)["input_ids"]) for p in problems]
    rows = [ids + [tokenizer.eos_token_id] for ids in enc]
    S = max(map(len, rows))
    ids = torch.full((len(rows), S), tokenizer.pad_token_id, dtype=torch.long)
    lengths = torch.tensor([len(r) for r in rows])
    flat = torch.tensor([t for r in rows for t in r])
    col = torch.arange(S).expand(len(rows), S)
    ids[col < lengths[:, None]] = flat
    loss_mask = (col >= torch.tensor(plen)[:, None]) & (col < lengths[:, None])
    return ids.to(device), lengths.to(device), loss_mask.to(device)


@torch.no_grad()
def greedy_accuracy(
    model, tokenizer, problems, max_new_tokens, device, autocast_dtype=None, answer_pattern=None
) -> float:
    was_training = model.training
    model.eval()
    gen = generate(
        model,
        tokenizer,
        [p.prompt for p in problems],
        max_new_tokens=max_new_tokens,
        temperature=1.0,
        greedy=True,
        device=device,
        autocast_dtype=autocast_dtype,
    )
    texts = decode_responses(tokenizer, gen)
    model.train(was_training)
    rewards, _ = verify(texts, [p.answer for p in problems], answer_pattern or ANSWER_RE)
    return rewards.mean().item()


def decode_responses(tokenizer, gen) -> list[str]:
    resp, n = gen["response_ids"].tolist(), gen["response_len"].tolist()
    return tokenizer.batch_decode([r[:k] for r, k in zip(resp, n)], skip_special_tokens=True)


def check_worked_solutions(task) -> None:
    """The warm start trains on worked solutions: every task record needs one."""
    probe = task.sample(8, torch.Generator().manual_seed(0))
    if not all(p.solution for p in probe):
        raise ValueError(
            "warmstart.enabled: the warm start needs worked solutions ('solution' in every JSONL "
            "record); set warmstart.enabled=false for a model that already solves some problems"
        )


def warm_start(
    model, tokenizer, task, cfg, rl_cfg, device, seed: int, log=print, autocast_dtype=None, answer_pattern=None
) -> dict:
    """Train on worked solutions; returns {'steps', 'accuracy', 'seconds'}."""
    check_worked_solutions(task)
    gen = torch.Generator().manual_seed(seed * 7919 + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, cfg.warmup_steps)))
    model.train()
    t0, acc, step = time.time(), 0.0, 0
    for step in range(1, cfg.max_steps + 1):
        ids, lengths, loss_mask = sft_batch(tokenizer, task.sample(cfg.batch_size, gen), device)
        attention = (torch.arange(ids.shape[1], device=device)[None] < lengths[:, None]).long()
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
        ).view_as(ids[:, 1:])
        m = loss_mask[:, 1:].float()
        loss = (nll * m).sum() / m.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if not math.isfinite(loss.item()):
            raise RuntimeError(f"warm start diverged at step {step} (loss {loss.item()})")
        if step % cfg.eval_every == 0 or step == cfg.max_steps:
            acc = greedy_accuracy(
                model, tokenizer, task.heldout, rl_cfg.max_new_tokens, device, autocast_dtype, answer_pattern
            )
            log(f"warm start step {step}: loss {loss.item():.3f}, greedy held-out accuracy {acc:.3f}")
            if acc >= cfg.target_accuracy:
                break
    if acc < cfg.target_accuracy:  # RL still starts, from a weaker policy than asked for: say so
        log(
            f"warm start missed its target: greedy held-out accuracy {acc:.3f} < warmstart.target_accuracy="
            f"{cfg.target_accuracy:g} after warmstart.max_steps={cfg.max_steps} steps; RL starts from this policy "
            "(more warmstart.max_steps would get closer)"
        )
    return {"steps": step, "accuracy": acc, "seconds": time.time() - t0}


# ---------------------------------------------------------------------------- cache key
# source files whose code determines a warm-started policy (model, tokenizer, task, sampling, SFT)
_KEY_SOURCES = ("models.py", "task.py", "rollout.py", "warmstart.py")


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _dir_fingerprint(path: Path) -> list:
    """Names, sizes and mtimes of a model directory's files (hashing gigabytes would be slow)."""
    return sorted(
        (str(f.relative_to(path)), f.stat().st_size, f.stat().st_mtime_ns) for f in path.rglob("*") if f.is_file()
    )


def warmstart_key(cfg) -> tuple[str, dict]:
    """(key, what it is made of) for the warm-started policy that ``cfg`` would produce.

    Everything that determines it: seed, threads and device (results are bit-reproducible only at
    a fixed thread count), the model, task and warm-start settings, the generation length of the
    greedy evaluation that stops it, the contents of ``task.path`` and ``model.path``, the code
    that builds model, tokenizer and task, and the torch / transformers / tokenizers versions.
    """
    from importlib.metadata import PackageNotFoundError, version

    import torch

    from .. import __version__

    device = "cuda" if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()) else "cpu"
    files = {}
    if cfg.task.kind == "jsonl" and cfg.task.path and Path(cfg.task.path).is_file():
        files["task.path"] = _file_digest(Path(cfg.task.path))
    if cfg.model.path and Path(cfg.model.path).is_dir():
        files["model.path"] = _dir_fingerprint(Path(cfg.model.path))
    versions = {"nemo_granular": __version__}
    for pkg in ("torch", "transformers", "tokenizers"):
        try:
            versions[pkg] = version(pkg)
        except PackageNotFoundError:
            versions[pkg] = None
    here = Path(__file__).resolve().parent
    parts = {
        "seed": cfg.seed,
        "threads": cfg.threads,
        "device": device,
        "model": cfg.model.model_dump(mode="json", exclude={"init_from"}),
        "task": cfg.task.model_dump(mode="json"),
        "warmstart": cfg.warmstart.model_dump(mode="json"),
        "rl.max_new_tokens": cfg.rl.max_new_tokens,
        "files": files,
        "versions": versions,
        "code": {name: _file_digest(here / name) for name in _KEY_SOURCES},
    }
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16], parts
