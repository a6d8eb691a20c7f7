"""Every config under ``examples/configs/`` (not ``local/``), as NeMo-RL loads and reads it.

World: NeMo-RL (``nemo_rl_src``), except the loader tests marked "both worlds".

* loaded by ``nemo_granular.nemo_rl.configs.load_config`` = NeMo-RL's own ``load_config`` with the
  ``nemo_rl/upstream/`` parents resolved against the real NeMo-RL ``examples/configs`` — no link;
* validated by NeMo-RL's ``MasterConfig`` (GRPO or PPO: pydantic + the typed dicts it declares:
  no missing required key, no rejected value);
* no unknown key: every key of the resolved config is declared by NeMo-RL's typed dicts /
  pydantic models, except the plugin's own (``loss_fn.granular``, ``nemo_granular``, ``sppo``,
  the ESPO estimator's ``verification_failed_key``) — NeMo-RL would silently keep a misspelt key;
* our launchers' start-up checks pass (modes, async checks, active ratios, SPPO validation);
* NeMo-RL's stock ``load_config`` cannot load a copy of the file (no ``upstream`` folder next to
  it): a stock ``examples/run_grpo.py`` launch fails loudly instead of training NeMo-RL's loss.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import Any, Union, get_args, get_origin

import pytest
import typing_extensions

from conftest import env_without_nemo_rl
from nemo_granular.nemo_rl.configs import ConfigFileError, stage_config

pytestmark = pytest.mark.v070

ROOT = Path(__file__).resolve().parents[1]
CFG = ROOT / "examples" / "configs"
FILES = sorted(p.relative_to(CFG).as_posix() for p in [*CFG.glob("*.yaml"), *(CFG / "nemo_rl").glob("*.yaml")])
PLUGIN_KEYS = {"loss_fn.granular", "nemo_granular", "sppo", "grpo.adv_estimator.verification_failed_key"}


# ----------------------------------------------------------------- typed-dict walker ---


def _shapes(tp) -> list:
    """The TypedDict / BaseModel / container shapes an annotation allows."""
    origin = get_origin(tp)
    if origin is typing.Annotated or getattr(origin, "_name", None) in ("NotRequired", "Required"):
        return _shapes(get_args(tp)[0])
    if origin in (Union, types.UnionType):
        return [s for a in get_args(tp) for s in _shapes(a)]
    return [tp]


def unknown_keys(value: Any, tp: Any, path: str = "") -> list[str]:
    """Dotted keys of ``value`` that the annotation ``tp`` (NeMo-RL's typed dicts and pydantic
    models, through unions / NotRequired / lists) does not declare."""
    from pydantic import BaseModel

    shapes = _shapes(tp)
    if isinstance(value, dict):
        fields: dict | None = None
        for s in shapes:
            if typing_extensions.is_typeddict(s):  # NeMo-RL's TypedDicts may be typing_extensions'
                fields = {**(fields or {}), **typing.get_type_hints(s, include_extras=True)}
            elif isinstance(s, type) and issubclass(s, BaseModel):
                fields = {**(fields or {}), **{k: f.annotation for k, f in s.model_fields.items()}}
            elif s is Any or s is dict or get_origin(s) is dict:
                return []  # free-form mapping (e.g. env: dict[str, Any])
        if fields is None:
            return []
        out = []
        for k, v in value.items():
            out += [f"{path}{k}"] if k not in fields else unknown_keys(v, fields[k], f"{path}{k}.")
        return out
    if isinstance(value, list):
        for s in shapes:
            if get_origin(s) is list:
                item = (get_args(s) or (Any,))[0]
                return [k for i, v in enumerate(value) for k in unknown_keys(v, item, f"{path}{i}.")]
    return []


DATASET_ENTRIES = ("data.train", "data.validation", "data.default")  # kwargs of NeMo-RL's dataset classes


def master_unknown_keys(config: dict, master_cls, known: set[str] = frozenset()) -> list[str]:
    """Keys neither NeMo-RL's typed dicts / models declare nor NeMo-RL's own example configs use
    (``known``: NeMo-RL's typed dicts do not declare every key its own YAMLs set, e.g. the
    backend-specific ``vllm_cfg``). Dataset entries are checked by NeMo-RL's own
    ``warn_on_unsupported_dataset_config_keys`` instead (they are dataset-class kwargs)."""
    out = []
    for k, v in config.items():
        field = master_cls.model_fields.get(k)
        out += [k] if field is None else unknown_keys(v, field.annotation, f"{k}.")
    found = []
    for k in out:
        if k.startswith(tuple(e + "." for e in DATASET_ENTRIES)):
            continue
        if k not in known:
            found.append(k)
            continue
        # undeclared by the types but used by NeMo-RL's configs: its sub-keys must be too
        value: Any = config
        for part in k.split("."):
            value = value[int(part)] if isinstance(value, list) else value[part]
        found += sorted(f"{k}.{sub}" for sub in _flat_keys(value) if f"{k}.{sub}" not in known)
    return found


def _flat_keys(d: Any, prefix: str = "") -> set[str]:
    out: set[str] = set()
    if isinstance(d, dict):
        for k, v in d.items():
            out.add(f"{prefix}{k}")
            out |= _flat_keys(v, f"{prefix}{k}.")
    return out


# ----------------------------------------------------------------------- fixtures ---


@pytest.fixture(scope="module")
def host(nemo_rl_src):
    import nemo_rl.algorithms.grpo as grpo
    import nemo_rl.algorithms.ppo as ppo
    import yaml

    configs = nemo_rl_src / "examples" / "configs"
    known: set[str] = set()
    for p in configs.rglob("*.yaml"):
        try:
            known |= _flat_keys(yaml.safe_load(p.read_text()))
        except yaml.YAMLError:
            continue
    return types.SimpleNamespace(grpo=grpo, ppo=ppo, configs=configs, known=known)


@pytest.fixture(scope="module")
def resolved(host):
    from nemo_granular.nemo_rl.configs import load_resolved

    cache: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in cache:
            cache[name] = load_resolved(CFG / name)
        return cache[name]

    return get


# -------------------------------------------------------------------------- tests ---


def test_there_is_no_upstream_link_to_rely_on():
    """Both worlds: the repository ships no ``upstream`` folder; the loader alone resolves it."""
    assert not (CFG / "nemo_rl" / "upstream").exists() or (CFG / "nemo_rl" / "upstream").is_symlink()
    assert len(FILES) >= 15 and "nemo_rl/sspo_math_1B.yaml" in FILES


@pytest.mark.nemo_rl
@pytest.mark.parametrize("name", FILES)
def test_config_loads_validates_and_has_no_unknown_key(name, host, resolved):
    cfg = resolved(name)
    is_ppo = "ppo" in cfg
    master_cls = host.ppo.MasterConfig if is_ppo else host.grpo.MasterConfig
    master_cls(**cfg)  # NeMo-RL's own validation: required keys, types, rejected values
    unknown = sorted(set(master_unknown_keys(cfg, master_cls, host.known)) - PLUGIN_KEYS)
    assert not unknown, f"{name}: keys NeMo-RL does not declare (typo?): {unknown}"
    _check_dataset_entries(cfg)
    for section in ("cluster", "logger", "checkpointing", "data", "env", "policy"):
        assert section in cfg, f"{name}: the NeMo-RL parent did not provide {section}"
    if is_ppo:
        from nemo_granular.nemo_rl.configs import check_ratio_is_active
        from nemo_granular.sppo.validate import validate_sppo_config

        opts, _ = validate_sppo_config(cfg, source=name)
        if not opts.allow_ratio_always_one:
            check_ratio_is_active(cfg, "ppo", "sppo.allow_ratio_always_one")
        assert cfg["value_loss_fn"].keys() <= set(
            host.ppo.MasterConfig.model_fields["value_loss_fn"].annotation.model_fields
        )
    else:
        from nemo_granular.config import parse_policy_loss_config
        from nemo_granular.run_grpo import check_config

        check_config(cfg)
        if "granular" in cfg["loss_fn"]:
            parse_policy_loss_config(cfg["loss_fn"])


def _check_dataset_entries(cfg: dict) -> None:
    """NeMo-RL's own check of dataset-entry keys (it only warns; here a warning fails)."""
    import warnings

    from nemo_rl.data.datasets.response_datasets import DATASET_REGISTRY

    from nemo_granular.nemo_rl import compat

    # main only; on v0.7.0 the dataset class's own constructor (NeMo-RL's loader) is the only check
    warn_on_unsupported_dataset_config_keys = compat.find("warn_on_unsupported_dataset_config_keys")

    for section in ("train", "validation"):
        entries = cfg["data"].get(section)
        for entry in entries if isinstance(entries, list) else [entries] if entries else []:
            merged = {**(cfg["data"].get("default") or {}), **entry}
            assert merged["dataset_name"] in DATASET_REGISTRY, merged["dataset_name"]
            if warn_on_unsupported_dataset_config_keys is None:
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                warn_on_unsupported_dataset_config_keys(DATASET_REGISTRY[merged["dataset_name"]], merged)


