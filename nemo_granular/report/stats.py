"""Small pure statistics for the report: smoothing, seed bands, noise-aware verdicts.

The noise threshold of a comparison is the seed-to-seed spread: the sample standard deviation
(ddof=1) over seeds of the per-seed quantity (for a paired comparison of two algorithms, of the
per-seed DIFFERENCE, the runs of one seed sharing warm start and prompts). A measured effect no
larger than that spread is "inconclusive"; with one seed there is no spread to compare with,
so a comparison is "inconclusive (1 seed)" and the measured direction is shown alone. An absolute
claim (one quantity against a fixed threshold) is judged on one seed against the run's own
step-to-step spread (:func:`verdict_below`).
"""

from __future__ import annotations

import math

import numpy as np

HOLDS, FAILS, INCONCLUSIVE, NOT_RUN = "holds", "does NOT hold", "inconclusive", "n/a (not run)"
UNUSABLE = "unusable (unequal CPU)"  # a wall-time claim whose runs did not get the same CPU (report/cpu.py)


def moving_average(y, window: int) -> np.ndarray:
    """Trailing mean over the last ``window`` points (fewer at the start); NaN-free input."""
    y = np.asarray(y, dtype=np.float64)
    if y.size == 0 or window <= 1:
        return y.copy()
    c = np.concatenate([[0.0], np.cumsum(y)])
    idx = np.arange(1, y.size + 1)
    lo = np.maximum(idx - window, 0)
    return (c[idx] - c[lo]) / (idx - lo)


def seed_band(curves: list[tuple], grid_points: int = 200):
    """Per-seed (x, y) curves → (grid, mean, min, max) on the x range all seeds cover (linear
    interpolation); None when fewer than one curve has two points."""
    curves = [(np.asarray(x, float), np.asarray(y, float)) for x, y in curves if len(x) >= 2]
    if not curves:
        return None
    lo = max(x[0] for x, _ in curves)
    hi = min(x[-1] for x, _ in curves)
    if not hi > lo:
        return None
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

    holds: mean(d) > sd(d); does NOT hold: mean(d) < −sd(d); else inconclusive (the effect is
    within the seed-to-seed spread). Returns (verdict, explanation)."""
    mu, sd, n = mean_sd(diffs)
    if n == 0:
        return NOT_RUN, ""
    same = sum(1 for d in diffs if d is not None and math.isfinite(d) and d > 0)
    if sd is None:
        return f"{INCONCLUSIVE} (1 seed)", f"Δ {mu:+.3g} in the one seed, no seed-to-seed spread to compare with"
    note = f"Δ {mu:+.3g}, seed-to-seed sd of Δ {sd:.3g}, A > B in {same}/{n} seeds"
    if mu > sd:
        return HOLDS, note
    if mu < -sd:
        return FAILS, note
    return INCONCLUSIVE, note + " (|Δ| ≤ sd)"


def verdict_below(values, threshold: float, within=None) -> tuple[str, str]:
    """Claim "value < threshold" from per-seed values: holds when mean + sd < threshold, does
    NOT hold when mean − sd > threshold, else inconclusive.

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
        note = (f"{mu:.3g} (1 seed); noise: the run's step-to-step sd {step_sd:.3g} over {steps} steps "
                f"(threshold {threshold:g})")
        if mu + step_sd < threshold:
            return HOLDS, note
        if mu - step_sd > threshold:
            return FAILS, note
        return f"{INCONCLUSIVE} (1 seed)", note + " (threshold within the spread)"
    note = f"{mu:.3g} ± {sd:.3g} over {n} seeds (threshold {threshold:g})"
    if mu + sd < threshold:
        return HOLDS, note
    if mu - sd > threshold:
        return FAILS, note
    return INCONCLUSIVE, note + " (threshold within the spread)"


def verdict_between(lo_vals, mid_vals, hi_vals) -> tuple[str, str]:
    """Claim "min(L, H) ≤ M ≤ max(L, H)" per seed (paired): holds when M's distance inside the
    interval exceeds the seed spread of that distance in every direction, i.e. both paired
    claims (M above the lower one, M below the upper one) hold; fails when either fails."""
    n = min(len(lo_vals), len(mid_vals), len(hi_vals))
    if n == 0:
        return NOT_RUN, ""
    lower = [min(a, b) for a, b in zip(lo_vals[:n], hi_vals[:n])]
    upper = [max(a, b) for a, b in zip(lo_vals[:n], hi_vals[:n])]
    v1, n1 = verdict_greater([m - l for m, l in zip(mid_vals[:n], lower)])
    v2, n2 = verdict_greater([u - m for m, u in zip(mid_vals[:n], upper)])
    if v1 == v2 == HOLDS:
        return HOLDS, f"above the lower: {n1}; below the upper: {n2}"
    if FAILS in (v1, v2):
        return FAILS, f"above the lower: {n1}; below the upper: {n2}"
    return (v1 if v1.startswith(INCONCLUSIVE) else v2), f"above the lower: {n1}; below the upper: {n2}"
