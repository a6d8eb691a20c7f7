"""The embedded trainer's checkpoints on disk: atomic writes, validation, choice of what to resume.

A checkpoint is written into ``checkpoints/.tmp_step_N_<pid>/``, every file is fsynced, a
``manifest.json`` records each file's size, and only then is the directory renamed to
``step_N`` and ``checkpoints/latest`` replaced (``os.replace``). A process killed at any point
leaves either the previous complete checkpoint or the new one, plus a ``.tmp_*`` directory
that the next start removes.

On resume every candidate is validated before anything is loaded into the trainer: the
required files present, JSON parseable, safetensors headers covering the files, ``optimizer.pt``
and ``rng.pt`` loadable, sizes equal to the manifest. The newest complete checkpoint wins; each
one skipped is reported on one line naming the file, and when none is usable the error names
the file that broke the newest one.

:class:`CheckpointWriter` writes the trainer's checkpoints this way, and
:func:`restore_optimizers_and_rng` loads a validated one's optimizer and RNG states back (the
trainer itself sets its step counters and models).
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import atomic
from ..cli_common import current_umask

STEP_RE = re.compile(r"step_(\d+)")
MANIFEST = "manifest.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from; the message is one line naming the file."""


class CheckpointWriteError(OSError):
    """A checkpoint that could not be written (disk full, ...); the message is one line naming it."""


class NothingToResume(FileNotFoundError):
    """``--resume`` on an output directory without any checkpoint."""


@dataclass
class LoadedCheckpoint:
    path: Path
    state: dict
    optimizer: dict
    rng: dict


