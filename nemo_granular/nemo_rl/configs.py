"""Load a config the way NeMo-RL does, with ``nemo_rl/upstream/`` resolved to NeMo-RL's own configs.

The example configs inherit NeMo-RL's example configs: ``defaults: nemo_rl/upstream/grpo_math_1B.yaml``
(``upstream/...`` from ``examples/configs/nemo_rl/``). NeMo-RL's ``load_config`` resolves
``defaults:`` relative to the file and cannot read environment variables, so without help the
``upstream`` folder would have to be a hand-made link to ``<NeMo-RL>/examples/configs``.
:func:`load_config` removes that step: a ``defaults:`` entry that does not exist and goes
through a folder named ``upstream`` is resolved against NeMo-RL's ``examples/configs``, found as

1. ``$NEMO_RL_SRC/examples/configs`` (``NEMO_RL_SRC`` = a NeMo-RL checkout), else
2. the checkout the importable ``nemo_rl`` package lives in (``<checkout>/nemo_rl/__init__.py``,
   as with NeMo-RL's own ``uv run`` / editable install).

The files whose chain needs it are copied, with those entries made absolute, into a temporary
folder, and NeMo-RL's own ``nemo_rl.utils.config.load_config`` loads the copy: the result is
exactly NeMo-RL's (same merge and ``_override_`` rules). An existing ``upstream`` link still
works (the entry then exists and is left alone). Problems raise :class:`ConfigFileError` with a
one-line message naming the file.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = [
    "ConfigFileError",
    "UPSTREAM_DIR",
    "nemo_rl_configs_dir",
    "stage_config",
    "load_config",
    "check_config_files",
]

UPSTREAM_DIR = "upstream"
HOW_TO = (
    "set NEMO_RL_SRC to your NeMo-RL checkout (its examples/configs are used), or run where "
    "nemo_rl is importable from its checkout (e.g. `uv run` in NeMo-RL)"
)


class ConfigFileError(FileNotFoundError):
    """A config file (or a ``defaults:`` parent) cannot be found or read; one-line message."""


def nemo_rl_configs_dir() -> Path | None:
    """NeMo-RL's ``examples/configs``: ``$NEMO_RL_SRC`` first, else the importable package's checkout."""
    src = os.environ.get("NEMO_RL_SRC")
    if src:
        d = Path(src).expanduser() / "examples" / "configs"
        if not d.is_dir():
            raise ConfigFileError(f"NEMO_RL_SRC={src} has no examples/configs folder (expected a NeMo-RL checkout)")
        return d.resolve()
    try:
        spec = importlib.util.find_spec("nemo_rl")  # locates the package without importing it
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin:
        return None
    d = Path(spec.origin).resolve().parents[1] / "examples" / "configs"
    return d if d.is_dir() else None


def _defaults(cfg: Any) -> list[str] | None:
    from omegaconf import ListConfig

    if "defaults" not in cfg:
        return None
    d = cfg["defaults"]
    if isinstance(d, (list, ListConfig)):
        return [str(x) for x in d]
    return [str(d)]


def _load_yaml(path: Path):
    from omegaconf import DictConfig, OmegaConf

    if not path.is_file():
        raise ConfigFileError(f"{path}: config file not found")
    try:
        cfg = OmegaConf.load(path)
    except Exception as err:  # noqa: BLE001 - YAML errors: one line naming the file
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigFileError(f"{path}: cannot parse YAML ({first})") from None
    if not isinstance(cfg, DictConfig):
        raise ConfigFileError(f"{path}: a config must be a mapping at the top level")
    return cfg


def _upstream_rest(entry: str) -> str | None:
    parts = Path(entry).parts
    if UPSTREAM_DIR not in parts:
        return None
    i = len(parts) - 1 - parts[::-1].index(UPSTREAM_DIR)
    rest = parts[i + 1 :]
    return str(Path(*rest)) if rest else None


def stage_config(
    path: str | os.PathLike, workdir: str | os.PathLike, nemo_configs: Path | None = None, _seen: tuple[Path, ...] = ()
) -> Path:
    """The file NeMo-RL's ``load_config`` should read for ``path``: ``path`` itself when its whole
    ``defaults:`` chain exists, else a copy in ``workdir`` whose entries are absolute (``upstream``
    entries pointing into NeMo-RL's ``examples/configs``)."""
    from omegaconf import OmegaConf

    path = Path(path).expanduser().absolute()
    if path in _seen:
        raise ConfigFileError(f"{path}: defaults chain loops back to this file")
    cfg = _load_yaml(path)
    entries = _defaults(cfg)
    if not entries:
        return path
    new: list[str] = []
    changed = False
    for entry in entries:
        parent = Path(entry) if entry.startswith("/") else path.parent / entry
        if parent.is_file():
            staged = stage_config(parent, workdir, nemo_configs, _seen + (path,))
            changed |= staged != parent
            new.append(str(staged))
            continue
        rest = _upstream_rest(entry)
        if rest is None:
            raise ConfigFileError(f"{path}: defaults entry {entry!r}: {parent} not found")
        base = nemo_configs if nemo_configs is not None else nemo_rl_configs_dir()
        if base is None:
            raise ConfigFileError(
                f"{path}: defaults entry {entry!r} inherits NeMo-RL's example configs, which were not found: {HOW_TO}"
            )
        target = base / rest
        if not target.is_file():
            raise ConfigFileError(
                f"{path}: defaults entry {entry!r}: NeMo-RL has no examples/configs/{rest} "
                f"(looked in {base}; a NeMo-RL checkout at commit 7ea279ab is expected)"
            )
        new.append(str(target))
        changed = True
    if not changed:
        return path
    cfg["defaults"] = new if len(new) > 1 else new[0]
    fd, tmp = tempfile.mkstemp(prefix=path.stem + ".", suffix=".yaml", dir=workdir)
    os.close(fd)
    OmegaConf.save(cfg, tmp, resolve=False)
    return Path(tmp)


def load_config(path: str | os.PathLike, nemo_configs: Path | None = None):
    """NeMo-RL's ``load_config(path)`` with ``upstream`` parents resolved (see module docstring).

    Needs NeMo-RL importable (``nemo_rl.utils.config``); raises :class:`ConfigFileError` (one
    line) for a missing file or an unresolvable parent."""
    from .compat import get

    nemo_rl_load_config = get("load_config")

    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigFileError(f"{path}: config file not found")
    with tempfile.TemporaryDirectory(prefix="nemo_granular_cfg_") as workdir:
        staged = stage_config(path, workdir, nemo_configs)
        return nemo_rl_load_config(str(staged))


def check_config_files(path: str | os.PathLike) -> None:
    """Raise :class:`ConfigFileError` when the config file or one of its ``defaults:`` parents is missing.

    The launchers call it before they import NeMo-RL's algorithms (tens of seconds on a CPU): a wrong
    path is answered in a few seconds. Silent when NeMo-RL itself cannot be imported: the launcher
    then names what is missing."""
    if importlib.util.find_spec("nemo_rl") is None:
        return
    try:
        load_config(path)
    except ImportError:
        return


def load_resolved(path: str | os.PathLike, overrides: list[str] | None = None, notes: list[str] | None = None) -> dict:
    """What NeMo-RL's launchers do with ``--config`` and the overrides, as a plain dict:
    :func:`load_config` → ``parse_hydra_overrides`` → ``OmegaConf.to_container(resolve=True)``, then
    fitted to the importable NeMo-RL version (:func:`nemo_granular.nemo_rl.compat.adapt_config`: a key
    that version does not declare is dropped where it changes nothing, refused where it would; the
    drops are appended to ``notes``, or printed to stderr without it).
    Errors a user can fix raise a one-line :class:`ConfigFileError` / ``ValueError``."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from .compat import adapt_config, get

    OverridesError, parse_hydra_overrides = get("OverridesError"), get("parse_hydra_overrides")
    register_omegaconf_resolvers = get("register_omegaconf_resolvers")

    register_omegaconf_resolvers()
    cfg = load_config(path)
    if overrides:
        try:
            cfg = parse_hydra_overrides(cfg, list(overrides))
        except OverridesError as err:
            raise ValueError(_one_line(err)) from None
    try:
        resolved = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as err:
        raise ValueError(f"{path}: cannot resolve the config ({_one_line(err)})") from None
    adapted = adapt_config(resolved)
    if notes is None:
        for line in adapted:
            print(f"nemo_granular: {path}: {line}", file=sys.stderr)
    else:
        notes += adapted
    return resolved


def _one_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


ALLOW_RATIO_ONE = "allow_ratio_always_one"


def check_ratio_is_active(config: dict, algo_section: str, allow_key: str) -> None:
    """Refuse settings under which the importance ratio π_θ/π_old is identically 1, so the
    granular ratios (SSPO segments, ESPO groups, GSPO sequences) and their clipping do nothing:

    * ``loss_fn.force_on_policy_ratio: true`` (NeMo-RL's performance recipes set it; the loss
      then uses π_old := π_θ);
    * one optimizer step per rollout batch: ``num_prompts_per_step × num_generations_per_prompt
      == policy.train_global_batch_size`` (× ``ppo_epochs == 1`` for PPO). π_old is computed by
      the training policy right before the update, so the only step is on-policy.

    ``allow_key`` (e.g. ``nemo_granular.allow_ratio_always_one``) names the flag that accepts
    this explicitly; the caller skips the check when it is true. One-line ``ValueError``."""
    how = f"(or set {allow_key}: true to run with ratio 1 anyway)"
    loss = config.get("loss_fn") or {}
    if bool(loss.get("force_on_policy_ratio", False)):
        raise ValueError(
            "loss_fn.force_on_policy_ratio: true fixes the importance ratio at 1, so the granular "
            f"ratios and their clipping do nothing; set it to false {how}"
        )
    algo = config.get(algo_section) or {}
    policy = config.get("policy") or {}
    try:
        rows = int(algo["num_prompts_per_step"]) * int(algo["num_generations_per_prompt"])
        gbs = int(policy["train_global_batch_size"])
    except (KeyError, TypeError, ValueError):
        return  # NeMo-RL's own validation reports missing batch keys
    epochs = int(algo.get("ppo_epochs", 1) or 1) if algo_section == "ppo" else 1
    steps = (rows // gbs if gbs > 0 else 0) * epochs
    if steps <= 1:
        epoch_note = f" and {algo_section}.ppo_epochs={epochs}" if algo_section == "ppo" else ""
        raise ValueError(
            f"one optimizer step per rollout ({algo_section}.num_prompts_per_step × num_generations_per_prompt = "
            f"{rows}, policy.train_global_batch_size={gbs}{epoch_note}): that step is on-policy, the importance "
            f"ratio is 1 and the granular ratios/clipping do nothing; use several optimizer steps per rollout, "
            f"e.g. policy.train_global_batch_size={max(rows // 2, 1)} {how}"
        )
