"""One preflight: load the config as the driver would, run every check, build the plan.

Order: our loader (:func:`nemo_granular.nemo_rl.configs.load_resolved`, as ``run_grpo``/``run_sppo``)
→ NeMo-RL's ``MasterConfig`` → our refusals → NeMo-RL's set-up checks → the cluster layout →
the worker-init checks (policy, critic, vLLM, Megatron, Automodel) → the model's architecture
(only when its config is available offline) → the step-1 batch checks → the worker venvs.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from . import batches, memory, model, plugin_checks, recipe, runtime, setup_checks, venvs, worker_checks
from .findings import Finding, error, warning
from .layout import cluster_layout, dig, policy_parallel, vllm_parallel

__all__ = ["PreflightUnavailable", "Result", "driver_for", "run_preflight"]

DRIVERS = ("grpo", "sppo")


class PreflightUnavailable(RuntimeError):
    """NeMo-RL (or one of its imports) cannot be imported here; preflight needs it like the drivers do."""


@dataclass
class Result:
    config: str
    driver: str
    findings: list[Finding] = field(default_factory=list)
    plan: dict = field(default_factory=dict)
    resolved: dict = field(default_factory=dict, repr=False)  # the loaded config (not in --json)
    nemo_rl: str = ""  # the NeMo-RL version checked against
    adapted: list[str] = field(default_factory=list)  # keys that version lacks, dropped (compat)

    def errors(self, strict: bool = False) -> list[Finding]:
        return [f for f in self.findings if f.level == "error" or strict]


def driver_for(path: str | os.PathLike, driver: str = "auto") -> str:
    """``grpo`` (``run_grpo``) or ``sppo`` (``run_sppo``). ``auto`` is slurm/submit_comparison.sh's rule:
    a config whose file name contains ``sppo`` runs on ``run_sppo``, every other on ``run_grpo``."""
    if driver in DRIVERS:
        return driver
    if driver != "auto":
        raise ValueError(f"--driver must be auto, grpo or sppo, got {driver!r}")
    return "sppo" if "sppo" in Path(path).name.removesuffix(".yaml").removesuffix(".yml") else "grpo"


def _import_nemo_rl(driver: str):
    from ..nemo_rl import compat

    module = "ppo" if driver == "sppo" else "grpo"
    try:
        compat.version()
        return compat.module(module)
    except compat.UnsupportedNemoRL as err:
        raise PreflightUnavailable(str(err)) from None
    except ImportError as err:
        raise PreflightUnavailable(
            f"NeMo-RL is not importable here (missing {err.name or module!r}): run preflight in NeMo-RL's "
            f"environment like the drivers (e.g. `uv run python -m nemo_granular preflight ...` in the "
            f"NeMo-RL checkout)"
        ) from None


def _master(algo_module, cfg: dict, source: str) -> tuple[object | None, list[Finding]]:
    """NeMo-RL's ``MasterConfig(**config)``; one finding per pydantic error."""
    from pydantic import ValidationError

    try:
        return algo_module.MasterConfig(**copy.deepcopy(cfg)), []
    except ValidationError as err:
        return None, [error(source, f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}") for e in err.errors()]


def _model_findings(cfg: dict, plan: dict, vocab_size: int | None, driver: str) -> list[Finding]:
    policy = cfg["policy"]
    facts, why = model.model_facts(str(policy.get("model_name")), policy.get("hf_config_overrides"))
    out: list[Finding] = []
    if facts is None:
        out.append(
            warning("nemo-granular preflight", f"{why}; the architecture checks and the parameter counts are skipped")
        )
    else:
        par = policy_parallel(policy)
        out += model.architecture_checks("policy", facts, par, policy.get("megatron_cfg") or {})
        plan["model"] = dict(
            name=policy.get("model_name"),
            vocab_size=facts.vocab_size,
            parameters=facts.parameter_count(),
            layers=facts.num_layers,
            experts=facts.num_experts,
        )
    vocab = vocab_size or (facts.vocab_size if facts else None) or dig(cfg, "loss_fn.granular.espo.vocab_size")
    if vocab:
        par = policy_parallel(policy)
        est = {kind: memory.logits_estimate(policy, par, int(vocab), kind) for kind in ("logprob", "train")}
        plan["logits_memory"] = dict(
            vocab_size=int(vocab),
            tokens_per_gpu=est["logprob"].tokens_per_gpu,
            vocab_per_gpu=est["logprob"].vocab_per_gpu,
            chunk=est["logprob"].chunk,
            logprob_pass_bytes=est["logprob"].logprob_pass_bytes,
            train_bytes=est["train"].train_bytes,
        )
    if driver == "sppo":
        value = cfg.get("value") or {}
        vfacts = (
            facts
            if value.get("model_name") == policy.get("model_name")
            else model.model_facts(str(value.get("model_name")), value.get("hf_config_overrides"))[0]
        )
        if vfacts is not None:
            plan["critic_memory"] = memory.critic_estimate(
                vfacts.parameter_count(lm_head=False), plan["layout"]["train_world"], value
            )
            out += model.architecture_checks("value", vfacts, policy_parallel(value), value.get("megatron_cfg") or {})
    return out


def _venv_findings(cfg: dict, driver: str, plan: dict) -> list[Finding]:
    entries = venvs.venv_plan(venvs.needed_actors(cfg, driver))
    plan["venvs"] = dict(
        dir=venvs.venv_dir(),
        entries=[
            dict(fqn=e.fqn, role=e.role, py_executable=e.py_executable, path=e.path, built=e.built) for e in entries
        ],
    )
    src = "nemo_rl/utils/venvs.py:create_local_venv_on_each_node"
    out = [
        warning(
            src,
            f"worker venv missing: {e.path} ({e.role}, extra {e.extra}); the job would build it on "
            f"every node (`nemo-granular preflight CONFIG --build-venvs` builds it now)",
        )
        for e in entries
        if e.needs_venv and not e.built
    ]
    if out:
        gone = venvs.missing_sources()
        plan["venvs"]["missing_sources"] = gone
        if gone:
            out.append(
                warning(
                    "nemo_rl/utils/venvs.py:create_local_venv",
                    f"the NeMo-RL checkout {venvs.nemo_rl_root()} lacks the submodule sources "
                    f"{', '.join(gone)}: a venv build will fail; clone NeMo-RL with `git clone "
                    f"--recursive` (or run `git submodule update --init --recursive`)",
                )
            )
    return out


def run_preflight(
    path: str | os.PathLike,
    overrides: Sequence[str] = (),
    driver: str = "auto",
    vocab_size: int | None = None,
    env: Mapping[str, str] | None = None,
    check_venvs: bool = True,
) -> Result:
    """All checks and the plan for one config. Raises :class:`PreflightUnavailable` without NeMo-RL and a
    one-line ``ValueError`` / ``FileNotFoundError`` for a config that cannot be loaded."""
    driver = driver_for(path, driver)
    algo = "ppo" if driver == "sppo" else "grpo"
    algo_module = _import_nemo_rl(driver)
    from ..nemo_rl.compat import version
    from ..nemo_rl.configs import load_resolved

    adapted: list[str] = []
    cfg = load_resolved(path, list(overrides), notes=adapted)
    res = Result(str(path), driver, resolved=cfg, nemo_rl=str(version()), adapted=adapted)
    master, res.findings = _master(algo_module, cfg, f"nemo_rl/algorithms/{algo}.py:MasterConfig")
    if driver == "grpo":
        res.findings += plugin_checks.grpo_plugin_checks(cfg)
        if master is not None:
            res.findings += setup_checks.grpo_setup_checks(master)
    else:
        res.findings += plugin_checks.sppo_plugin_checks(cfg, master)
        if master is not None:
            res.findings += setup_checks.ppo_setup_checks(master)
    if master is None or not isinstance(cfg.get("policy"), Mapping):
        return res
    layout, found = cluster_layout(cfg, algo)
    res.findings += found
    if layout is None:
        return res
    policy = cfg["policy"]
    par = policy_parallel(policy)
    res.plan["layout"] = dict(vars(layout), train_world=layout.train_world, inference_world=layout.inference_world)
    res.plan["policy_parallel"] = dict(par, dp=layout.train_world // max(par["tp"] * par["pp"] * par["cp"], 1))
    gen = policy.get("generation") or {}
    if gen.get("backend") == "vllm":
        v = vllm_parallel(gen)
        res.plan["vllm_parallel"] = dict(v, engines=layout.inference_world // max(v["tp"] * v["pp"], 1))
    res.findings += worker_checks.policy_init_checks(policy, layout.train_world, env)
    res.findings += worker_checks.vllm_init_checks(gen, layout.inference_world)
    res.findings += worker_checks.megatron_worker_checks(policy)
    res.findings += worker_checks.megatron_parallel_state_checks(policy.get("megatron_cfg") or {}, layout.train_world)
    res.findings += worker_checks.automodel_worker_checks("policy", policy, layout.train_world)
    res.plan["batches"] = {"policy": batches.batch_plan(cfg, algo, "policy", res.plan["policy_parallel"]["dp"])}
    res.findings += batches.batch_checks("policy", res.plan["batches"]["policy"])
    if driver == "sppo":
        value = cfg.get("value") or {}
        vpar = policy_parallel(value)
        res.findings += worker_checks.value_init_checks(value, layout.train_world)
        res.findings += worker_checks.megatron_parallel_state_checks(
            value.get("megatron_cfg") or {}, layout.train_world, "value"
        )
        res.findings += worker_checks.automodel_worker_checks("value", value, layout.train_world)
        vdp = layout.train_world // max(vpar["tp"] * vpar["pp"] * vpar["cp"], 1)
        res.plan["value_parallel"] = dict(vpar, dp=vdp)
        res.plan["batches"]["value"] = batches.batch_plan(cfg, algo, "value", vdp)
        res.findings += batches.batch_checks("value", res.plan["batches"]["value"])
    res.findings += _model_findings(cfg, res.plan, vocab_size, driver)
    diff = recipe.recipe_diff(path, cfg)
    if diff is not None:
        res.plan["recipe"] = dict(reference=diff.reference, changed=diff.changed, added=diff.added)
    if check_venvs:
        res.findings += _venv_findings(cfg, driver, res.plan)
    res.findings += runtime.runtime_findings(cfg, venv_dir=res.plan.get("venvs", {}).get("dir"))
    return res