def step_dirs(ckpt_dir: Path) -> list[Path]:
    """``step_N`` directories, newest (highest N) first."""
    if not ckpt_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_dir.iterdir() if p.is_dir() and (m := STEP_RE.fullmatch(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


# ---------------------------------------------------------------------------- validation
def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: not valid JSON ({str(err).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def _check_safetensors(path: Path) -> None:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except Exception as err:  # noqa: BLE001 - the Rust error type is not importable by name everywhere
        raise CheckpointError(f"{path}: unreadable safetensors ({str(err).splitlines()[0]})") from None


def _check_model_dir(model_dir: Path) -> None:
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: missing")
    _read_json(model_dir / "config.json")
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(_read_json(index).get("weight_map", {}).values()))
        if not shards:
            raise CheckpointError(f"{index}: empty weight_map")
    else:
        shards = ["model.safetensors"]
    for shard in shards:
        if not (model_dir / shard).is_file():
            raise CheckpointError(f"{model_dir / shard}: missing")
        _check_safetensors(model_dir / shard)


def _torch_load(path: Path, weights_only: bool):
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    try:
        return torch.load(path, weights_only=weights_only, map_location="cpu")
    except Exception as err:  # noqa: BLE001 - zip, pickle and EOF errors all mean "unreadable"
        first = (str(err).splitlines() or [type(err).__name__])[0]
        raise CheckpointError(f"{path}: unreadable ({first[:160]})") from None


def validate(path: Path) -> LoadedCheckpoint:
    """Check one checkpoint completely; returns its small parts already loaded."""
    manifest = path / MANIFEST
    if manifest.is_file():  # written last before the rename: every file with its size
        for rel, size in _read_json(manifest).get("files", {}).items():
            f = path / rel
            if not f.is_file():
                raise CheckpointError(f"{f}: missing")
            if f.stat().st_size != size:
                raise CheckpointError(f"{f}: {f.stat().st_size} bytes, the manifest says {size} (truncated?)")
    state = _read_json(path / "trainer_state.json")
    for key in ("step", "samples", "wall_time"):
        if not isinstance(state.get(key), (int, float)):
            raise CheckpointError(f"{path / 'trainer_state.json'}: no numeric {key!r}")
    _check_model_dir(path / "policy")
    if state.get("algorithm") == "sppo" or (path / "critic").exists():
        _check_model_dir(path / "critic")
    tok = path / "tokenizer"
    if not ((tok / "tokenizer.json").is_file() or (tok / "tokenizer_config.json").is_file()):
        raise CheckpointError(f"{tok}: no tokenizer.json or tokenizer_config.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (tok / name).is_file():
            _read_json(tok / name)
    optimizer = _torch_load(path / "optimizer.pt", weights_only=True)
    rng = _torch_load(path / "rng.pt", weights_only=False)  # python's RNG state is a tuple of ints
    if not isinstance(optimizer, dict) or "policy" not in optimizer:
        raise CheckpointError(f"{path / 'optimizer.pt'}: no 'policy' optimizer state")
    if not isinstance(rng, dict) or "torch" not in rng or "python" not in rng:
        raise CheckpointError(f"{path / 'rng.pt'}: no 'torch'/'python' RNG state")
    return LoadedCheckpoint(path, state, optimizer, rng)


def find_resumable(ckpt_dir: Path, warn=None) -> tuple[LoadedCheckpoint, list[Path]]:
    """The newest complete checkpoint, and the unusable ones newer than it.

    Raises :class:`NothingToResume` when there is no checkpoint at all, :class:`CheckpointError`
    (naming the file) when none of them is complete.
    """
    pointer = ckpt_dir / "latest"
    named = pointer.read_text().strip() if pointer.is_file() else None
    candidates = step_dirs(ckpt_dir)
    if not candidates and not named:
        raise NothingToResume(
            f"--resume: nothing to resume in {ckpt_dir} (no checkpoint); drop --resume to start a fresh run"
        )
    problems: list[str] = []
    if named and not (ckpt_dir / named).is_dir():
        problems.append(f"{pointer} names {named}, which does not exist")
    skipped: list[Path] = []
    for cand in candidates:
        try:
            loaded = validate(cand)
        except CheckpointError as err:
            problems.append(str(err))
            skipped.append(cand)
            continue
        for problem in problems:
            if warn:
                warn(f"warning: {problem}; resuming from {cand.name}, the newest complete checkpoint")
        return loaded, skipped
    raise CheckpointError(f"no complete checkpoint to resume in {ckpt_dir}: {problems[0]}")


# ---------------------------------------------------------------------------- writing
def fsync_tree(root: Path) -> dict[str, int]:
    """fsync every file under ``root`` and the directories; returns {relative path: size}."""
    sizes = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            f = Path(dirpath) / name
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            sizes[str(f.relative_to(root))] = f.stat().st_size
        fsync_dir(Path(dirpath))
    return sizes


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on a directory
        pass
    finally:
        os.close(fd)


def write_manifest(root: Path) -> None:
    sizes = fsync_tree(root)
    atomic.write_text(root / MANIFEST, json.dumps({"files": sizes}, indent=1, sort_keys=True), fsync=True)


def ordinary_file_modes(root: Path) -> None:
    """Give every file under ``root`` the mode an ordinary new file gets: 0666 minus the umask."""
    mask = current_umask()
    for f in root.rglob("*"):
        if f.is_file() and not f.is_symlink():
            os.chmod(f, 0o666 & ~mask)


_NO_SPACE_FREE_BYTES = 16 << 20


def is_write_failure(err: BaseException) -> bool:
    """An error raised by writing files: an OSError, safetensors' own error type, or torch.save's
    RuntimeError (its zip writer reports a failed write without the errno)."""
    return isinstance(err, (OSError, RuntimeError)) or type(err).__name__ == "SafetensorError"


def write_failure_reason(err: BaseException, where: Path) -> str:
    """One line saying why a write under ``where`` failed: the OS's words when the error carries an
    errno, "No space left on device" when the file system is (nearly) full, else the error's first line."""
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    text = (str(err).strip().splitlines() or [type(err).__name__])[0]
    try:
        full = shutil.disk_usage(where).free < _NO_SPACE_FREE_BYTES
    except OSError:
        full = False
    if full or "os error 28" in text:
        return os.strerror(errno.ENOSPC)
    return text


# ---------------------------------------------------------------------------- the trainer's checkpoints
class CheckpointWriter:
    """Writes a run's ``checkpoints/step_N`` (atomically, as the module docstring says) and prunes all
    but the newest ``keep``. Remembers the newest complete checkpoint (``last``): a step already on
    disk (the one the run resumed from, or the last step's after a periodic save) is not written twice."""

    def __init__(self, ckpt_dir: Path, keep: int):
        self.dir, self.keep = ckpt_dir, keep
        self.last: Path | None = None
        self._saved_step: int | None = None

    def resumed_from(self, path: Path, step: int) -> None:
        """The run continues from ``path`` (step ``step``): that is the newest checkpoint."""
        self._saved_step = step
        self.last = path

    def save(self, step: int, *, policy, tokenizer, critic, opt, critic_opt, state: dict, config: str) -> Path:
        """Write ``step_N`` of ``step``: the models (``critic`` may be None), the optimizer and RNG states,
        ``state`` (trainer_state.json) and ``config`` (config.yaml). A write that fails (disk full,
        quota, I/O error) removes its temporary directory and raises :class:`CheckpointWriteError`: one
        line naming the checkpoint."""
        final = self.dir / f"step_{step:06d}"
        try:
            return self._save(step, policy, tokenizer, critic, opt, critic_opt, state, config)
        except BaseException as err:  # a second Ctrl-C mid-write too: no half-written directory left behind
            reason = write_failure_reason(err, self.dir) if is_write_failure(err) else None
            shutil.rmtree(self.dir / f".tmp_{final.name}_{os.getpid()}", ignore_errors=True)
            if reason is None:
                raise
            kept = (
                f"the newest complete checkpoint is {self.last}"
                if self.last
                else "no checkpoint of this run was written"
            )
            raise CheckpointWriteError(f"cannot write checkpoint {final}: {reason} ({kept})") from err

    def _save(self, step, policy, tokenizer, critic, opt, critic_opt, state, config) -> Path:
        name = f"step_{step:06d}"
        final = self.dir / name
        if self._saved_step == step and final.is_dir():
            return final  # already on disk (e.g. the checkpoint this run resumed from)
        tmp = self.dir / f".tmp_{name}_{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        policy.save_pretrained(str(tmp / "policy"), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp / "tokenizer"))
        if critic is not None:
            critic.save_pretrained(str(tmp / "critic"), safe_serialization=True)
        ordinary_file_modes(tmp)  # safetensors creates its files 0600; every other file is 0666 - umask
        if os.environ.get("NEMO_GRANULAR_TEST_CHECKPOINT_DELAY"):  # test hook: widen the write window
            time.sleep(float(os.environ["NEMO_GRANULAR_TEST_CHECKPOINT_DELAY"]))
        torch.save(
            {"policy": opt.state_dict(), "critic": critic_opt.state_dict() if critic_opt else None},
            tmp / "optimizer.pt",
        )
        torch.save(
            {
                "torch": torch.get_rng_state(),
                "python": random.getstate(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            },
            tmp / "rng.pt",
        )
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))
        (tmp / "config.yaml").write_text(config)
        write_manifest(tmp)  # fsyncs every file, then records the sizes
        if final.exists():  # a same-step leftover (e.g. an unusable one): set aside, never half-replaced
            old = self.dir / f".tmp_old_{name}_{os.getpid()}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        fsync_dir(self.dir)
        atomic.write_text(self.dir / "latest", name + "\n")
        self._saved_step = step
        self.last = final
        for stale in step_dirs(self.dir)[self.keep :]:  # prune: the newest ``keep`` stay
            shutil.rmtree(stale, ignore_errors=True)
        return final


def restore_optimizers_and_rng(loaded: LoadedCheckpoint, opt, critic_opt) -> None:
    """Load the optimizer states (the critic's when both sides have one) and the RNG states that
    ``loaded`` saved. An optimizer state that does not fit the model raises :class:`CheckpointError`
    naming ``optimizer.pt``."""
    try:
        opt.load_state_dict(loaded.optimizer["policy"])
        if critic_opt is not None and loaded.optimizer.get("critic"):
            critic_opt.load_state_dict(loaded.optimizer["critic"])
    except (ValueError, KeyError, RuntimeError) as err:
        raise CheckpointError(
            f"{loaded.path / 'optimizer.pt'}: does not fit this model ({str(err).splitlines()[0]})"
        ) from None
    rng = loaded.rng
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
