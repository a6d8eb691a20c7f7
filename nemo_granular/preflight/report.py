"""The plan as text (for people) and as JSON (for scripts)."""

from __future__ import annotations

import json

from .memory import GB
from .run import Result

__all__ = ["plan_text", "as_json"]


def _gb(nbytes: int) -> str:
    return f"{nbytes / GB:.2f} GB"


def _n(x) -> str:
    return f"{x:,}" if isinstance(x, int) else str(x)


def _layout_lines(plan: dict) -> list[str]:
    lay, lines = plan["layout"], []
    if lay["colocated"]:
        lines.append(
            f"cluster   {lay['nodes']} node(s) × {lay['gpus_per_node']} GPUs, colocated: training and "
            f"generation share {lay['train_world']} GPUs"
        )
    else:
        lines.append(
            f"cluster   {lay['nodes']} node(s) × {lay['gpus_per_node']} GPUs: training "
            f"{lay['train_nodes']} × {lay['train_gpus_per_node']}, generation "
            f"{lay['inference_nodes']} × {lay['inference_gpus_per_node']}"
        )
    p = plan["policy_parallel"]
    ep = f" · EP {p['ep']} (ETP {p['etp']})" if p["backend"] == "megatron" and p["ep"] > 1 else ""
    lines.append(f"policy    {p['backend']}: TP {p['tp']} · PP {p['pp']} · CP {p['cp']}{ep} · DP {p['dp']}")
    if "value_parallel" in plan:
        v = plan["value_parallel"]
        lines.append(f"critic    {v['backend']}: TP {v['tp']} · PP {v['pp']} · CP {v['cp']} · DP {v['dp']}")
    if "vllm_parallel" in plan:
        v = plan["vllm_parallel"]
        lines.append(
            f"vLLM      TP {v['tp']} · PP {v['pp']} · EP {v['ep']} (DP {v['engine_dp']} inside an engine) · "
            f"{v['engines']} engine(s)"
        )
    return lines


def _batch_lines(plan: dict) -> list[str]:
    lines = []
    for section, b in plan.get("batches", {}).items():
        epochs = f" × {b['epochs']} epochs" if b["epochs"] != 1 else ""
        micro = f"micro-batch {b['train_micro_batch_size']}" + (" (packed)" if b["packed"] else "")
        lines.append(
            f"batches   {section}: {b['rows_per_step']} rows per step, global batch "
            f"{b['train_global_batch_size']} → {b['optimizer_steps_per_rollout']} optimizer step(s) per "
            f"rollout{epochs}; {b['rows_per_dp_rank']} rows per DP rank per step, {micro}"
        )
    return lines


def _memory_lines(plan: dict) -> list[str]:
    lines = []
    if "model" in plan:
        m = plan["model"]
        lines.append(
            f"model     {m['name']}: {m['parameters'] / 1e9:.2f} B parameters, {m['layers']} layers"
            + (f", {m['experts']} experts" if m["experts"] else "")
            + f", vocabulary {_n(m['vocab_size'])}"
        )
    if "logits_memory" in plan:
        m = plan["logits_memory"]
        lines.append(
            f"logits    per GPU: {_n(m['tokens_per_gpu'])} tokens × {_n(m['vocab_per_gpu'])} vocabulary "
            f"(|V| {_n(m['vocab_size'])}), fp32 chunk {_n(m['chunk'])} positions: logprob/entropy pass "
            f"{_gb(m['logprob_pass_bytes'])}, training {_gb(m['train_bytes'])}"
        )
    else:
        lines.append("logits    vocabulary unknown (model config not available offline): pass --vocab-size")
    if "critic_memory" in plan:
        c = plan["critic_memory"]
        where = "in host memory (dtensor_cfg.cpu_offload)" if c["offloaded"] else f"{_gb(c['bytes_per_gpu'])} per GPU"
        lines.append(
            f"critic    {c['params'] / 1e9:.2f} B parameters; weights + grads + Adam (16 B/param, FSDP) {where}"
        )
    return lines


def _venv_lines(plan: dict) -> list[str]:
    if "venvs" not in plan:
        return []
    v = plan["venvs"]
    lines = [f"venvs     NEMO_RL_VENV_DIR={v['dir']}"]
    for e in v["entries"]:
        if e["path"] is None:
            state = "system Python"
        else:
            state = "built" if e["built"] else "MISSING"
        lines.append(f"          {e['role']}: {e['fqn']} — {state}" + (f" ({e['py_executable']})" if e["path"] else ""))
    return lines


def _recipe_lines(plan: dict) -> list[str]:
    if "recipe" not in plan:
        return ["recipe    no NeMo-RL example at the end of the defaults: chain"]
    r = plan["recipe"]
    lines = [
        f"recipe    departs from NeMo-RL's {r['reference']} in {len(r['changed'])} key(s), adds {len(r['added'])}:"
    ]
    lines += [f"          {k}: {theirs!r} → {ours!r}" for k, theirs, ours in r["changed"]]
    lines += [f"          + {k}: {ours!r}" for k, ours in r["added"]]
    return lines


def plan_text(res: Result) -> str:
    """The plan, one fact per line."""
    head = [f"preflight {res.config} (driver: run_{res.driver})", f"  nemo-rl   checked against {res.nemo_rl}"]
    head += [f"          {line}" for line in res.adapted]
    if not res.plan:
        return "\n".join(head)
    body = (
        _layout_lines(res.plan)
        + _batch_lines(res.plan)
        + _memory_lines(res.plan)
        + _venv_lines(res.plan)
        + _recipe_lines(res.plan)
    )
    return "\n".join([*head, *("  " + line for line in body)])


def as_json(res: Result, strict: bool = False) -> str:
    return json.dumps(
        dict(
            config=res.config,
            driver=res.driver,
            nemo_rl=res.nemo_rl,
            adapted=res.adapted,
            ok=not res.errors(strict),
            findings=[f.as_dict() for f in res.findings],
            plan=res.plan,
        ),
        indent=2,
        default=str,
    )
