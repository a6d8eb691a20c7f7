"""Small pure statistics for the report: smoothing, seed bands, verdicts with intervals.

A claim is judged on a 95 % confidence interval over seeds: for a paired comparison of two
algorithms, the Student-t interval of the mean per-seed DIFFERENCE (the runs of one seed share
warm start and prompts), mean(d) ± t_{0.975, n−1} · sd(d)/√n with the sample sd (ddof=1); for a
claim about one quantity against a fixed threshold, the same interval of the quantity's mean.
The claim holds when the whole interval is on its side, does NOT hold when the whole interval is
on the other side, and is "inconclusive" when the interval contains 0 (the threshold). With one
seed there is no interval: a comparison is "inconclusive (1 seed)", while an absolute claim is
judged against the run's own step-to-step spread (:func:`verdict_below`).
"""

from __future__ import annotations

import math

import numpy as np

HOLDS, FAILS, INCONCLUSIVE, NOT_RUN = "holds", "does NOT hold", "inconclusive", "n/a (not run)"
NOT_JUDGED = "not judged: smoke run"  # compare --smoke: the claims are measured, never judged

# t_{0.975, df}: the two-sided 95 % quantile of Student's t for df = 1..30 (standard table values;
# tests/test_report.py checks them against a numerical integration of the t density)
_T975 = (
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
)


def t975(df: int) -> float:
    """Two-sided 95 % quantile of Student's t with ``df`` degrees of freedom (df > 30: the normal
    quantile plus two Cornish-Fisher terms, within 0.001 of the exact value)."""
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def mean_ci(values) -> tuple[float, float | None, float | None, int]:
    """(mean, lower, upper, n): the 95 % Student-t interval of the mean over the finite values,
    mean ± t_{0.975, n−1}·sd/√n (sd with ddof=1); lower = upper = None for fewer than 2 values."""
    mu, sd, n = mean_sd(values)
    if sd is None:
        return mu, None, None, n
    half = t975(n - 1) * sd / math.sqrt(n)
    return mu, mu - half, mu + half, n


def moving_average(y, window: int) -> np.ndarray:
    """Trailing mean over the last ``window`` points (fewer at the start); NaN-free input."""
    y = np.asarray(y, dtype=np.float64)
    if y.size == 0 or window <= 1:
        return y.copy()
    c = np.concatenate([[0.0], np.cumsum(y)])
    idx = np.arange(1, y.size + 1)
    lo = np.maximum(idx - window, 0)
    return (c[idx] - c[lo]) / (idx - lo)


def seed_band(curves: list[tuple], grid_points: int | None = None):
    """Per-seed (x, y) curves → (grid, mean, min, max) on the x range all seeds cover (linear
    interpolation); None when fewer than one curve has two points. The grid: the seeds' own x
    values in that range (default), so that a line through it has a vertex only where a seed has a
    point and stays straight between them on any axis scale (a denser grid of linearly interpolated
    points bends into arcs on a symlog axis), or ``grid_points`` evenly spaced points."""
    curves = [(np.asarray(x, float), np.asarray(y, float)) for x, y in curves if len(x) >= 2]
    if not curves:
        return None
    lo = max(x[0] for x, _ in curves)
    hi = min(x[-1] for x, _ in curves)
    if not hi > lo:
        return None
    if grid_points is None:
        grid = np.unique(np.concatenate([x[(x >= lo) & (x <= hi)] for x, _ in curves]))
    else:
        grid = np.linspace(lo, hi, grid_points)
    Y = np.stack([np.interp(grid, x, y) for x, y in curves])
    return grid, Y.mean(0), Y.min(0), Y.max(0)


def mean_sd(values) -> tuple[float, float | None, int]:
    """(mean, sample sd or None for fewer than 2 values, n) over the finite values."""
    v = np.asarray([x for x in values if x is not None and math.isfinite(x)], dtype=np.float64)
    if v.size == 0:
        return float("nan"), None, 0
    return float(v.mean()), (float(v.std(ddof=1)) if v.size > 1 else None), int(v.size)