@pytest.mark.nemo_rl
def test_unknown_key_walker_catches_typos(host, resolved):
    """The walker is not vacuous: a misspelt nested key, a misspelt list-item key and a
    misspelt top-level section are reported; NeMo-RL's MasterConfig itself accepts all three."""
    import copy

    cfg = copy.deepcopy(resolved("sspo_qwen2.5_math_1.5b.yaml"))
    cfg["policy"]["megatron_cfg"]["tensor_model_paralel_size"] = 2
    cfg["policy"]["generation"]["vllm_cfg"]["gpu_memory_utilisation"] = 0.5
    cfg["grpo"]["num_generation_per_prompt"] = 8
    cfg["checkpoints"] = {}
    host.grpo.MasterConfig(**cfg)
    found = set(master_unknown_keys(cfg, host.grpo.MasterConfig, host.known)) - PLUGIN_KEYS
    assert found == {
        "policy.megatron_cfg.tensor_model_paralel_size",
        "policy.generation.vllm_cfg.gpu_memory_utilisation",
        "grpo.num_generation_per_prompt",
        "checkpoints",
    }, found


@pytest.mark.nemo_rl
@pytest.mark.parametrize(
    "name", ["sspo_qwen2.5_math_1.5b.yaml", "nemo_rl/espo_math_1B.yaml", "sppo_r1_distill_qwen_1.5b.yaml"]
)
def test_stock_nemo_rl_load_config_fails_loudly_on_a_copy(name, host, tmp_path):
    """A copy of our config run by NeMo-RL's stock launcher (its own load_config) cannot silently
    train NeMo-RL's loss: the ``upstream`` parent does not exist there."""
    from nemo_rl.utils.config import load_config

    dst = tmp_path / Path(name).name
    shutil.copy(CFG / name, dst)
    with pytest.raises(FileNotFoundError, match="upstream"):
        load_config(dst)


