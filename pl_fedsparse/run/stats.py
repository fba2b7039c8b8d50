"""Statistics for comparing runs over seeds: Student's t distribution (without scipy: the regularized incomplete
beta function by its continued fraction), the paired difference of runs that share seeds and Welch's difference of
unpaired groups, each with its 95 % interval, p-value and a verdict read from the interval (holds / reversed when it
excludes 0, otherwise not shown).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

__all__ = ["CONFIDENCE", "paired_difference", "t_cdf", "t_quantile", "welch_difference"]


def _mean_std(xs: list[float]) -> tuple[float, float | None]:
    mean = sum(xs) / len(xs)
    if len(xs) < 2:
        return mean, None
    return mean, math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))


# --- paired statistics: Student's t without scipy (the library has no scipy dependency; the tests check against it)

#: two-sided confidence level of the intervals in ``pairs.md``
CONFIDENCE = 0.95


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function, by the modified Lentz method (Numerical Recipes
    §6.4, ``betacf``); it converges fast for ``x < (a + 1) / (a + b + 2)``."""
    tiny, eps = 1e-300, 1e-16
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 10_000):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


def _betainc(a: float, b: float, x: float, y: float) -> float:
    """The regularized incomplete beta function I_x(a, b); ``y`` is ``1 - x``, passed in so that a tail near
    ``x = 1`` keeps its precision. The fraction runs on whichever side converges, I_x(a, b) = 1 - I_y(b, a)."""
    if x <= 0.0:
        return 0.0
    if y <= 0.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log(y))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, y) / b


def _t_two_sided(t: float, df: float) -> float:
    """P(|T| >= |t|) for Student's t with ``df`` degrees of freedom: I_{df/(df+t²)}(df/2, 1/2), computed directly
    (not as 1 - CDF) so that a small p keeps its relative precision."""
    if math.isinf(t):
        return 0.0
    t2 = t * t
    return _betainc(df / 2.0, 0.5, df / (df + t2), t2 / (df + t2))


def t_cdf(t: float, df: float) -> float:
    """Student's t cumulative distribution function P(T <= t) with ``df > 0`` degrees of freedom (not necessarily
    an integer: Welch's are not), from the regularized incomplete beta function.

    Example:
        >>> round(t_cdf(2.0, 3), 10)
        0.9303370157
        >>> t_cdf(0.0, 7)
        0.5
    """
    if not df > 0:
        raise ValueError(f"df={df!r} is invalid; expected a positive number")
    half_tail = 0.5 * _t_two_sided(t, df)
    return 1.0 - half_tail if t >= 0 else half_tail


def t_quantile(q: float, df: float) -> float:
    """The ``q`` quantile of Student's t with ``df > 0`` degrees of freedom: :func:`t_cdf` inverted by bisection
    (to the last few bits of a float; the CDF is monotone, so bisection cannot miss).

    Example:
        ``t_quantile(0.975, df)`` is the factor of a two-sided 95 % interval — 12.706 with two seeds, 2.776 with
        five, tending to the normal's 1.960:

        >>> [round(t_quantile(0.975, df), 3) for df in (1, 4, 1e6)]
        [12.706, 2.776, 1.96]
    """
    if not 0.0 < q < 1.0:
        raise ValueError(f"q={q!r} is invalid; expected a probability strictly between 0 and 1")
    if not df > 0:
        raise ValueError(f"df={df!r} is invalid; expected a positive number")
    if q == 0.5:
        return 0.0
    if q < 0.5:  # symmetric
        return -t_quantile(1.0 - q, df)
    target = 2.0 * (1.0 - q)  # the two-sided tail beyond the quantile; it decreases as t grows
    lo, hi = 0.0, 1.0
    while _t_two_sided(hi, df) > target:
        lo, hi = hi, 2.0 * hi
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):  # adjacent floats
            break
        if _t_two_sided(mid, df) > target:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def _verdict(lo: float | None, hi: float | None) -> str:
    """``holds`` when the interval lies above 0, ``reversed`` when below, ``not shown`` when it holds 0 (or there is
    none)."""
    if lo is None or hi is None:
        return "not shown"
    return "holds" if lo > 0 else "reversed" if hi < 0 else "not shown"


def _rounding(xs: Sequence[float]) -> float:
    """What float rounding leaves in a difference of values of ``xs``' size: a spread below it is no spread (0.7 −
    0.6 and 0.8 − 0.7 are not equal as floats, but are the same gap)."""
    return 1e-12 * max((abs(x) for x in xs), default=0.0)


