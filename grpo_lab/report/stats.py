"""Statistics for reports: mean ± confidence interval over seeds, Welch difference of two rows,
first-reach, curve bands.

Pure functions on plain Python/NumPy numbers: no files, no run objects.

Confidence intervals use Student's t, not the normal 1.96: with the 3–5 seeds an RL sweep can
afford, t_{0.975, n-1} is 4.30 (n=3) or 2.78 (n=5), so a normal interval would be far too narrow.

The t quantile is computed here (incomplete beta function + bisection) rather than imported from
SciPy, which the project does not otherwise need. It matches scipy.stats.t.ppf to ~1e-10.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

# ---------------------------------------------------------------------------------------------
# Student t quantile
# ---------------------------------------------------------------------------------------------


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction for the regularized incomplete beta (modified Lentz).

    Source: Numerical Recipes, 3rd ed., §6.4 (`betacf`). Converges fast for x < (a+1)/(a+b+2).
    """
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        # even step of the fraction
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        # odd step of the fraction
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b) for 0 <= x <= 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    # prefactor x^a (1-x)^b / (a B(a, b)), in logs for large a, b
    log_front = (
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    front = math.exp(log_front)
    # use the symmetry I_x(a,b) = 1 - I_{1-x}(b,a) where the fraction converges faster
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """CDF of Student's t with `df` degrees of freedom.

    P(T <= t) = 1 - ½ I_{df/(df+t²)}(df/2, ½)  for t >= 0, and symmetric for t < 0.
    """
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_ppf(p: float, df: float) -> float:
    """Quantile (inverse CDF) of Student's t, found by bisection on `t_cdf`.

    Example: t_ppf(0.975, 2) = 4.302653 (the two-sided 95 % critical value for n = 3 seeds).
    """
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if df <= 0:
        raise ValueError(f"df must be > 0, got {df}")
    if p < 0.5:
        return -t_ppf(1.0 - p, df)
    if p == 0.5:
        return 0.0
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:  # bracket the root; the t tail is heavy for df=1, so grow geometrically
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


# ---------------------------------------------------------------------------------------------
# Per-group summaries
# ---------------------------------------------------------------------------------------------


def mean_ci(values: Iterable[float | None], confidence: float = 0.95) -> tuple[float, float, int]:
    """Mean and Student-t confidence half-width over seeds.

    half_width = t_{(1+confidence)/2, n-1} · s / √n, with s the sample standard deviation (ddof=1).

    `None` entries (metric missing for that run) are dropped and not counted in n. NaN entries are
    kept on purpose: a seed that diverged to NaN should make the cell read "nan", not vanish.

    Returns (mean, half_width, n). n = 0 -> (nan, nan, 0); n = 1 -> (value, nan, 1), since one seed
    says nothing about spread (shown as "n/a").
    """
    xs = [float(v) for v in values if v is not None]
    n = len(xs)
    if n == 0:
        return math.nan, math.nan, 0
    mean = math.fsum(xs) / n
    if n == 1:
        return mean, math.nan, 1
    sd = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (n - 1))
    half = t_ppf(0.5 + confidence / 2.0, n - 1) * sd / math.sqrt(n)
    return mean, half, n


