"""The studies' error bars and tests: seeds and Monte-Carlo draws combined, and comparisons over
independently trained seeds stated with a test and its p-value.

Each family is trained with N seeds (the seed sets the initialisation, the data order and the noise
draws of training); each trained model's bound is estimated on the same validation rows with K
Monte-Carlo draws per row (AR: exact, K = 1), giving a value ``x_s`` and its Monte-Carlo standard
error ``mc_s`` (std over the K draws / sqrt(K)).

Per family (`family_summary`):

- ``mean`` = mean over seeds of ``x_s``;
- ``seed_sd`` = sample standard deviation of the ``x_s`` (N - 1 in the denominator; 0 for one seed);
- ``mc_se`` = Monte-Carlo s.e. of the mean, sqrt(sum_s mc_s^2) / N;
- ``se`` = the combined standard error of the mean, sqrt(seed_sd^2 / N + mc_se^2).

``seed_sd^2 / N`` is the usual standard error of a mean over seeds; the spread of the ``x_s`` already
contains their Monte-Carlo noise, so adding ``mc_se^2`` counts it twice. We add it anyway: it is a
conservative (wider) error bar, and with three seeds ``seed_sd`` is itself a rough estimate that can
come out small by chance, which the Monte-Carlo term keeps from hiding.

An ordering "A < B" (`ordering`) is **held** when the difference of the means, d = mean_B - mean_A, is
more than ``Z`` = 2 combined standard errors of the difference, sqrt(se_A^2 + se_B^2) (families
trained independently); **reversed** when d < -Z sigma; **not resolved** otherwise.

`welch` is the test the paper in miniature states its comparisons with (benchmarks/miniature_claims.py):
Welch's unequal-variance t-test on the per-seed values of two independently trained groups, with the
Welch-Satterthwaite degrees of freedom (a z at 2 standard errors is anti-conservative with 3 seeds:
z = 2.02 is p = 0.18 at 2 degrees of freedom), two-sided; `one_sample_t` tests per-seed values (a
paired difference, a log ratio) against 0 with N - 1 degrees of freedom.
"""

from __future__ import annotations

import math

Z = 2.0  # standard errors of a difference for an ordering to count as held (about 95 %)


def family_summary(values: list[float], mc_ses: list[float]) -> dict:
    """Mean over seeds, seed std, Monte-Carlo s.e. of the mean and the combined s.e. (module docstring)."""
    n = len(values)
    if n == 0 or len(mc_ses) != n:
        raise ValueError(f"family_summary: {n} values and {len(mc_ses)} Monte-Carlo errors")
    mean = sum(values) / n
    seed_sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    mc_se = math.sqrt(sum(e * e for e in mc_ses)) / n
    return {"mean": mean, "seed_sd": seed_sd, "mc_se": mc_se, "se": math.sqrt(seed_sd ** 2 / n + mc_se ** 2),
            "seeds": n}


def ordering(a: str, b: str, fams: dict) -> dict:
    """Whether "a < b" holds at the combined error; `fams` maps a family to its `family_summary`."""
    return difference(fams[b], fams[a], f"{a} < {b}", against="reversed")


def difference(larger: dict, smaller: dict, claim: str, against: str) -> dict:
    """The claim "`larger` exceeds `smaller`" from two summaries (mean, se): the difference, its sigma, z
    and the verdict at Z standard errors: held, `against` (Z the other way) or not resolved."""
    d = larger["mean"] - smaller["mean"]
    sigma = math.hypot(larger["se"], smaller["se"])
    verdict = "held" if d > Z * sigma else against if d < -Z * sigma else "not resolved"
    z = d / sigma if sigma > 0 else math.copysign(math.inf, d) if d else 0.0
    return {"claim": claim, "difference": d, "sigma": sigma, "z": z, "verdict": verdict}


def welch(a: list[float], b: list[float]) -> dict:
    """Welch's two-sided t-test of mean(a) - mean(b) over per-seed values: t, degrees of freedom, p and the
    difference's 95% confidence interval (scipy.stats). Two groups without spread: p is 0 or 1 by the
    difference (no test can run)."""
    from scipy import stats

    if len(a) < 2 or len(b) < 2:
        raise ValueError(f"welch: each group needs 2 or more seeds (got {len(a)} and {len(b)})")
    d = sum(a) / len(a) - sum(b) / len(b)
    va, vb = (stats.tvar(x) / len(x) for x in (a, b))
    se = math.sqrt(va + vb)
    if se == 0.0:
        return {"test": "Welch's t-test (two-sided)", "t": math.copysign(math.inf, d) if d else 0.0, "df": None,
                "p": 0.0 if d else 1.0, "difference": d, "se": 0.0, "ci95": [d, d]}
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    t = d / se
    half = float(stats.t.ppf(0.975, df)) * se
    return {"test": "Welch's t-test (two-sided)", "t": t, "df": df, "p": float(2 * stats.t.sf(abs(t), df)),
            "difference": d, "se": se, "ci95": [d - half, d + half]}


def one_sample_t(values: list[float]) -> dict:
    """Two-sided t-test of mean(values) against 0 with N - 1 degrees of freedom (scipy.stats)."""
    from scipy import stats

    n = len(values)
    if n < 2:
        raise ValueError(f"one_sample_t: needs 2 or more seeds (got {n})")
    m = sum(values) / n
    se = math.sqrt(stats.tvar(values) / n)
    if se == 0.0:
        return {"test": "one-sample t-test against 0 (two-sided)", "t": math.copysign(math.inf, m) if m else 0.0,
                "df": n - 1, "p": 0.0 if m else 1.0, "difference": m, "se": 0.0, "ci95": [m, m]}
    t = m / se
    half = float(stats.t.ppf(0.975, n - 1)) * se
    return {"test": "one-sample t-test against 0 (two-sided)", "t": t, "df": n - 1,
            "p": float(2 * stats.t.sf(abs(t), n - 1)), "difference": m, "se": se, "ci95": [m - half, m + half]}
