"""``report.md`` and its plots from run directories (embedded or NeMo-RL), see docs/comparison.md."""

from __future__ import annotations

import math
import zlib
from pathlib import Path

from .. import atomic
from .cpu import CPU_KEY, cpu_usage
from .runs import Run, load_run
from .stats import (
    FAILS,
    HOLDS,
    INCONCLUSIVE,
    NOT_JUDGED,
    NOT_RUN,
    fmt,
    mean_sd,
    moving_average,
    seed_band,
    verdict_below,
    verdict_between,
    verdict_greater,
)
from .suites import benchmark_tables

PAPERS = {
    "grpo": "GRPO: Shao et al., *DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language "
    "Models*, arXiv:2402.03300",
    "gspo": "GSPO: Zheng et al., *Group Sequence Policy Optimization*, arXiv:2507.18071",
    "sspo": "SSPO: Yang et al., *SSPO: Subsentence-level Policy Optimization*, arXiv:2511.04256",
    "espo": "ESPO: Sheng et al., *ESPO: Entropy Importance Sampling Policy Optimization*, arXiv:2512.00499",
    "sppo": "SPPO: Wang et al., *SPPO: Sequence-Level PPO for Long-Horizon Reasoning Tasks*, arXiv:2604.08865",
}

PANELS = [
    ("train/reward", "step", "reward (sampled, training)", "mean reward"),
    ("train/reward", "wall_time", "reward vs RL wall time", "mean reward"),
    ("train/reward", "cpu_time", "reward vs RL CPU time", "mean reward"),
    ("train/reward", "samples", "reward vs samples drawn", "mean reward"),
    ("validation/accuracy", "step", "held-out validation accuracy", "accuracy"),
    ("train/clip_frac_low", "step", "clip fraction, low side (A<0, r<lo)", "fraction of tokens"),
    ("train/clip_frac_high", "step", "clip fraction, high side (A>0, r>hi)", "fraction of tokens"),
    ("train/prev_entropy", "step", "π_old entropy", "entropy (nats/token)"),
    ("train/response_length", "step", "response length", "tokens"),
    ("train/groups_per_response", "step", "ratio groups per response", "groups"),
    # training–inference mismatch (docs/algorithms/offpolicy.md; logged by the loss, math.md §10.3)
    ("train/gen_mismatch_abs_mean", "step", "π_old vs π_gen mismatch, mean |log π_old − log π_gen|", "nats/token"),
]
X_LABEL = {
    "step": "RL step",
    "wall_time": "RL wall time (s, validation excluded)",
    "cpu_time": "RL CPU time (CPU s of the run's process, validation excluded)",
    "samples": "samples drawn",
}
X_UNIT = {"step": "step {:g}", "wall_time": "{:g} s", "cpu_time": "{:g} CPU s", "samples": "{:g} samples"}
CPU_STEP_KEY = CPU_KEY  # CPU seconds of one RL step (embedded trainer), see report/cpu.py
MISMATCH_KEY = "train/gen_mismatch_abs_mean"
# |log π_old − log π_gen| at or below this is float rounding between two evaluations of one policy,
# not a mismatch: the panel says so instead of drawing noise on 1e-7 ticks
NO_MISMATCH = 1e-6
# one colour per algorithm name in every plot of every report, whichever algorithms a report holds
ALGORITHM_COLOURS = {
    "grpo": "tab:blue",
    "gspo": "tab:orange",
    "sspo": "tab:green",
    "espo": "tab:red",
    "sppo": "tab:purple",
    "sppo_equal_prompts": "tab:brown",
    "gspo_token": "tab:pink",
    "sspo_no_ec": "tab:gray",
    "sppo_small_critic": "tab:olive",
    "moe": "tab:cyan",
}


def _cpu_clock(run: Run) -> dict[int, float] | None:
    """step → cumulative RL CPU seconds, when every RL step recorded its CPU time (else None)."""
    steps = sorted((r for r in run.recs if r["step"] > 0), key=lambda r: r["step"])
    if not steps or not all(CPU_STEP_KEY in r for r in steps):
        return None
    total, out = 0.0, {0: 0.0}
    for r in steps:
        total += r[CPU_STEP_KEY]
        out[r["step"]] = total
    return out