@pytest.mark.nemo_rl
def test_existing_link_is_left_alone(host, tmp_path):
    """A user's own ``upstream`` link keeps working: the file is then loaded unchanged."""
    d = tmp_path / "cfg"
    (d / "nemo_rl").mkdir(parents=True)
    (d / "nemo_rl" / "upstream").symlink_to(host.configs, target_is_directory=True)
    shutil.copy(CFG / "gspo_qwen2.5_math_1.5b.yaml", d)
    assert stage_config(d / "gspo_qwen2.5_math_1.5b.yaml", tmp_path) == d / "gspo_qwen2.5_math_1.5b.yaml"


# ------------------------------------------------- loader errors (both worlds) ---


def _fake_nemo_rl(tmp_path: Path) -> Path:
    base = tmp_path / "nemo" / "examples" / "configs"
    base.mkdir(parents=True)
    (base / "grandparent.yaml").write_text("a: 1\nb: {c: 2, d: 3}\n")
    (base / "base.yaml").write_text("defaults: grandparent.yaml\nb: {c: 20}\nlst: [1, 2]\n")
    return base


def test_stage_resolves_upstream_chains_like_a_link(tmp_path):
    """Both worlds: OmegaConf-only staging; the staged chain equals the one through a real link."""
    from omegaconf import OmegaConf

    base = _fake_nemo_rl(tmp_path)
    ours = tmp_path / "ours"
    (ours / "nemo_rl").mkdir(parents=True)
    (ours / "child.yaml").write_text('defaults: nemo_rl/upstream/base.yaml\nb: {d: 30}\ns: "\\n\\n"\nx: ${b.c}\n')
    (ours / "nemo_rl" / "small.yaml").write_text("defaults: ../child.yaml\nb: {c: 7}\n")
    (ours / "nemo_rl" / "direct.yaml").write_text("defaults: [upstream/base.yaml, ../child.yaml]\n")
    work = tmp_path / "work"
    work.mkdir()
    for name, want in (
        ("child.yaml", {"a": 1, "b": {"c": 20, "d": 30}, "lst": [1, 2], "s": "\n\n", "x": 20}),
        ("nemo_rl/small.yaml", {"a": 1, "b": {"c": 7, "d": 30}, "lst": [1, 2], "s": "\n\n", "x": 7}),
    ):
        staged = stage_config(ours / name, work, base)
        assert staged.parent == work  # a copy; the user's file is not touched
        chain = _merge_chain(staged)
        assert OmegaConf.to_container(chain, resolve=True) == want
    assert "upstream" not in (ours / "child.yaml").read_text().split("defaults:")[0]
    assert (ours / "child.yaml").read_text().startswith("defaults: nemo_rl/upstream/base.yaml")
    # a list of parents, one of them upstream
    assert OmegaConf.to_container(
        _merge_chain(stage_config(ours / "nemo_rl" / "direct.yaml", work, base)), resolve=True
    )["b"] == {"c": 20, "d": 30}