def paired_difference(a: Sequence[float], b: Sequence[float], confidence: float = CONFIDENCE) -> dict[str, Any]:
    """The mean of ``a[i] - b[i]`` over pairs (e.g. two methods' accuracies on the same seeds) with Student's t:
    its two-sided interval and the paired t-test's two-sided p (``scipy.stats.ttest_rel``'s).

    Args:
        a: one value per pair.
        b: the other side's value of each pair, in the same order.
        confidence: the interval's two-sided level.

    Returns:
        ``n`` (pairs), ``mean`` (of a − b), ``std`` (sample std of the differences; ``None`` with n < 2), ``df``
        (n − 1), ``t``, ``lo`` and ``hi`` (the interval; ``None`` with n < 2), ``p`` (``None`` with n < 2) and
        ``verdict``: ``"holds"`` when the interval lies above 0, ``"reversed"`` when below, ``"not shown"``
        otherwise and with n < 2.

        When all differences are equal (to float rounding) the spread is 0: the interval is the point itself and
        ``p`` is 0.0 where the difference is not 0 and 1.0 where it is (a difference within rounding of 0 counts as
        0); ``t`` is ±inf or 0.

    Example:
        Three seeds on which ``a`` beats ``b`` by 1, 2 and 3 points:

        >>> r = paired_difference([0.71, 0.72, 0.73], [0.70, 0.70, 0.70])
        >>> round(r["mean"], 6), round(r["lo"], 6), round(r["hi"], 6), round(r["p"], 4), r["verdict"]
        (0.02, -0.004841, 0.044841, 0.0742, 'not shown')
    """
    if len(a) != len(b):
        raise ValueError(f"a and b are invalid: {len(a)} and {len(b)} values; expected one pair per index")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence={confidence!r} is invalid; expected a level strictly between 0 and 1")
    d = [float(x) - float(y) for x, y in zip(a, b)]
    n = len(d)
    out: dict[str, Any] = {"n": n, "mean": math.fsum(d) / n if n else math.nan, "std": None, "df": n - 1, "t": None,
                           "lo": None, "hi": None, "p": None, "verdict": "not shown"}
    if n < 2:
        return out
    mean = out["mean"]
    std = math.sqrt(math.fsum((x - mean) ** 2 for x in d) / (n - 1))
    out["std"] = std
    tol = _rounding([*a, *b])
    if std <= tol:  # no spread: nothing to estimate it from, the gap is what it is
        mean = out["mean"] = 0.0 if abs(mean) <= tol else mean
        out["std"], out["lo"], out["hi"] = 0.0, mean, mean
        out["t"], out["p"] = (0.0, 1.0) if mean == 0 else (math.copysign(math.inf, mean), 0.0)
    else:
        se = std / math.sqrt(n)
        half = t_quantile(0.5 + confidence / 2, n - 1) * se
        out.update(t=mean / se, lo=mean - half, hi=mean + half, p=_t_two_sided(mean / se, n - 1))
    out["verdict"] = _verdict(out["lo"], out["hi"])
    return out


def welch_difference(a: Sequence[float], b: Sequence[float], confidence: float = CONFIDENCE) -> dict[str, Any]:
    """The difference of the means of two unpaired groups (e.g. two methods run on different seeds) with Welch's
    t: its two-sided interval on the Welch–Satterthwaite degrees of freedom and the two-sided p
    (``scipy.stats.ttest_ind(a, b, equal_var=False)``'s).

    Args:
        a: one group's values.
        b: the other group's values.
        confidence: the interval's two-sided level.

    Returns:
        ``n_a``, ``n_b``, ``mean`` (mean of a − mean of b), ``df``, ``t``, ``lo``, ``hi``, ``p`` and ``verdict`` as
        :func:`paired_difference`'s. With fewer than 2 values on either side there is no interval (``None``s) and the
        verdict is ``"not shown"``. When neither group varies (to float rounding) the interval is the point itself,
        ``df`` is nan and ``p`` is 0.0 or 1.0 as in :func:`paired_difference`.

    Example:
        >>> r = welch_difference([0.70, 0.72, 0.74], [0.60, 0.65, 0.61, 0.62])
        >>> round(r["mean"], 4), round(r["df"], 3), round(r["lo"], 4), round(r["hi"], 4), f"{r['p']:.2e}", r["verdict"]
        (0.1, 4.655, 0.0584, 0.1416, '1.89e-03', 'holds')
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence={confidence!r} is invalid; expected a level strictly between 0 and 1")
    xa, xb = [float(x) for x in a], [float(x) for x in b]
    na, nb = len(xa), len(xb)
    mean = (math.fsum(xa) / na if na else math.nan) - (math.fsum(xb) / nb if nb else math.nan)
    out: dict[str, Any] = {"n_a": na, "n_b": nb, "mean": mean, "df": None, "t": None, "lo": None, "hi": None,
                           "p": None, "verdict": "not shown"}
    if na < 2 or nb < 2:
        return out
    va, vb = (math.fsum((x - math.fsum(xs) / len(xs)) ** 2 for x in xs) / (len(xs) - 1) for xs in (xa, xb))
    tol = _rounding([*xa, *xb])
    if max(va, vb) <= tol * tol:
        mean = out["mean"] = 0.0 if abs(mean) <= tol else mean
        out.update(df=math.nan, lo=mean, hi=mean)
        out["t"], out["p"] = (0.0, 1.0) if mean == 0 else (math.copysign(math.inf, mean), 0.0)
    else:
        sa, sb = va / na, vb / nb
        df = (sa + sb) ** 2 / (sa ** 2 / (na - 1) + sb ** 2 / (nb - 1))
        se = math.sqrt(sa + sb)
        half = t_quantile(0.5 + confidence / 2, df) * se
        out.update(df=df, t=mean / se, lo=mean - half, hi=mean + half, p=_t_two_sided(mean / se, df))
    out["verdict"] = _verdict(out["lo"], out["hi"])
    return out
