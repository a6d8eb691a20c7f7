"""The worker venvs a run needs, whether they are built, and building them before the job.

NeMo-RL starts every Ray actor class with the Python environment its registry names
(``nemo_rl/distributed/ray_actor_environment_registry.py``). An entry that starts with ``uv``
(``PY_EXECUTABLES.MCORE``, ``.VLLM``, ``.AUTOMODEL``, …) means one venv per actor class, named
after the class, under ``NEMO_RL_VENV_DIR`` (default ``<NeMo-RL>/venvs``), built on first use by
``nemo_rl/utils/venvs.py:create_local_venv`` on every node — a full ``uv sync`` of that extra,
i.e. downloads on compute nodes, per job unless the directory is shared. The plugin's worker
extension classes are such actors (the Megatron extension uses the ``mcore`` extra, the DTensor
v2 one ``automodel``), and NeMo-RL's container ships the stock classes' venvs only.

:func:`needed_actors` lists the actor classes a config starts (the driver's rule: ``run_grpo`` puts
the plugin's extension in place of the stock policy worker unless
``nemo_granular.entropy_source: current_logits``; ``run_sppo`` keeps the stock workers and adds the
critic). :func:`venv_plan` asks NeMo-RL's own registry for each class's executable.
:func:`build_venvs` builds the missing ones with NeMo-RL's own ``create_local_venv`` (the very
function a job would run); :func:`build_commands` spells out the commands it runs.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .layout import dig

__all__ = [
    "VenvEntry",
    "needed_actors",
    "venv_plan",
    "venv_dir",
    "nemo_rl_root",
    "build_commands",
    "missing_sources",
    "build_venvs",
]

VLLM_WORKER = "nemo_rl.models.generation.vllm.vllm_worker.VllmGenerationWorker"
VLLM_ASYNC_WORKER = "nemo_rl.models.generation.vllm.vllm_worker_async.VllmAsyncGenerationWorker"
SGLANG_WORKER = "nemo_rl.models.generation.sglang.sglang_worker.SGLangGenerationWorker"
MEGATRON_POLICY = "nemo_rl.models.policy.workers.megatron_policy_worker.MegatronPolicyWorker"
DTENSOR_POLICY = "nemo_rl.models.policy.workers.dtensor_policy_worker.DTensorPolicyWorker"
DTENSOR_V2_POLICY = "nemo_rl.models.policy.workers.dtensor_policy_worker_v2.DTensorPolicyWorkerV2"
MEGATRON_VALUE = "nemo_rl.models.value.workers.megatron_value_worker.MegatronValueWorker"
DTENSOR_V2_VALUE = "nemo_rl.models.value.workers.dtensor_value_worker_v2.DTensorValueWorkerV2"
ASYNC_ACTORS = (
    "nemo_rl.algorithms.async_utils.AsyncTrajectoryCollector",
    "nemo_rl.algorithms.async_utils.ReplayBuffer",
)


@dataclass
class VenvEntry:
    """One actor class: its role, NeMo-RL's executable for it, and (uv only) the venv it needs."""

    fqn: str
    role: str
    py_executable: str
    path: str | None = None  # NEMO_RL_VENV_DIR/<fqn>, None for a system-Python actor
    built: bool = True
    extra: str | None = field(default=None)

    @property
    def needs_venv(self) -> bool:
        return self.path is not None


def _policy_worker(policy: Mapping) -> str:
    from ..nemo_rl import compat

    resolve_policy_worker_cls = compat.get("resolve_policy_worker_cls")

    if bool(dig(policy, "megatron_cfg.enabled", False)):
        return resolve_policy_worker_cls(MEGATRON_POLICY, policy)
    return resolve_policy_worker_cls(
        DTENSOR_V2_POLICY if dig(policy, "dtensor_cfg._v2", False) else DTENSOR_POLICY, policy
    )


def _generation_worker(gen: Mapping) -> str | None:
    backend = gen.get("backend")
    if backend == "vllm":
        from ..nemo_rl import compat

        resolve_generation_worker_cls = compat.get("resolve_generation_worker_cls")

        default = VLLM_ASYNC_WORKER if dig(gen, "vllm_cfg.async_engine", False) else VLLM_WORKER
        return resolve_generation_worker_cls(default, gen)
    if backend == "sglang":
        return SGLANG_WORKER
    return None  # megatron generation runs inside the policy workers


def needed_actors(cfg: Mapping, driver: str) -> list[tuple[str, str]]:
    """``[(actor fqn, role)]`` the driver (``grpo`` = run_grpo, ``sppo`` = run_sppo) will start."""
    from ..nemo_rl import compat

    extract_necessary_env_names = compat.get("extract_necessary_env_names")
    ENV_REGISTRY = compat.get("ENV_REGISTRY")

    from ..nemo_rl.environments import register_espo_environment
    from ..nemo_rl.policy import extension_fqn_for

    register_espo_environment()
    policy = cfg.get("policy") or {}
    out: list[tuple[str, str]] = []
    if driver == "grpo" and dig(cfg, "nemo_granular.entropy_source", "extension") == "extension":
        out.append((extension_fqn_for(policy), "policy (nemo-granular worker extension)"))
    else:
        out.append((_policy_worker(policy), "policy"))
    if driver == "sppo":
        value = cfg.get("value") or {}
        out.append((MEGATRON_VALUE if dig(value, "megatron_cfg.enabled", False) else DTENSOR_V2_VALUE, "critic"))
    gen = policy.get("generation") or {}
    worker = _generation_worker(gen)
    if worker:
        out.append((worker, "generation"))
    async_on = dig(cfg, "grpo.async_grpo.enabled" if driver == "grpo" else "ppo.async_ppo.enabled", False)
    if async_on:
        out += [(fqn, "async rollouts") for fqn in ASYNC_ACTORS]
    for name in sorted(extract_necessary_env_names(cfg.get("data") or {})):
        entry = ENV_REGISTRY.get(name)
        if entry:
            out.append((entry["actor_class_fqn"], f"environment {name}"))
    return out