def _series(run: Run, key: str, x: str = "step"):
    if x == "cpu_time":
        clock = _cpu_clock(run)
        if clock is None:
            return [], []
        pts = [
            (clock[r["step"]], r[key]) for r in run.recs if key in r and r["step"] in clock and math.isfinite(r[key])
        ]
    else:
        pts = [(r[x], r[key]) for r in run.recs if key in r and r.get(x) is not None and math.isfinite(r[key])]
    return [p[0] for p in pts], [p[1] for p in pts]


def _mean(values):
    values = [v for v in values if v is not None and math.isfinite(v)]
    return sum(values) / len(values) if values else float("nan")


def summary(run: Run) -> dict:
    recs = [r for r in run.recs if r["step"] > 0]
    acc = [r["validation/accuracy"] for r in run.recs if "validation/accuracy" in r]
    ent = [r["train/prev_entropy"] for r in recs if "train/prev_entropy" in r]
    rew = [r["train/reward"] for r in recs if "train/reward" in r]
    k = max(1, len(rew) // 10)
    ke = max(1, len(ent) // 10)
    clip_lo = [r.get("train/clip_frac_low") for r in recs]
    clip_hi = [r.get("train/clip_frac_high") for r in recs]
    clock = _cpu_clock(run)
    return {
        "acc0": acc[0] if acc else float("nan"),
        "acc": acc[-1] if acc else float("nan"),
        "reward_first": _mean(rew[:k]),
        "reward_last": _mean(rew[-k:]),
        "clip_low": _mean(clip_lo),
        "clip_high": _mean(clip_hi),
        "clip": _mean([a + b for a, b in zip(clip_lo, clip_hi) if a is not None and b is not None]),
        # the clip range: mean over steps of the token-weighted mean bounds [lo, hi] of the ratio
        "bound_low": _mean([r.get("train/clip_bound_low_mean") for r in recs]),
        "bound_high": _mean([r.get("train/clip_bound_high_mean") for r in recs]),
        "entropy_first": _mean(ent[:ke]),
        "entropy_last": _mean(ent[-ke:]),
        "groups": _mean([r.get("train/groups_per_response") for r in recs]),
        "length": _mean([r.get("train/response_length") for r in recs]),
        "wall": recs[-1]["wall_time"] if recs else float("nan"),
        "cpu": max(clock.values()) if clock else float("nan"),
        "samples": recs[-1].get("samples", float("nan")) if recs else float("nan"),
    }


def time_to_reward(run: Run, target: float, window: int = 10, clock: str = "wall_time") -> float | None:
    """RL time (``clock``: ``wall_time`` or ``cpu_time``) at which the trailing mean of the reward over
    ``window`` steps first reaches ``target``."""
    xs, ys = _series(run, "train/reward", clock)
    if not ys:
        return None
    sm = moving_average(ys, window)
    start = min(window, len(ys)) - 1
    hit = [i for i in range(start, len(ys)) if sm[i] >= target]
    return xs[hit[0]] if hit else None


def _secs(t: float) -> str:
    """Seconds with 3 significant digits below 100 s (short smoke runs), whole seconds above."""
    return f"{t:.3g}" if abs(t) < 100 else f"{t:.0f}"


def _stat(values, digits=3):
    mu, sd, n = mean_sd(values)
    return fmt(mu, sd, n, digits)


def _sci(values):
    mu, sd, n = mean_sd(values)
    if n == 0:
        return "n/a"
    return f"{mu:.2e}" + (f" ± {sd:.1e}" if sd is not None else "")


def _clip_range(summaries) -> str:
    """The clip range [lo, hi] of the ratio (mean bounds over steps, then over seeds)."""
    lo, _, n_lo = mean_sd([s["bound_low"] for s in summaries])
    hi, _, n_hi = mean_sd([s["bound_high"] for s in summaries])
    if not (n_lo and n_hi):
        return "n/a"
    return f"[{lo:.5f}, {hi:.5f}]"


# ---------------------------------------------------------------------------- plots
def _save(fig, out: Path, name: str) -> str:
    # "tight": the legend outside the axes stays in the file
    atomic.write_with(out / name, lambda tmp: fig.savefig(tmp, dpi=90, bbox_inches="tight"))
    return name


def smoothing_window(n_points: int) -> int:
    """The trailing-mean window of a plotted curve: a tenth of its points (1: not smoothed)."""
    return max(1, n_points // 10)


def _smoothing_text(windows: set[int], key: str) -> str:
    """What the bold line of a panel is, exactly (``train/`` metrics: one point per RL step)."""
    unit = "RL steps" if key.startswith("train/") else "evaluations"
    if windows <= {1}:
        return "bold: mean over seeds, not smoothed"
    sizes = " or ".join(str(w) for w in sorted(windows))
    return f"bold: mean over seeds of each seed's trailing mean over {sizes} {unit}"


def colour_of(name: str):
    """The algorithm's fixed colour; a name not in :data:`ALGORITHM_COLOURS` gets one of tab20's
    light colours picked by a CRC of the name (stable across processes, unlike ``hash``)."""
    if name in ALGORITHM_COLOURS:
        return ALGORITHM_COLOURS[name]
    import matplotlib

    return matplotlib.colormaps["tab20"](2 * (zlib.crc32(name.encode()) % 10) + 1)


def no_mismatch(by_name: dict[str, list[Run]]) -> float | None:
    """max |train/gen_mismatch_abs_mean| over every run and step when all of it is within float noise
    of zero (≤ :data:`NO_MISMATCH`), else None (a real mismatch, or none logged)."""
    values = [abs(y) for runs in by_name.values() for run in runs for y in _series(run, MISMATCH_KEY)[1]]
    return max(values) if values and max(values) <= NO_MISMATCH else None


def _no_mismatch_text(biggest: float) -> str:
    return f"no mismatch (max |x| = {biggest:.1e} nats/token ≤ {NO_MISMATCH:g}: float rounding, not drawn)"


def _mean_label(name: str, curves: list, grid, x: str) -> str:
    """The legend entry: the seeds, and where the bold mean stops when a seed runs further than that."""
    label = f"{name} ({len(curves)} seed{'s' if len(curves) > 1 else ''})"
    if grid is not None and len(curves) > 1 and max(c[0][-1] for c in curves) > grid[-1]:
        # three short lines: one long line would widen the legend and squeeze the axes beside it
        end = X_UNIT[x].format(grid[-1])
        label = label[:-1] + f";\nbold: mean of all {len(curves)} up to\n{end}, where the shortest ends)"
    return label


def plots(by_name: dict[str, list[Run]], out: Path) -> list[str]:
    """One PNG per panel: each algorithm's seeds faint (raw), bold the mean over seeds of each
    seed's trailing mean over a tenth of its points (:func:`smoothing_window`; a curve of fewer
    than 20 points, such as the held-out evaluations, is not smoothed), the seeds' min–max band of
    those curves shaded. The title says which; the legend sits outside the axes. An algorithm has one
    colour in every report (:func:`colour_of`); a bold mean that stops before a seed's curve does
    (at the shortest seed's end) says where in its legend entry; a mismatch panel of float noise only
    says so instead of plotting it (:func:`no_mismatch`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    for key, x, title, ylabel in PANELS:
        fig, ax = plt.subplots(figsize=(6.4, 3.8))
        biggest = no_mismatch(by_name) if key == MISMATCH_KEY else None
        if biggest is not None:
            ax.set_axis_off()
            ax.set_title(title, fontsize=8)
            ax.text(0.5, 0.5, _no_mismatch_text(biggest), ha="center", va="center", fontsize=9, wrap=True)
            files.append(_save(fig, out, f"{key.split('/')[-1]}_vs_{x}.png"))
            plt.close(fig)
            continue
        windows = set()
        for name, runs in by_name.items():
            color = colour_of(name)
            curves = []
            for run in runs:
                xs, ys = _series(run, key, x)
                if xs:
                    ax.plot(xs, ys, color=color, alpha=0.18, lw=0.8)
                    curves.append((xs, ys))
            if not curves:
                continue
            window = smoothing_window(max(len(c[0]) for c in curves))
            windows.add(window)
            band = seed_band([(xs, moving_average(ys, window)) for xs, ys in curves])
            label = _mean_label(name, curves, band[0] if band else None, x)
            if band is None:
                xs, ys = curves[0]
                ax.plot(xs, moving_average(ys, window), color=color, lw=1.8, label=label)
            else:
                grid, mean, lo, hi = band
                ax.plot(grid, mean, color=color, lw=1.8, label=label)
                if len(curves) > 1:
                    ax.fill_between(grid, lo, hi, color=color, alpha=0.15, lw=0)
        if not ax.has_data():
            plt.close(fig)
            continue
        ax.set_title(
            f"{title}\n({_smoothing_text(windows, key)}; band: seed min–max of those curves; faint: each seed, raw)",
            fontsize=8,
        )
        ax.set_xlabel(X_LABEL[x])
        ax.set_ylabel(ylabel)
        if key.startswith("train/clip"):
            ax.set_yscale("symlog", linthresh=1e-4)
        elif key == MISMATCH_KEY:
            ax.set_yscale("symlog", linthresh=1e-6)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
        fig.tight_layout()
        files.append(_save(fig, out, f"{key.split('/')[-1]}_vs_{x}.png"))
        plt.close(fig)
    return files


# ---------------------------------------------------------------------------- claims
def _pick(by_name: dict[str, list[Run]], alg: str) -> list[Run]:
    if alg in by_name:
        return by_name[alg]
    names = [n for n, rs in by_name.items() if rs and rs[0].algorithm == alg and "equal_prompts" not in n]
    return by_name[names[0]] if len(names) == 1 else []


def _paired(a: list[Run], b: list[Run], fa, fb=None):
    """Per-seed (fa(run_a), fb(run_b)) for the seeds both have."""
    fb = fb or fa
    bs = {r.seed: r for r in b}
    return [(fa(r), fb(bs[r.seed])) for r in sorted(a, key=lambda r: r.seed) if r.seed in bs]


def claims(by_name: dict[str, list[Run]]) -> list[str]:
    rows = []

    def add(text, source, measured, verdict_note):
        verdict, note = verdict_note
        rows.append(f"| {text} | {source} | {measured} | {verdict} | {note} |")

    def clip(r):
        return summary(r)["clip"]

    def clip_per_step(r):
        return [
            rec["train/clip_frac_low"] + rec["train/clip_frac_high"]
            for rec in r.recs
            if rec["step"] > 0 and "train/clip_frac_low" in rec and "train/clip_frac_high" in rec
        ]

    def clipped(label, runs):  # the clip fraction beside the range it is measured against
        return f"{label} {_sci([clip(r) for r in runs])} (range {_clip_range([summary(r) for r in runs])})"

    G, GS, SS, ES = (_pick(by_name, a) for a in ("grpo", "gspo", "sspo", "espo"))
    gs_vals = [clip(r) for r in GS]
    # an absolute claim: one seed is judged against its own step-to-step spread
    add(
        "GSPO's clip fraction is near zero (< 1 %)",
        "SSPO §1",
        clipped("GSPO", GS),
        verdict_below(gs_vals, 0.01, within=clip_per_step(GS[0]) if len(GS) == 1 else None) if GS else (NOT_RUN, ""),
    )
    trip = _paired(SS, GS, lambda r: r.seed)
    if G and GS and SS and trip:
        g_by, gs_by, ss_by = ({r.seed: clip(r) for r in rs} for rs in (G, GS, SS))
        seeds = [s for s in sorted(ss_by) if s in g_by and s in gs_by]
        add(
            "SSPO's clip fraction lies between GRPO's and GSPO's",
            "SSPO §1, Fig. 1",
            f"{clipped('GRPO', G)}, {clipped('SSPO', SS)}, {clipped('GSPO', GS)}",
            verdict_between([g_by[s] for s in seeds], [ss_by[s] for s in seeds], [gs_by[s] for s in seeds]),
        )
    else:
        add("SSPO's clip fraction lies between GRPO's and GSPO's", "SSPO §1, Fig. 1", "", (NOT_RUN, ""))
    pairs = _paired(GS, ES, clip)
    add(
        "ESPO clips less than GSPO",
        "ESPO §1 (gradient underutilization)",
        f"{clipped('ESPO', ES)}, {clipped('GSPO', GS)}",
        verdict_greater([g - e for g, e in pairs]) if pairs else (NOT_RUN, ""),
    )

    def decay(r):
        s = summary(r)
        return s["entropy_last"] / s["entropy_first"] if s["entropy_first"] else float("nan")

    pairs = _paired(SS, G, decay)
    add(
        "π_old entropy decays slower for SSPO than for GRPO (last/first tenth)",
        "SSPO §6 (entropy)",
        f"GRPO {_stat([decay(r) for r in G])}, SSPO {_stat([decay(r) for r in SS])}",
        verdict_greater([s - g for s, g in pairs]) if pairs else (NOT_RUN, ""),
    )

    def final_acc(r):
        return summary(r)["acc"]

    for alg, src in (("sspo", "SSPO Table 1"), ("espo", "ESPO Table 1"), ("gspo", "GSPO §5"), ("sppo", "SPPO Table 1")):
        other = "gspo" if alg == "espo" else "grpo"
        A, B = _pick(by_name, alg), _pick(by_name, other)
        if alg == other or not A or not B:
            if alg != other:
                add(
                    f"{alg.upper()} reaches a higher final validation accuracy than {other.upper()}",
                    src,
                    "",
                    (NOT_RUN, ""),
                )
            continue
        pairs = _paired(A, B, final_acc)
        add(
            f"{alg.upper()} reaches a higher final validation accuracy than {other.upper()}",
            src,
            f"{alg.upper()} {_stat([final_acc(r) for r in A])}, {other.upper()} {_stat([final_acc(r) for r in B])}",
            verdict_greater([a - b for a, b in pairs]),
        )

    # SPPO's speed claim: per seed, the RL time each run needs to reach GRPO's final reward, in CPU
    # seconds when both runs recorded them (the embedded trainer: one thread per run, so a run that
    # shares the cores is not charged for waiting, and a run that trains alone gains nothing), else
    # in wall seconds (NeMo-RL runs), where the note says that CPU sharing was not recorded
    usage = cpu_usage([r for rs in by_name.values() for r in rs])
    for label, name in (
        ("equal samples per step (SPPO: G× more prompts, one sample each)", "sppo"),
        ("equal prompts per step (SPPO: N = 1, G× fewer samples; the paper's setting)", "sppo_equal_prompts"),
    ):
        S = by_name.get(name, [])
        text = f"SPPO reaches GRPO's final reward sooner in RL time, at {label}"
        if not S or not G:
            add(text, "SPPO §4.3, Fig. 5", "", (NOT_RUN, ""))
            continue
        per, diffs, units, sharing = [], [], set(), []
        g_by = {r.seed: r for r in G}
        for r in sorted(S, key=lambda r: r.seed):
            if r.seed not in g_by:
                continue
            g = g_by[r.seed]
            on_cpu = _cpu_clock(g) is not None and _cpu_clock(r) is not None
            clock, unit = ("cpu_time", "CPU s") if on_cpu else ("wall_time", "s wall")
            units.add(unit)
            if on_cpu and usage.get(g.dir) and usage.get(r.dir):
                sharing.append(f"seed {r.seed}: GRPO {usage[g.dir].alongside:.2f}, SPPO {usage[r.dir].alongside:.2f}")
            horizon = summary(r)["cpu" if on_cpu else "wall"]
            target = summary(g)["reward_last"]
            t_g, t_s = time_to_reward(g, target, clock=clock), time_to_reward(r, target, clock=clock)
            shown_s = f"{_secs(t_s)} {unit}" if t_s is not None else f"not within its {_secs(horizon)} {unit}"
            shown_g = f"{_secs(t_g)} {unit}" if t_g is not None else "never"
            per.append(f"seed {r.seed}: target {target:.3f}, GRPO {shown_g}, SPPO {shown_s}")
            if t_g is not None:
                diffs.append(t_g - (t_s if t_s is not None else max(horizon, t_g)))
        verdict = verdict_greater(diffs) if diffs else (NOT_RUN, "")
        if diffs:
            why = f" (Δ = GRPO's time − SPPO's, in {' and '.join(sorted(units))}"
            if sharing:
                why += "; other runs training alongside, which CPU time does not charge: " + "; ".join(sharing)
            if "s wall" in units:
                why += "; CPU sharing not recorded"
            verdict = (verdict[0], verdict[1] + why + ")")
        add(text, "SPPO §4.3, Fig. 5", "; ".join(per) or "no common seed", verdict)
    return rows


# ---------------------------------------------------------------------------- the report
def _setting(runs: list[Run], key: str):
    vals = []
    for r in runs:
        v = r.meta.get(key)
        if isinstance(v, dict):
            v = "; ".join(f"{k}: {x}" for k, x in v.items() if x)
        if v is not None and v not in vals:
            vals.append(v)
    return " / ".join(map(str, vals)) if vals else "not recorded"


def _warm_starts(runs: list[Run]) -> tuple[list[str], list[str]]:
    """(each warm start the runs started from: greedy held-out accuracy reached against its target;
    the ones that missed their target), one text per warm start folder, by seed."""
    seen: dict = {}
    for r in sorted(runs, key=lambda r: r.seed):
        ws = r.meta.get("warmstart")
        if ws and ws["dir"] not in seen:
            seen[ws["dir"]] = (r.seed, ws)
    every, missed = [], []
    for seed, ws in seen.values():
        name = f"seed {seed} (`{Path(ws['dir']).name}`)"
        steps = f"{ws['steps']} steps" if ws["steps"] is not None else "? steps"
        target = ws["target"]
        if target is None:
            every.append(f"{name}: {ws['accuracy']:.3f} after {steps}, target not recorded")
        elif ws["accuracy"] < target:
            every.append(f"{name}: {ws['accuracy']:.3f} after {steps}, target {target:g}: **missed**")
            missed.append(
                f"{name} reached {ws['accuracy']:.3f} < target {target:g} after {steps} "
                f"(warmstart.max_steps={ws['max_steps']})"
            )
        else:
            every.append(f"{name}: {ws['accuracy']:.3f} after {steps}, target {target:g}: reached")
    return every, missed


def _smoke_banner(runs: list[Run]) -> list[str]:
    seeds = len({r.seed for r in runs})
    return [
        "> **Smoke run** (`nemo-granular compare --smoke`): "
        f"{seeds} seed{'s' if seeds > 1 else ''} × {_setting(runs, 'steps')} RL steps at a tiny budget. "
        "It checks the wiring end to end — every algorithm warm-starts, trains, checkpoints, is evaluated on "
        "the benchmark suite and lands in this report — and proves nothing about the papers' claims: so few "
        f"seeds and steps cannot test them, and none is judged here (each reads *{NOT_JUDGED}*). The full "
        "demo (`bash scripts/demo.sh`, without `--smoke`) measures them.",
        "",
    ]


def _verdict_table(measured: list[str]) -> list[str]:
    return [
        "Verdict rule: each claim is judged on a 95 % confidence interval over seeds — for a comparison, "
        "the Student-t interval of the mean per-seed paired difference Δ (the runs of one seed share the "
        "warm start and the prompts), mean(Δ) ± t(0.975, n−1)·sd(Δ)/√n; for a threshold claim, the same "
        f"interval of the quantity's mean. **{HOLDS}**: the whole interval is on the claim's side; "
        f"**{FAILS}**: the whole interval is on the other side; **{INCONCLUSIVE}**: the interval contains "
        "0 (the threshold). One seed gives no interval: a comparison is then inconclusive and only its "
        "direction is shown, while a threshold claim is judged against the run's own step-to-step "
        "spread. Mean ± sd in the measured column is over seeds.",
        "",
        "| claim | paper | measured | verdict | effect, 95 % interval (paired over seeds) |",
        "|---|---|---|---|---|",
        *measured,
    ]


def report_from_runs(
    run_dirs: list, out: Path, timing: dict | None = None, notes: list[str] | None = None, smoke: bool = False
) -> Path:
    """Build ``out/report.md`` and the plots from run directories (embedded and/or NeMo-RL).

    Failed or incomplete runs are listed with the reason and left out of tables and verdicts;
    an error only when no run is usable. ``smoke`` (``compare --smoke``): the report says at its top
    that it is a smoke run and judges no claim."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    all_runs = [load_run(d) for d in run_dirs]
    runs = [r for r in all_runs if r.status == "finished"]
    bad = [r for r in all_runs if r.status != "finished"]
    if not runs:
        raise ValueError("no usable run: " + "; ".join(f"{r.dir}: {r.problem}" for r in bad))
    by_name: dict[str, list[Run]] = {}
    for run in runs:
        by_name.setdefault(run.name, []).append(run)
    S = {name: [summary(r) for r in rs] for name, rs in by_name.items()}
    files = plots(by_name, out)
    seeds = sorted({r.seed for r in runs})
    warm_every, warm_missed = _warm_starts(runs)
    lines = [
        "# nemo-granular comparison" + (" (smoke run)" if smoke else ""),
        "",
        *(_smoke_banner(runs) if smoke else []),
        f"Runs: {len(runs)} usable of {len(all_runs)} "
        f"({', '.join(f'{a} × {len(r)}' for a, r in by_name.items())}); seeds {', '.join(map(str, seeds))}.",
        "",
    ]
    if warm_missed:
        lines += [
            f"**{len(warm_missed)} of {len(warm_every)} warm starts missed their target** (greedy held-out "
            "accuracy below `warmstart.target_accuracy`: RL started from a weaker policy than asked for; more "
            "`warmstart.max_steps` gets closer): " + "; ".join(warm_missed) + ".",
            "",
        ]
    if bad:
        lines += ["**Runs left out** (failed or incomplete; the tables and verdicts cover the others):", ""]
        lines += [f"- `{r.dir.name}` ({r.source}, {r.status}): {r.problem}" for r in bad]
        lines.append("")
    lines += [
        "## Setting",
        "",
        f"- Model: {_setting(runs, 'model')}",
        f"- Task: {_setting(runs, 'task')}",
        f"- RL steps: {_setting(runs, 'steps')}; batch per step: {_setting(runs, 'batch')}",
        f"- Learning rate: {_setting(runs, 'lr')}; optimizer steps per rollout: "
        f"{_setting(runs, 'optimizer_steps_per_rollout')}",
        f"- Decoding: {_setting(runs, 'decoding')}",
        f"- Validation every {_setting(runs, 'validation_every')} steps",
        f"- Sources: {', '.join(sorted({r.source for r in runs}))} run directories",
    ]
    if any(r.source == "embedded" for r in runs):
        lines.append(
            "- Each seed's runs start from the same warm-started policy and see the same prompts and the "
            "same number of samples per step (SPPO: one sample per prompt, G× more prompts) unless the "
            "algorithm's name says otherwise (`sppo_equal_prompts`: the same prompts, one sample each)."
        )
    if warm_every:
        lines.append(
            "- Warm starts (greedy held-out accuracy reached, against `warmstart.target_accuracy`): "
            + "; ".join(warm_every)
        )
    for r in runs:
        if r.meta.get("entropy_note"):
            lines.append(f"- {r.name}: {r.meta['entropy_note']}")
            break
    if timing:
        lines.append(
            "- Timing: " + ", ".join(f"{k} {v:.0f}" if isinstance(v, float) else f"{k} {v}" for k, v in timing.items())
        )
    lines += [f"- {n}" for n in (notes or [])]
    lines += ["", "Papers: " + "; ".join(PAPERS.values()) + ".", ""]
    lines += [
        "## Final validation accuracy and training statistics",
        "",
        "Mean ± sd over seeds (one seed: no ± shown). Clip low / high: fraction of tokens whose ratio was "
        "clipped below / above the clip range; clip range: the mean bounds [lo, hi] the ratios were "
        "clipped to (token-weighted over each step, mean over steps and seeds: fixed for GRPO, "
        "entropy-adaptive for SSPO and ESPO).",
        "",
        "| algorithm | seeds | first val acc | final val acc | Δ acc | reward first→last 10% | clip low | "
        "clip high | clip range [lo, hi] | π_old entropy first→last | groups/resp | resp len | samples | "
        "RL wall (s) | RL CPU (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, ss in S.items():
        lines.append(
            f"| {name} | {len(ss)} | {_stat([s['acc0'] for s in ss])} | {_stat([s['acc'] for s in ss])} | "
            f"{_stat([s['acc'] - s['acc0'] for s in ss])} | {_stat([s['reward_first'] for s in ss])} → "
            f"{_stat([s['reward_last'] for s in ss])} | {_sci([s['clip_low'] for s in ss])} | "
            f"{_sci([s['clip_high'] for s in ss])} | {_clip_range(ss)} | {_stat([s['entropy_first'] for s in ss])} → "
            f"{_stat([s['entropy_last'] for s in ss])} | {_stat([s['groups'] for s in ss], 1)} | "
            f"{_stat([s['length'] for s in ss], 1)} | {_stat([s['samples'] for s in ss], 0)} | "
            f"{_stat([s['wall'] for s in ss], 0)} | {_stat([s['cpu'] for s in ss], 0)} |"
        )
    bench = benchmark_tables(by_name)
    if bench:
        lines += ["", "## Benchmark suite", "", *bench]
    # a claim whose runs are absent has no interval: named below the table, not given a row in it
    rows = claims(by_name)
    measured = [r for r in rows if r.split("|")[4].strip() != NOT_RUN]
    unmeasured = [f"{r.split('|')[1].strip()} ({r.split('|')[2].strip()})" for r in rows if r not in measured]
    lines += ["## The papers' directional claims, as measured here", ""]
    if smoke:  # the measured numbers, no verdict and no interval: a smoke run judges nothing
        lines += [
            f"**{NOT_JUDGED}**: a smoke run checks that every claim can be measured, not whether it is true.",
            "",
            "| claim | paper | measured | verdict |",
            "|---|---|---|---|",
            *("|".join(r.split("|")[:4]) + f"| {NOT_JUDGED} |" for r in measured),
        ]
    else:
        lines += _verdict_table(measured)
    lines += [
        "",
        *(
            [
                "Not measured here (no runs of what it compares in these run directories): "
                + "; ".join(unmeasured)
                + ".",
                "",
            ]
            if unmeasured
            else []
        ),
        "Clip fractions are token-weighted means over all RL steps (NeMo-RL normalisation). RL times "
        "exclude validation. SPPO's speed claim is measured in RL **CPU** seconds when the runs recorded "
        "them (the embedded trainer does, per step; each run has one torch thread), because runs that "
        "share a machine unequally (one trains beside another, one alone; another job takes CPU from "
        "one) are slowed unequally in wall time but not in CPU time; the note gives how many other runs "
        "trained alongside each. Where CPU time was not recorded (NeMo-RL runs) it is measured in wall "
        "seconds, and the note says that CPU sharing was not recorded. The SPPO claim is given at equal "
        "samples and at "
        "equal prompts per step when both were run; the paper's speed-up is the equal-prompts one (N = 1). "
        "A run that never reaches the target counts as reaching it at the end of its RL time (censored): "
        "when that is earlier than GRPO's time the seed cannot tell either way.",
        "",
        "## Plots",
        "",
    ]
    biggest = no_mismatch(by_name)
    if biggest is not None:
        lines += [f"π_old vs π_gen mismatch: {_no_mismatch_text(biggest)}.", ""]
    lines += [f"![{f}]({f})" for f in files]
    return atomic.write_text(out / "report.md", "\n".join(lines) + "\n")
