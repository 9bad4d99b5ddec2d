"""A slow, independent NumPy reference for the adjacent-layer coverage criteria of Sun et
al. (2019), "Structural test coverage criteria for deep neural networks": sign-sign,
value-sign, sign-value and value-value coverage.

Written straight from the definitions, with explicit Python loops over every pair of
inputs seen and every neuron; nothing here imports jaxslice. For adjacent layers L_k,
L_k+1, neuron values φ(x, n) and two distinct inputs x1, x2::

    sign(x, n)      = φ(x, n) > 0                      (0 and NaN count as inactive)
    sc(n; x1, x2)   = sign(x1, n) != sign(x2, n)
    vc_r(n; x1, x2) = not sc(n) and a != b and max(|a|, |b|) >= r * min(|a|, |b|)
                      with a, b = φ(x1, n), φ(x2, n)   (any comparison with NaN is false)
    nsc(S; x1, x2)  = no neuron of S has sc

    SignSign   (n1, n2): sc(n1)   and nsc(L_k minus n1) and sc(n2)
    ValueSign  (n1, n2): vc_r(n1) and nsc(L_k)          and sc(n2)
    SignValue  (n1, n2): sc(n1)   and nsc(L_k minus n1) and vc_r(n2)
    ValueValue (n1, n2): vc_r(n1) and nsc(L_k)          and vc_r(n2)

A pair (n1 in L_k, n2 in L_k+1) is covered when some two distinct inputs satisfy it.

Random data go through a margin check (`check=True`): the reference refuses data in which
some decision (a value vs 0, a vs b, max(|a|, |b|) vs r·min(|a|, |b|)) lies within rounding
distance of its edge, so that the tracker's float32 arithmetic can never disagree with this
float64 one; exact edges are tested on purpose with exactly representable values (and
``check=False``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import Counter

import numpy as np
import pytest

MARGIN = 1e-5  # decisions closer than this (relative to the values' size) are refused

#: criterion name -> (condition on n1 in L_k, condition on n2 in L_k+1)
KINDS = {
    "SignSign": ("sign", "sign"),
    "ValueSign": ("value", "sign"),
    "SignValue": ("sign", "value"),
    "ValueValue": ("value", "value"),
}


@dataclasses.dataclass(frozen=True)
class Spec:
    """One criterion as the reference sees it: its class name and settings."""

    kind: str  # a key of KINDS
    ratio: float | None = None  # None for SignSign
    capacity: int = 4096

    def settings_name(self) -> str:
        """The name with settings, used when several criteria share a class name."""
        if self.kind == "SignSign":
            return f"SignSign(capacity={self.capacity})"
        return f"{self.kind}(ratio={float(self.ratio)}, capacity={self.capacity})"


# =========================================================================== neuron values


def neurons(out: np.ndarray, granularity: str) -> np.ndarray:
    """(inputs, neurons) from a layer output (batch first): a 1-D output is one neuron; with
    "channel" the mean over every axis but batch and the last; with "element" each element."""
    out = np.asarray(out, np.float32).astype(np.float64)
    if out.ndim == 1:
        return out[:, None]
    if granularity == "channel":
        if out.ndim == 2:
            return out
        return out.mean(axis=tuple(range(1, out.ndim - 1)))
    assert granularity == "element", granularity
    return out.reshape(out.shape[0], -1)


def nc_values(out: np.ndarray, granularity: str) -> np.ndarray:
    """DeepXplore: each input's whole layer output min-max scaled to [0, 1], then per neuron."""
    out = np.asarray(out, np.float32).astype(np.float64)
    rows = []
    for x in out:  # one input at a time, as in DeepXplore's `update_coverage`
        lo, hi = x.min(), x.max()
        s = (x - lo) / (hi - lo) if hi > lo else np.zeros_like(x)
        rows.append(neurons(s[None], granularity)[0])
    return np.stack(rows)


# =========================================================================== definitions


def sign(v: float) -> bool:
    """Active when strictly positive; 0 and NaN are inactive (NaN > 0 is false)."""
    return bool(v > 0)


def sc(a: float, b: float) -> bool:
    return sign(a) != sign(b)


def vc(a: float, b: float, r: float) -> bool:
    """A value change without a sign change, by a factor of at least r."""
    if math.isnan(a) or math.isnan(b):
        return False  # every comparison with NaN is false
    if sc(a, b):
        return False
    if not a != b:
        return False
    big, small = max(abs(a), abs(b)), min(abs(a), abs(b))
    return big >= r * small