def welch_diff_ci(a: Sequence[float], b: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """Difference of means, mean(a) − mean(b), and the half-width of its Welch t interval.

    Welch (1947): unequal variances, se = √(s_a²/n_a + s_b²/n_b), and the Welch–Satterthwaite
    degrees of freedom ν = (v_a + v_b)² / (v_a²/(n_a−1) + v_b²/(n_b−1)) with v = s²/n;
    half = t_{(1+confidence)/2, ν} · se.

    The half-width is nan with fewer than 2 values on a side (no spread to speak of) and 0 when
    both sides are constant. Both sides must be non-empty.
    """
    na, nb = len(a), len(b)
    ma, mb = math.fsum(a) / na, math.fsum(b) / nb
    if na < 2 or nb < 2:
        return ma - mb, math.nan
    va = math.fsum((x - ma) ** 2 for x in a) / (na - 1) / na
    vb = math.fsum((x - mb) ** 2 for x in b) / (nb - 1) / nb
    se = math.sqrt(va + vb)
    if se == 0:
        return ma - mb, 0.0
    df = (va + vb) ** 2 / (va**2 / (na - 1) + vb**2 / (nb - 1))
    return ma - mb, t_ppf(0.5 + confidence / 2.0, df) * se


def paired_diff_ci(a: dict, b: dict, confidence: float = 0.95) -> tuple[float, float, int]:
    """Mean paired difference over the keys (seeds) both sides have, its Student-t half-width, and
    the number of pairs: d_s = a[s] − b[s], half = t_{(1+confidence)/2, n−1} · sd(d) / √n.

    Runs of one seed share their warm-up checkpoint and prompt order across a table's rows, so the
    seed-to-seed spread they share cancels in d_s: the interval is usually much narrower than
    Welch's on the same numbers. Half-width nan with fewer than 2 pairs; (nan, nan, 0) with none.
    """
    seeds = [k for k in a if k in b and a[k] is not None and b[k] is not None]
    diffs = [float(a[k]) - float(b[k]) for k in seeds]
    mean, half, n = mean_ci(diffs, confidence)
    return mean, half, n


def contrast_ci(by_term: dict[str, dict], coefficients: dict[str, float], relative_to: dict | None = None,
                confidence: float = 0.95) -> tuple[float, float, int]:
    """A linear contrast of rows paired by seed: per seed s present in every term (and in `relative_to`),
    c_s = sum_k coefficients[k] · by_term[k][s], divided by relative_to[s] when given; then the mean of
    c_s, its Student-t half-width and the number of seeds (as `mean_ci`).

    A difference of differences, e.g. "PPO's drop minus GRPO's" = (ppo_p − ppo_0) − (grpo_p − grpo_0),
    is {ppo_p: 1, ppo_0: −1, grpo_p: −1, grpo_0: 1}; runs of one seed share their warm-up checkpoint
    across algorithms too, so the shared seed-to-seed spread cancels as in `paired_diff_ci`.
    """
    tables = [by_term[k] for k in coefficients] + ([relative_to] if relative_to is not None else [])
    seeds = [s for s in tables[0] if all(t.get(s) is not None for t in tables)] if tables else []
    values = []
    for s in seeds:
        c = math.fsum(coef * float(by_term[k][s]) for k, coef in coefficients.items())
        values.append(c / float(relative_to[s]) if relative_to is not None else c)
    return mean_ci(values, confidence)


def seeds_for_half_width(sd: float, half_width: float, confidence: float = 0.95, max_seeds: int = 1000) -> int | None:
    """Fewest seeds n (≥ 2) whose Student-t interval t_{(1+confidence)/2, n−1} · sd / √n is at most
    `half_width`, for paired differences with standard deviation `sd` (e.g. one estimated from a
    table's seeds); None when sd is nan or more than `max_seeds` would be needed.

    Example: sd = 2 pp, ±2.5 pp -> 5 seeds (t_{.975,4} · 2/√5 = 2.48; 4 seeds give 3.18).
    """
    if math.isnan(sd):
        return None
    for n in range(2, max_seeds + 1):
        if t_ppf(0.5 + confidence / 2.0, n - 1) * sd / math.sqrt(n) <= half_width:
            return n
    return None


def first_reach(xs: Sequence[float], ys: Sequence[float | None], target: float) -> float | None:
    """First x (e.g. samples or steps) at which y >= target, or None if it never gets there.

    Points are taken in order of increasing x; points whose y is None or NaN are skipped. No
    interpolation between evaluations: the answer is an x where an evaluation actually showed the
    target, so it over-estimates by at most one eval interval.
    """
    pairs = sorted(
        ((x, y) for x, y in zip(xs, ys) if y is not None and not math.isnan(y)),
        key=lambda p: p[0],
    )
    for x, y in pairs:
        if y >= target:
            return x
    return None


def aggregate_curves(
    curves: Sequence[tuple[Sequence[float], Sequence[float]]],
    confidence: float = 0.95,
) -> dict[str, np.ndarray]:
    """Mean curve and pointwise CI band across seeds, on a common x grid.

    Seeds rarely evaluate at identical x (dynamic sampling changes samples per step), so each seed's
    curve is linearly interpolated onto a shared grid. The grid is the union of all seeds' x values
    restricted to the range every seed covers: outside it the mean would silently switch from
    n seeds to fewer and jump, which reads like a real effect on a plot.

    Args:
        curves: one (xs, ys) per seed; xs need not be sorted or shared. Empty curves are ignored.
    Returns:
        {"x": (P,), "mean": (P,), "lo": (P,), "hi": (P,), "n": int seeds used}; lo/hi equal the mean
        when only one seed is available (no band). All arrays are empty if no curve has data.
    """
    clean = []
    for xs, ys in curves:
        pts = sorted((float(x), float(y)) for x, y in zip(xs, ys) if y is not None)
        if pts:
            clean.append((np.array([p[0] for p in pts]), np.array([p[1] for p in pts])))
    empty = np.array([], dtype=float)
    if not clean:
        return {"x": empty, "mean": empty, "lo": empty, "hi": empty, "n": 0}
    x_min = max(float(x[0]) for x, _ in clean)
    x_max = min(float(x[-1]) for x, _ in clean)
    all_x = np.unique(np.concatenate([x for x, _ in clean]))
    grid = all_x[(all_x >= x_min) & (all_x <= x_max)]
    if grid.size == 0:  # seeds cover disjoint x ranges: nothing honest to average
        return {"x": empty, "mean": empty, "lo": empty, "hi": empty, "n": len(clean)}
    ys = np.stack([np.interp(grid, x, y) for x, y in clean])  # (S, P)
    n = ys.shape[0]
    mean = ys.mean(axis=0)  # (P,)
    if n >= 2:
        sd = ys.std(axis=0, ddof=1)
        half = t_ppf(0.5 + confidence / 2.0, n - 1) * sd / math.sqrt(n)
    else:
        half = np.zeros_like(mean)
    return {"x": grid, "mean": mean, "lo": mean - half, "hi": mean + half, "n": n}
