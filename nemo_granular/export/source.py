"""What every checkpoint reader returns (:class:`ExportSource`) and source-format detection.

Detection (``--source auto``) looks at the directory structure only:

* ``<run>/checkpoints/latest`` (a run dir) or ``<dir>/latest`` → the embedded step dir it names;
* ``policy/config.json`` (HF model dir written by ``save_pretrained``) → **embedded**;
* ``policy/weights/iter_*`` / ``run_config.yaml`` / ``latest_checkpointed_iteration.txt`` → **megatron**;
* ``policy/weights/`` otherwise → **dcp** (NeMo-RL DTensor, torch distributed checkpoint);
* a directory of NeMo-RL ``step_N`` dirs → the highest N (what NeMo-RL resumes from).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

__all__ = ["ExportSource", "detect", "resolve_step_dir", "read_yaml", "algorithm_of", "hf_config_overrides"]


@dataclass
class ExportSource:
    """A checkpoint opened for export; ``state_dict`` is already validated and in HF on-disk layout."""

    kind: str  # embedded | dcp | megatron
    what: str  # policy | critic
    path: Path  # the step directory
    config: Any  # transformers PretrainedConfig
    state_dict: dict[str, torch.Tensor]
    reference: Callable[[], torch.nn.Module]  # builds the *source* model (fp32, eval) for verification
    tokenizer_dir: Optional[Path] = None
    generation_config_dir: Optional[Path] = None
    train_config: Optional[dict] = None
    algorithm: Optional[str] = None
    step: Optional[int] = None
    notes: list[str] = field(default_factory=list)

    @property
    def critic(self) -> bool:
        return self.what == "critic"

    def num_params(self) -> int:
        return sum(t.numel() for t in self.state_dict.values())


def read_yaml(path: Path) -> dict:
    """``yaml.safe_load`` of a config file; unknown tags (``!!python/...``) are read as plain data."""
    import yaml

    class _Loader(yaml.SafeLoader):
        pass

    def _any(loader, suffix, node):
        if isinstance(node, yaml.MappingNode):
            return loader.construct_mapping(node, deep=True)
        if isinstance(node, yaml.SequenceNode):
            return loader.construct_sequence(node, deep=True)
        return loader.construct_scalar(node)

    _Loader.add_multi_constructor("", _any)
    try:
        data = yaml.load(Path(path).read_text(), Loader=_Loader)  # noqa: S506 - SafeLoader subclass
    except yaml.YAMLError as err:
        raise ValueError(f"cannot parse {path}: {str(err).splitlines()[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a YAML mapping")
    return data


def algorithm_of(cfg: Optional[dict]) -> Optional[str]:
    """Algorithm name from a training config: ``algorithm`` (str or ``{name: ...}``), else
    ``loss_fn.granular.algorithm``, else the NeMo-RL section present (``grpo``/``ppo``/...)."""
    if not cfg:
        return None
    algo = cfg.get("algorithm")
    if isinstance(algo, str):
        return algo
    if isinstance(algo, dict) and isinstance(algo.get("name"), str):
        return algo["name"]
    granular = ((cfg.get("loss_fn") or {}).get("granular") or {}) if isinstance(cfg.get("loss_fn"), dict) else {}
    if isinstance(granular.get("algorithm"), str):
        return granular["algorithm"]
    for name in ("grpo", "ppo", "dpo", "sft", "distillation"):
        if isinstance(cfg.get(name), dict):
            return name
    return None


def hf_config_overrides(section: dict, origin: str) -> dict:
    """The ``hf_config_overrides`` of a NeMo-RL ``policy``/``value`` section: the keyword arguments
    NeMo-RL passes to ``AutoConfig.from_pretrained`` (DTensor workers) and
    ``AutoBridge.from_hf_pretrained`` (Megatron HF import) on top of ``model_name``'s config, so the
    exported config must get them the same way (e.g. a YaRN ``rope_scaling`` used in training)."""
    value = section.get("hf_config_overrides")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{origin}: hf_config_overrides must be a mapping, got {type(value).__name__}")
    return dict(value)


def _is_embedded_step(p: Path) -> bool:
    return (p / "policy" / "config.json").exists()


def _is_nemo_rl_step(p: Path) -> bool:
    return (p / "policy" / "weights").is_dir() or (p / "value" / "weights").is_dir()


def _is_megatron_weights(w: Path) -> bool:
    return (
        (w / "latest_checkpointed_iteration.txt").exists()
        or (w / "run_config.yaml").exists()
        or any(c.is_dir() and re.fullmatch(r"iter_\d+", c.name) for c in w.iterdir())
    )


def resolve_step_dir(src: Path) -> Path:
    """Run dir → ``checkpoints/<latest>``; ``latest`` file → its step; NeMo-RL checkpoint dir → max step_N."""
    src = Path(src)
    if not src.exists():
        raise FileNotFoundError(f"checkpoint {src} does not exist")
    if not src.is_dir():
        raise ValueError(f"checkpoint {src} is not a directory")
    for ckdir in (src / "checkpoints", src):
        latest = ckdir / "latest"
        if latest.is_file() and not _is_embedded_step(src) and not _is_nemo_rl_step(src):
            name = latest.read_text().strip()
            if not name or "/" in name or "\\" in name or name in (".", ".."):
                raise ValueError(f"{latest} must hold a step directory name, got {name!r}")
            step = ckdir / name
            if not step.is_dir():
                raise FileNotFoundError(f"{latest} names {name!r} but {step} does not exist")
            return step
    if not _is_embedded_step(src) and not _is_nemo_rl_step(src):
        steps = [
            (int(m.group(1)), c) for c in src.iterdir() if c.is_dir() and (m := re.fullmatch(r"step_(\d+)", c.name))
        ]
        if steps:
            return max(steps)[1]
    return src


def detect(step_dir: Path, what: str) -> str:
    """``embedded`` | ``dcp`` | ``megatron`` for a step directory (ValueError when none fits)."""
    if _is_embedded_step(step_dir):
        return "embedded"
    weights = step_dir / ("value" if what == "critic" else "policy") / "weights"
    if weights.is_dir():
        return "megatron" if _is_megatron_weights(weights) else "dcp"
    if _is_nemo_rl_step(step_dir):
        raise ValueError(
            f"{step_dir} has no {weights.relative_to(step_dir)} (is this a "
            f"{'PPO value' if what == 'critic' else 'policy'} checkpoint?)"
        )
    raise ValueError(
        f"cannot detect the checkpoint format of {step_dir}: expected policy/config.json "
        "(nemo-granular embedded), policy/weights/ (NeMo-RL), a run dir with checkpoints/latest, "
        "or a directory of step_N checkpoints"
    )


def read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except ValueError as err:
        raise ValueError(f"cannot parse {path}: {str(err).splitlines()[0]}") from None