def changed(kind: str, a: float, b: float, r: float | None) -> bool:
    return sc(a, b) if kind == "sign" else vc(a, b, r)


def ref_pairs(kind1: str, kind2: str, v1: np.ndarray, v2: np.ndarray, ratio=None, check=True):
    """(N1, N2) bool: the pairs (n1 of L_k, n2 of L_k+1) covered by some two distinct inputs.

    v1, v2: (inputs, N1) and (inputs, N2) neuron values of L_k and L_k+1, one row per input
    seen, in any order. kind1, kind2: "sign" or "value" (what n1, n2 must do).
    """
    v1, v2 = np.asarray(v1, np.float64), np.asarray(v2, np.float64)
    assert v1.shape[0] == v2.shape[0]
    if check:
        guard(v1, ratio)
        guard(v2, ratio)
    n1s, n2s = v1.shape[1], v2.shape[1]
    cov = np.zeros((n1s, n2s), bool)
    for i, j in itertools.combinations(range(v1.shape[0]), 2):
        flips = [n for n in range(n1s) if sc(v1[i, n], v1[j, n])]
        for n1 in range(n1s):
            if kind1 == "sign":
                # n1 changes sign and every other neuron of L_k keeps its sign
                ok = sc(v1[i, n1], v1[j, n1]) and flips == [n1]
            else:
                # n1 changes value (no sign change) and no neuron of L_k changes sign
                ok = vc(v1[i, n1], v1[j, n1], ratio) and flips == []
            if not ok:
                continue
            for n2 in range(n2s):
                if changed(kind2, v2[i, n2], v2[j, n2], ratio):
                    cov[n1, n2] = True
    return cov


def ref_result(specs, layers, outs, granularity="channel", check=True):
    """The expected `Tracker.result()` for `specs` (a list of `Spec`), `layers` in call order
    and `outs` = {layer: output of every input seen, batch first}."""
    values = {n: neurons(outs[n], granularity) for n in layers}
    counts = Counter(s.kind for s in specs)
    result = {}
    for spec in specs:
        name = spec.settings_name() if counts[spec.kind] > 1 else spec.kind
        kind1, kind2 = KINDS[spec.kind]
        per_key, covered, total = {}, 0, 0
        for a, b in zip(layers[:-1], layers[1:], strict=True):
            cov = ref_pairs(kind1, kind2, values[a], values[b], spec.ratio, check)
            per_key[f"{a} -> {b}"] = int(cov.sum()) / cov.size
            covered += int(cov.sum())
            total += cov.size
        result[name] = {"total": covered / total if total else 0.0, "layers": per_key}
    return result


# =========================================================================== margin guard


def guard(v: np.ndarray, ratio: float | None) -> None:
    """Refuses neuron values (inputs, N) where a decision is within rounding of its edge."""
    for n in range(v.shape[1]):
        col = v[:, n]
        for x in col:
            _clear(x, 0.0, 1.0, "a value vs 0")
        for a, b in itertools.combinations(col, 2):
            if sc(a, b) or math.isnan(a) or math.isnan(b):
                continue  # the value conditions are not looked at
            # (with r = 1 this is also a != b: for values of one sign, or 0, max - min = |a - b|;
            # with r > 1, a != b follows from max >= r·min unless a = b = 0)
            big, small = max(abs(a), abs(b)), min(abs(a), abs(b))
            if ratio is not None:
                _clear(big, ratio * small, big, f"max(|a|, |b|) vs {ratio}·min(|a|, |b|)")


def _clear(x: float, edge: float, scale: float, what: str) -> None:
    """`x` is exactly at `edge` or clearly away from it (exact equality is fine)."""
    d = abs(x - edge)
    assert not (0 < d < MARGIN * max(1.0, abs(scale))), (
        f"reference: {what} ({x!r} vs {edge!r}) is too close to its edge for a float32 "
        "comparison; pick other test data"
    )


def assert_result(actual, expected):
    """A tracker's result as the reference's: same criteria, same keys in the same order,
    identical fractions."""
    assert list(actual) == list(expected)
    for name in expected:
        assert isinstance(actual[name]["total"], float), name
        assert list(actual[name]["layers"]) == list(expected[name]["layers"]), name
        got = {"total": actual[name]["total"], **actual[name]["layers"]}
        want = {"total": expected[name]["total"], **expected[name]["layers"]}
        assert got == pytest.approx(want, abs=1e-12), name