def venv_dir() -> str:
    """NeMo-RL's venv directory: ``$NEMO_RL_VENV_DIR`` else ``nemo_rl.utils.venvs.DEFAULT_VENV_DIR``."""
    from ..nemo_rl import compat

    DEFAULT_VENV_DIR = compat.get("DEFAULT_VENV_DIR")

    return os.path.normpath(os.environ.get("NEMO_RL_VENV_DIR", DEFAULT_VENV_DIR))


def nemo_rl_root() -> str:
    """The NeMo-RL checkout ``uv`` builds the venvs from (``nemo_rl.utils.venvs.git_root``)."""
    from ..nemo_rl import compat

    git_root = compat.get("git_root")

    return git_root


def _extra(py_executable: str) -> str | None:
    parts = shlex.split(py_executable)
    return parts[parts.index("--extra") + 1] if "--extra" in parts[:-1] else None


def venv_plan(actors: list[tuple[str, str]]) -> list[VenvEntry]:
    """Each actor's executable from NeMo-RL's registry (after the plugin registered its classes, as the
    drivers do) and, for a ``uv`` executable, its venv path and whether ``bin/python`` exists there —
    the test NeMo-RL's ``_env_builder`` uses to skip a build."""
    from ..nemo_rl import compat

    get_actor_python_env = compat.get("get_actor_python_env")

    from ..nemo_rl.policy import register_worker_extensions

    register_worker_extensions()
    base = venv_dir()
    plan, seen = [], set()
    for fqn, role in actors:
        if fqn in seen:
            continue
        seen.add(fqn)
        exe = get_actor_python_env(fqn)
        if not exe.startswith("uv"):
            plan.append(VenvEntry(fqn, role, exe))
            continue
        path = os.path.join(base, fqn)
        plan.append(VenvEntry(fqn, role, exe, path, (Path(path) / "bin" / "python").exists(), _extra(exe)))
    return plan


def build_commands(entry: VenvEntry, root: str | None = None) -> list[str]:
    """The commands NeMo-RL's ``create_local_venv`` runs for ``entry`` (environment prefix included)."""
    root = nemo_rl_root() if root is None else root
    env = f"UV_PROJECT_ENVIRONMENT={shlex.quote(entry.path)}"
    return [
        f"uv venv --allow-existing {shlex.quote(entry.path)}",
        f"{env} uv sync --directory {shlex.quote(root)}",
        f"{env} {entry.py_executable} echo {shlex.quote('Finished creating venv ' + entry.path)}",
    ]


def _path_sources(project: Path) -> list[Path]:
    """Folders ``uv`` reads for ``project``: its ``[tool.uv.sources]`` path entries and workspace members."""
    import tomllib

    try:
        data = tomllib.loads((project / "pyproject.toml").read_text())
    except (OSError, ValueError):
        return []
    uv = data.get("tool", {}).get("uv", {})
    out = []
    for spec in uv.get("sources", {}).values():
        for item in spec if isinstance(spec, list) else [spec]:
            if isinstance(item, dict) and "path" in item:
                out.append(project / item["path"])
    out += [project / member for member in uv.get("workspace", {}).get("members", [])]
    return out


def missing_sources(root: str | None = None) -> list[str]:
    """Path dependencies of NeMo-RL's ``pyproject.toml`` (and theirs, recursively) that have no
    ``pyproject.toml``: git submodules not checked out (a clone without ``--recursive``)."""
    root_path = Path(nemo_rl_root() if root is None else root)
    missing, todo, seen = [], [root_path], set()
    while todo:
        project = todo.pop()
        for src in _path_sources(project):
            key = os.path.normpath(src)
            if key in seen:
                continue
            seen.add(key)
            if (src / "pyproject.toml").is_file():
                todo.append(src)
            else:
                missing.append(os.path.relpath(key, root_path))
    return sorted(missing)


def build_venvs(plan: list[VenvEntry], log=print) -> list[VenvEntry]:
    """Build each missing venv with NeMo-RL's own ``create_local_venv`` (what a job would run on its
    nodes); returns the entries it built. ``NRL_FORCE_REBUILD_VENVS=true`` (NeMo-RL's switch)
    rebuilds the built ones too. Needs ``uv`` and network (or a warm uv cache)."""
    from ..nemo_rl import compat

    create_local_venv = compat.get("create_local_venv")

    force = os.environ.get("NRL_FORCE_REBUILD_VENVS", "false").lower() == "true"
    built = []
    for entry in plan:
        if not entry.needs_venv or (entry.built and not force):
            continue
        log(f"building {entry.path} ({entry.py_executable})")
        python = create_local_venv(entry.py_executable, entry.fqn, force_rebuild=force)
        entry.built = Path(python).exists()
        built.append(entry)
    return built