def _merge_chain(path: Path):
    """Reference merge (parents first, child last; defaults relative to the file)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(path)
    parents = cfg.pop("defaults", None)
    if parents is None:
        return cfg
    merged = OmegaConf.create({})
    for p in [parents] if isinstance(parents, str) else list(parents):
        pp = Path(p) if str(p).startswith("/") else path.parent / p
        merged = OmegaConf.merge(merged, _merge_chain(pp))
    return OmegaConf.merge(merged, cfg)


def test_stage_errors_are_one_line(tmp_path):
    """Both worlds: missing file, missing NeMo-RL parent, missing plain parent."""
    base = _fake_nemo_rl(tmp_path)
    ours = tmp_path / "ours"
    ours.mkdir()
    with pytest.raises(ConfigFileError, match=r"absent\.yaml: config file not found"):
        stage_config(ours / "absent.yaml", tmp_path, base)
    (ours / "a.yaml").write_text("defaults: nemo_rl/upstream/nope.yaml\n")
    with pytest.raises(
        ConfigFileError,
        match=r"a\.yaml: defaults entry 'nemo_rl/upstream/nope\.yaml': "
        r"NeMo-RL has no examples/configs/nope\.yaml",
    ) as err:
        stage_config(ours / "a.yaml", tmp_path, base)
    assert "\n" not in str(err.value)
    (ours / "b.yaml").write_text("defaults: sibling.yaml\n")
    with pytest.raises(ConfigFileError, match=r"b\.yaml: defaults entry 'sibling\.yaml': .*sibling\.yaml not found"):
        stage_config(ours / "b.yaml", tmp_path, base)


def test_without_nemo_rl_the_upstream_error_says_how_to_provide_it(tmp_path):
    """World without NeMo-RL (subprocess): one line naming the file and NEMO_RL_SRC."""
    code = (
        "from nemo_granular.nemo_rl.configs import stage_config\n"
        f"stage_config({str(CFG / 'sspo_qwen2.5_math_1.5b.yaml')!r}, {str(tmp_path)!r})\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env_without_nemo_rl(), timeout=120
    )
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("nemo_granular.nemo_rl.configs.ConfigFileError: ")
    assert "sspo_qwen2.5_math_1.5b.yaml: defaults entry 'nemo_rl/upstream/grpo_math_1B_megatron.yaml'" in last
    assert "set NEMO_RL_SRC" in last
    bad = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=env_without_nemo_rl(NEMO_RL_SRC=str(tmp_path)),
    )
    assert f"NEMO_RL_SRC={tmp_path} has no examples/configs folder" in bad.stderr.strip().splitlines()[-1]