def fmt(mu, sd=None, n: int | None = None, digits: int = 3) -> str:
    """``mean ± sd`` for 2+ seeds, the value alone for one (never ``± 0.000``), ``n/a`` for none."""
    if mu is None or (isinstance(mu, float) and not math.isfinite(mu)):
        return "n/a"
    text = f"{mu:.{digits}f}"
    return f"{text} ± {sd:.{digits}f}" if sd is not None else text


def verdict_greater(diffs) -> tuple[str, str]:
    """Claim "A > B" from per-seed paired differences d_s = A_s − B_s.

    holds: the 95 % interval of mean(d) (:func:`mean_ci`) lies above 0; does NOT hold: below 0;
    else inconclusive (the interval contains 0). Returns (verdict, effect with its interval)."""
    mu, lo, hi, n = mean_ci(diffs)
    if n == 0:
        return NOT_RUN, ""
    same = sum(1 for d in diffs if d is not None and math.isfinite(d) and d > 0)
    if lo is None:
        return f"{INCONCLUSIVE} (1 seed)", f"Δ {mu:+.3g} in the one seed, no interval from one seed"
    note = f"Δ {mu:+.3g}, 95 % CI [{lo:+.3g}, {hi:+.3g}] (paired over {n} seeds; A > B in {same}/{n})"
    if lo > 0:
        return HOLDS, note
    if hi < 0:
        return FAILS, note
    return INCONCLUSIVE, note + " (the interval contains 0)"


def verdict_below(values, threshold: float, within=None) -> tuple[str, str]:
    """Claim "value < threshold" from per-seed values: holds when the 95 % interval of the mean over
    seeds (:func:`mean_ci`) lies below the threshold, does NOT hold when it lies above, else inconclusive.

    An absolute claim (one number against a fixed threshold, unlike a comparison of two runs) can be
    judged on one seed: ``within`` = that run's per-step values, whose step-to-step sd then stands in
    for the seed-to-seed sd (it is the larger of the two for a mean over many steps: conservative)."""
    mu, sd, n = mean_sd(values)
    if n == 0:
        return NOT_RUN, ""
    if sd is None:
        _, step_sd, steps = mean_sd(within or [])
        if step_sd is None:
            return f"{INCONCLUSIVE} (1 seed)", f"{mu:.3g} in the one seed (threshold {threshold:g})"
        note = (
            f"{mu:.3g} (1 seed); noise: the run's step-to-step sd {step_sd:.3g} over {steps} steps "
            f"(threshold {threshold:g})"
        )
        if mu + step_sd < threshold:
            return HOLDS, note
        if mu - step_sd > threshold:
            return FAILS, note
        return f"{INCONCLUSIVE} (1 seed)", note + " (threshold within the spread)"
    _, lo, hi, _ = mean_ci(values)
    note = f"mean {mu:.3g}, 95 % CI [{lo:.3g}, {hi:.3g}] over {n} seeds (threshold {threshold:g})"
    if hi < threshold:
        return HOLDS, note
    if lo > threshold:
        return FAILS, note
    return INCONCLUSIVE, note + " (the interval contains the threshold)"


def verdict_between(lo_vals, mid_vals, hi_vals) -> tuple[str, str]:
    """Claim "min(L, H) ≤ M ≤ max(L, H)" per seed (paired): holds when both paired claims (M above
    the lower one, M below the upper one) hold by :func:`verdict_greater`; fails when either fails."""
    n = min(len(lo_vals), len(mid_vals), len(hi_vals))
    if n == 0:
        return NOT_RUN, ""
    lower = [min(a, b) for a, b in zip(lo_vals[:n], hi_vals[:n])]
    upper = [max(a, b) for a, b in zip(lo_vals[:n], hi_vals[:n])]
    v1, n1 = verdict_greater([m - lo for m, lo in zip(mid_vals[:n], lower)])
    v2, n2 = verdict_greater([u - m for m, u in zip(mid_vals[:n], upper)])
    if v1 == v2 == HOLDS:
        return HOLDS, f"above the lower: {n1}; below the upper: {n2}"
    if FAILS in (v1, v2):
        return FAILS, f"above the lower: {n1}; below the upper: {n2}"
    return (v1 if v1.startswith(INCONCLUSIVE) else v2), f"above the lower: {n1}; below the upper: {n2}"
