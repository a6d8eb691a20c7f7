"""The benchmark-suite section of the report: one paper-style table per suite found in the runs'
``evals.json`` (see :mod:`nemo_granular.evals`).

Suites that measure the same thing here — the same benchmarks, samples, decoding and reported
checkpoint, hence the same numbers (e.g. the SPPO and ESPO protocols once both are capped to the
same samples per problem) — are ONE table under one heading that says so and names each protocol;
a heading never claims more samples than were drawn (the measured avg@k is stated).
"""

from __future__ import annotations

import re

from ..evals.results import select_checkpoint
from ..evals.suite import PROTOCOLS
from .runs import Run
from .stats import fmt, mean_sd


def _stat(values, digits=3):
    mu, sd, n = mean_sd(values)
    return fmt(mu, sd, n, digits)


def _suite_content(entry: dict) -> dict:
    """What one suite measured and the rows it gives: the spec rows, the checkpoint rule, the results."""
    spec = entry["spec"]
    benches = list(spec.get("benchmarks", {}))
    proto = spec.get("protocol", {})
    select = proto.get("select", "last")
    spec_rows = []
    for b in benches:
        info = spec["benchmarks"][b]
        spec_rows.append(
            f"| {info.get('label', b)} | {info.get('problems', '?')} | "
            f"{info.get('samples_per_problem', '?')} | {info.get('decoding', '?')} | "
            f"{info.get('metric', 'mean accuracy over samples')} |"
        )
    rows = []
    # the policy every run of a seed started from (embedded: the warm start), as the papers' base row
    base = {}
    for items in entry["rows"].values():
        for run, res in items:
            scores = res.get("checkpoints", {}).get("0")
            if scores and all(b in scores for b in benches):
                base.setdefault(run.seed, scores)
    if base:
        vals = list(base.values())
        cells = [_stat([v[b] for v in vals]) for b in benches]
        avg = _stat([sum(v[b] for b in benches) / len(benches) for v in vals])
        rows.append(f"| start (step 0) | {len(vals)} | " + " | ".join(cells) + f" | {avg} | 0 |")
    for name, items in entry["rows"].items():
        picked = [select_checkpoint(res, select) for _, res in items]
        picked = [(p, run) for p, (run, _) in zip(picked, items) if p is not None]
        if not picked:
            rows.append(f"| {name} | 0 | " + " | ".join("n/a" for _ in benches) + " | n/a | none evaluated |")
            continue
        cells = [_stat([p[1].get(b, float("nan")) for p, _ in picked]) for b in benches]
        avg = _stat([p[2] for p, _ in picked])
        steps = ", ".join(f"{p[0]}" for p, _ in picked)
        rows.append(f"| {name} | {len(picked)} | " + " | ".join(cells) + f" | {avg} | {steps} |")
    labels = [spec["benchmarks"][b].get("label", b) for b in benches]
    metrics = sorted({str(spec["benchmarks"][b].get("metric", "?")) for b in benches})
    return {
        "description": proto.get("description", ""),
        "select": select,
        "note": proto.get("select_note", ""),
        "spec_rows": spec_rows,
        "labels": labels,
        "rows": rows,
        "metrics": metrics,
    }


def _measured_note(content: dict) -> str:
    """' (measured here: avg@8)' when the description claims an avg@k that was not drawn."""
    claimed = set(re.findall(r"avg@\d+", content["description"]))
    return f" (measured here: {', '.join(content['metrics'])})" if claimed - set(content["metrics"]) else ""


def benchmark_tables(by_name: dict[str, list[Run]]) -> list[str]:
    """Paper-style tables, one per distinct measurement among the suites in the runs' evals.json."""
    suites: dict[str, dict] = {}
    for name, runs in by_name.items():
        for run in runs:
            for suite, res in ((run.evals or {}).get("suites") or {}).items():
                suites.setdefault(suite, {"spec": res, "rows": {}})["rows"].setdefault(name, []).append((run, res))
    order = list(PROTOCOLS)
    groups: list[tuple[list[str], list[dict]]] = []  # same measurement → one group
    for suite, entry in sorted(suites.items(), key=lambda kv: (order.index(kv[0]) if kv[0] in order else 99, kv[0])):
        content = _suite_content(entry)
        key = (content["spec_rows"], content["select"], content["rows"])
        for names, contents in groups:
            first = contents[0]
            if (first["spec_rows"], first["select"], first["rows"]) == key:
                names.append(suite)
                contents.append(content)
                break
        else:
            groups.append(([suite], [content]))
    lines = []
    for names, contents in groups:
        c = contents[0]
        if len(names) == 1:
            lines += [f"### Suite `{names[0]}`: {c['description']}{_measured_note(c)}", ""]
        else:
            quoted = [f"`{n}`" for n in names]
            claimed = sorted(
                {k for x in contents for k in re.findall(r"avg@\d+", x["description"])}, key=lambda k: int(k[4:])
            )
            capped = [k for k in claimed if k not in c["metrics"]]
            why = f" (the protocols' {', '.join(capped)}, capped here)" if capped else ""
            lines += [
                f"### Suites {', '.join(quoted[:-1])} and {quoted[-1]}: one measurement here",
                "",
                f"At this scale these protocols measure the same thing: the same benchmarks, "
                f"{', '.join(c['metrics'])}{why} with the same decoding, the same checkpoint. Their numbers "
                "coincide, so one table stands for all of them.",
                "",
            ]
            lines += [f"- `{n}`: {x['description']}" for n, x in zip(names, contents)]
            lines.append("")
        lines.append("| benchmark | problems | samples/problem | decoding | metric |")
        lines.append("|---|---|---|---|---|")
        lines += c["spec_rows"]
        notes = "; ".join(dict.fromkeys(part for x in contents for part in x["note"].split("; ") if part))
        which = "the best by suite average" if c["select"] == "best" else "the last"
        lines += [
            "",
            f"Checkpoint reported: **{which}** ({notes}). Cells: mean ± sd over seeds (1 seed: no spread).",
            "",
            "| algorithm | seeds | " + " | ".join(c["labels"]) + " | average | checkpoint step(s) |",
            "|---|---|" + "---|" * (len(c["labels"]) + 2),
        ]
        lines += c["rows"]
        lines.append("")
    return lines
