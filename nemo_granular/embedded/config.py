"""Embedded-trainer configuration: NeMo-style YAML with ``defaults:`` inheritance, overrides,
pydantic validation with one-line errors.

``defaults:`` (a path or list of paths, relative to the file that names them) are loaded
first and merged left to right, the file itself last — NeMo-RL's convention. Overrides use
Hydra's grammar subset ``a.b=v`` / ``+a.b=v`` / ``++a.b=v`` / ``~a.b`` with YAML values.
(OmegaConf does the merging; Hydra's composition system is not needed for this.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Optional

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    model_validator,
)

from ..config import AdvantageConfig, PolicyLossConfig, format_validation_error


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelConfig(_Strict):
    path: Optional[str] = None  # a local Hugging Face model directory (then the sizes below are ignored)
    init_from: Optional[str] = None  # HF policy dir to start RL from (skips the warm start)
    hidden_size: PositiveInt = 64
    num_layers: PositiveInt = 2
    num_heads: PositiveInt = 4
    num_kv_heads: PositiveInt = 2
    intermediate_size: PositiveInt = 256
    max_positions: PositiveInt = 128
    moe: bool = False
    num_experts: PositiveInt = 8
    experts_per_token: PositiveInt = 2
    expert_size: PositiveInt = 64

    @model_validator(mode="after")
    def _check(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"model.hidden_size ({self.hidden_size}) must be divisible by model.num_heads ({self.num_heads})"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError("model.num_heads must be divisible by model.num_kv_heads")
        if self.moe and not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError("model.experts_per_token must be in [1, model.num_experts]")
        return self


class CriticConfig(_Strict):
    path: Optional[str] = None  # local HF model dir for the critic (same tokenizer as the policy)
    hidden_size: Optional[PositiveInt] = None  # null: same as the policy; smaller = a small decoupled critic
    num_layers: Optional[PositiveInt] = None
    lr: PositiveFloat = 1e-3
    max_grad_norm: PositiveFloat = 1.0


class TaskConfig(_Strict):
    kind: Literal["arithmetic", "jsonl"] = "arithmetic"
    path: Optional[str] = None
    num_terms: int = Field(4, ge=2)
    max_term: PositiveInt = 9
    heldout_size: PositiveInt = 128
    # regex whose first group is the answer (default: the final "A:<int>" line), e.g. "\\boxed\\{([^}]*)\\}"
    answer_pattern: str = r"(?:^|\n)A:\s*(-?\d+)\s*$"

    @model_validator(mode="after")
    def _check(self):
        import re

        if self.kind == "jsonl" and not self.path:
            raise ValueError("task.path is required when task.kind is 'jsonl'")
        try:
            if re.compile(self.answer_pattern).groups < 1:
                raise ValueError("task.answer_pattern needs one capturing group (the answer)")
        except re.error as err:
            raise ValueError(f"task.answer_pattern is not a valid regex ({err})") from None
        return self


class WarmstartConfig(_Strict):
    enabled: bool = True
    batch_size: PositiveInt = 64
    lr: PositiveFloat = 3e-3
    warmup_steps: NonNegativeInt = 30
    max_steps: PositiveInt = 600
    target_accuracy: float = 0.5
    eval_every: PositiveInt = 25


class RLConfig(_Strict):
    steps: NonNegativeInt = 100
    prompts_per_step: PositiveInt = 16
    generations_per_prompt: PositiveInt = 8
    minibatches_per_rollout: PositiveInt = 4
    micro_batch_size: PositiveInt = 32
    lr: PositiveFloat = 1e-4
    max_grad_norm: PositiveFloat = 1.0
    weight_decay: float = 0.0
    temperature: PositiveFloat = 1.0
    max_new_tokens: PositiveInt = 32
    eval_every: PositiveInt = 20
    entropy_chunk_size: PositiveInt = 256
    # ESPO: set α on the first rollout so the mean ε equals this (e.g. GSPO's 3.5e-4); null keeps loss_fn's α
    calibrate_espo_alpha_to: Optional[PositiveFloat] = None
    # π_gen ≠ π_old: sample each rollout from a copy of the policy with relative weight noise σ
    # (docs/algorithms/offpolicy.md); 0: the policy itself (on-policy rollouts)
    generation_mismatch: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0

    @model_validator(mode="after")
    def _check(self):
        n = self.prompts_per_step * self.generations_per_prompt
        if n % self.minibatches_per_rollout:
            raise ValueError(
                f"rl.minibatches_per_rollout ({self.minibatches_per_rollout}) must divide "
                f"prompts_per_step*generations_per_prompt ({n})"
            )
        return self


class CheckpointConfig(_Strict):
    every: NonNegativeInt = 10  # RL steps between checkpoints (0: only at the end); always on a stop signal
    keep: PositiveInt = 2  # newest checkpoints kept


class LoggerConfig(_Strict):
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "nemo-granular"
    wandb_mode: Literal["online", "offline"] = "offline"
    progress: bool = True  # a progress bar when stderr is a terminal (else plain lines)
    log_every: NonNegativeInt = 10  # without a bar: one progress line every N steps (0: none)


class EmbeddedLossConfig(PolicyLossConfig):
    """``loss_fn`` here: NeMo-RL's keys with NeMo-RL's defaults, except β — this trainer keeps no
    reference policy, so ``reference_policy_kl_penalty`` defaults to 0 and must stay 0."""

    reference_policy_kl_penalty: float = 0.0


class GRPOSection(_Strict):
    adv_estimator: AdvantageConfig = Field(default_factory=AdvantageConfig)


class TrainConfig(_Strict):
    name: str = "run"
    seed: int = 0
    output_dir: str = "runs/run"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    threads: PositiveInt = 1
    model: ModelConfig = Field(default_factory=ModelConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    warmstart: WarmstartConfig = Field(default_factory=WarmstartConfig)
    rl: RLConfig = Field(default_factory=RLConfig)
    loss_fn: EmbeddedLossConfig = Field(default_factory=EmbeddedLossConfig)
    grpo: GRPOSection = Field(default_factory=GRPOSection)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logger: LoggerConfig = Field(default_factory=LoggerConfig)

    @model_validator(mode="after")
    def _coherent(self):
        alg = self.loss_fn.granular.algorithm
        est = self.grpo.adv_estimator.name
        if (est == "sppo") != (alg == "sppo"):
            raise ValueError(
                f"grpo.adv_estimator.name={est!r} does not fit loss_fn.granular.algorithm={alg!r} "
                "(SPPO's loss and estimator go together)"
            )
        if self.loss_fn.kl_coef != 0:
            raise ValueError(
                f"loss_fn.reference_policy_kl_penalty: {self.loss_fn.reference_policy_kl_penalty} needs a "
                "reference policy, which the embedded trainer does not keep; set it to 0"
            )
        return self

    @property
    def algorithm(self) -> str:
        return self.loss_fn.granular.algorithm


# ---------------------------------------------------------------------------- loading
# The local configs ship as package data, so an installed wheel finds them too.
LOCAL_CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "local"


def packaged_configs() -> list[str]:
    """Names of the packaged local configs (``grpo``, ``sspo``, ...)."""
    return sorted(p.stem for p in LOCAL_CONFIGS.glob("*.yaml"))


def resolve_config_path(path: str | Path) -> Path:
    """``path`` itself, or a packaged config when ``path`` is a bare name (``sspo``, ``sspo.yaml``)."""
    p = Path(path)
    if p.is_file() or p.parent != Path("."):
        return p
    packaged = LOCAL_CONFIGS / (p.name if p.suffix == ".yaml" else p.name + ".yaml")
    return packaged if packaged.is_file() else p


def load_yaml_with_defaults(path: str | Path, _chain: tuple = ()):
    """OmegaConf config of ``path`` with its ``defaults:`` chain merged in (child last)."""
    from omegaconf import DictConfig, OmegaConf

    path = Path(path)
    where = f" (named in defaults: of {_chain[-1]})" if _chain else ""
    if path.is_dir():
        raise IsADirectoryError(f"{path}: is a directory, not a config file{where}")
    if not path.is_file():
        hint = "" if path.parent != Path(".") else f" (packaged configs: {', '.join(packaged_configs())})"
        raise FileNotFoundError(f"config file not found: {path}{where or hint}")
    if path.resolve() in _chain:
        raise ValueError(f"{path}: defaults: cycle ({' → '.join(p.name for p in (*_chain, path.resolve()))})")
    try:
        cfg = OmegaConf.load(path)
    except Exception as err:  # noqa: BLE001 - yaml errors come in several types
        raise ValueError(_yaml_error(path, err)) from None
    if cfg is None or (isinstance(cfg, DictConfig) and not len(cfg)):
        # an empty file would silently train a whole default run
        raise ValueError(
            f"{path}: the config file is empty (no keys){where}: give it keys, or use a packaged config (--config grpo)"
        )
    if not isinstance(cfg, DictConfig):
        raise ValueError(f"{path}: the top level must be a mapping of keys, not a list")
    parents = cfg.pop("defaults", None) if "defaults" in cfg else None
    if parents is None:
        return cfg
    if isinstance(parents, str):
        parents = [parents]
    else:
        parents = list(parents) if OmegaConf.is_list(parents) else None
    if parents is None or not all(isinstance(p, str) for p in parents):
        raise ValueError(f"{path}: defaults: must be a file name or a list of file names")
    merged = OmegaConf.create({})
    for parent in parents:
        p = Path(parent)
        merged = OmegaConf.merge(
            merged, load_yaml_with_defaults(p if p.is_absolute() else path.parent / p, (*_chain, path.resolve()))
        )
    return OmegaConf.merge(merged, cfg)


def _yaml_error(path: Path, err: Exception) -> str:
    """``file:line:column: not valid YAML (what)`` for a YAML syntax error (line and column from 1)."""
    mark = getattr(err, "problem_mark", None)
    what = "; ".join(str(x) for x in (getattr(err, "context", None), getattr(err, "problem", None)) if x)
    if mark is None or not what:
        return f"{path}: not valid YAML ({(str(err).splitlines() or [type(err).__name__])[0]})"
    return f"{path}:{mark.line + 1}:{mark.column + 1}: not valid YAML ({what})"


def apply_overrides(cfg, overrides: list[str]):
    from omegaconf import OmegaConf

    for item in overrides:
        if item.startswith("~"):
            key = item[1:].split("=", 1)[0]
            parent, _, leaf = key.rpartition(".")
            node = OmegaConf.select(cfg, parent) if parent else cfg
            if node is None or leaf not in node:
                raise ValueError(f"override {item!r}: no key {key!r} to delete")
            node.pop(leaf)
            continue
        if "=" not in item:
            raise ValueError(f"override {item!r} is not of the form key=value")
        key, value = item.lstrip("+").split("=", 1)
        if not key or any(not part for part in key.split(".")):
            raise ValueError(f"override {item!r}: {key!r} is not a key (a.b.c)")
        try:
            parsed = OmegaConf.from_dotlist([f"{key}={value}"])
        except Exception as err:  # noqa: BLE001
            raise ValueError(f"override {item!r}: {str(err).splitlines()[0]}") from None
        try:
            cfg = OmegaConf.merge(cfg, parsed)
        except Exception as err:  # noqa: BLE001 - e.g. a list given where the config has a section
            raise ValueError(f"override {item!r}: {str(err).splitlines()[0]}") from None
    return cfg


def load_train_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """Load, merge, override and validate; every error is one line naming the field or file."""
    from omegaconf import OmegaConf

    cfg = load_yaml_with_defaults(resolve_config_path(path)) if path else OmegaConf.create({})
    from omegaconf.errors import OmegaConfBaseException

    cfg = apply_overrides(cfg, overrides or [])
    try:
        data = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as err:  # an interpolation that does not resolve
        key = getattr(err, "full_key", None)
        msg = str(err).splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"{key}: {msg}" if key else msg) from None
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as err:
        raise ValueError(_with_suggestions(err)) from None


def config_keys(model=None, prefix: str = "") -> list[str]:
    """Every dotted key of the config (sections and leaves), in definition order."""
    model = model or TrainConfig
    keys = []
    for name, field in model.model_fields.items():
        keys.append(prefix + name)
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys += config_keys(ann, f"{prefix}{name}.")
    return keys


def suggest_keys(key: str, keys: list[str] | None = None) -> list[str]:
    """The valid keys nearest to an unknown ``key``: those with the same last part (``lr`` →
    ``rl.lr``, ``critic.lr``, ``warmstart.lr``), else a close spelling of the last part in the same
    section (``rl.stepz`` → ``rl.steps``), else anywhere (``stepz`` → ``rl.steps``)."""
    import difflib

    keys = config_keys() if keys is None else keys
    parent, _, leaf = key.rpartition(".")
    same_leaf = [k for k in keys if k.rpartition(".")[2] == leaf and k != key]
    if same_leaf:
        return sorted(same_leaf, key=lambda k: -difflib.SequenceMatcher(None, key, k).ratio())[:3]
    for pool, cutoff in (([k for k in keys if k.rpartition(".")[0] == parent], 0.6), (keys, 0.75)):
        by_leaf: dict[str, list[str]] = {}
        for k in pool:
            by_leaf.setdefault(k.rpartition(".")[2], []).append(k)
        near = difflib.get_close_matches(leaf, list(by_leaf), n=2, cutoff=cutoff)
        if near:
            return [k for name in near for k in by_leaf[name]][:2]
    return []


def _with_suggestions(err: ValidationError) -> str:
    """:func:`format_validation_error`, with "did you mean" for every unknown key."""
    unknown = [".".join(str(p) for p in e["loc"]) for e in err.errors() if e.get("type") == "extra_forbidden"]
    text = format_validation_error(err)
    if not unknown:
        return text
    keys = config_keys()
    hints = []
    for key in unknown:
        near = suggest_keys(key, keys)
        hints.append(f"{key}: unknown key" + (f" (did you mean {' or '.join(near)}?)" if near else ""))
    others = [part for part in text.split("; ") if not any(part.startswith(f"{k}:") for k in unknown)]
    return "; ".join(hints + others)


def dump_config(cfg: TrainConfig) -> str:
    import yaml

    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
