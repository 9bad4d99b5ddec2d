"""`js.coverage.Tracker` checked against a slow, independent NumPy reference.

The reference below re-implements every criterion from its published definition
(DeepXplore NC, DeepGauge KMNC/NBC/SNAC/TKNC, Sun et al. sign-sign coverage) as stated in
SPEC.md, with explicit Python loops over inputs, pairs of inputs and neurons. Layer outputs
for the reference come from Flax's ``capture_intermediates`` (or, for plain functions,
from hand-written math), never from jaxslice.

Random cases carry a margin check: the reference refuses inputs for which some decision
(value vs threshold, bound or section edge) lies within rounding distance of its edge, so
float32-vs-float64 differences can never make these tests flaky; exact equalities are
tested on purpose with exactly representable values in the edge-case tests.
"""

from __future__ import annotations

import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxslice as js

from helpers.coverage_reference import assert_result, nc_values, neurons
from helpers.models import (
    SCAN_LAYERS,
    CoverageCNN,
    CoverageMLP,
    ScannedModel,
    ScanUnrolled,
    TinyResNet,
    scan_unrolled_params,
)
from helpers.oracles import captured, count_compiles, random_variables

C = js.coverage
MARGIN = 1e-5  # decisions closer than this to their edge are rejected by the reference


# =========================================================================== reference


def _clear(a, b, what, margin=MARGIN):
    """No decision `a` vs `b` is within rounding distance (exact equality is fine)."""
    d = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
    bad = (d > 0) & (d < margin)
    assert not bad.any(), (
        f"reference: {what} too close to its edge for a float32 comparison; pick another seed"
    )


def ref_nc(scaled: np.ndarray, t: float) -> np.ndarray:
    _clear(scaled, t, "NC scaled value")
    cov = np.zeros(scaled.shape[1], bool)
    for x in scaled:
        for n, v in enumerate(x):
            if v > t:
                cov[n] = True
    return cov


def _slack(lo, hi):
    """How far past a profile bound a value may lie and still count as at it: 2^-17 of the
    neuron's larger bound magnitude (the documented tolerance for batch-size rounding)."""
    return 2.0**-17 * max(abs(float(lo)), abs(float(hi)))


def _near(slack):
    """Rounding distance from a widened bound: a value at the bound itself lies `slack`
    from it, which may be less than MARGIN but is far more than rounding."""
    return np.where(np.asarray(slack) > 0, np.minimum(MARGIN, np.asarray(slack) / 2), MARGIN)


def ref_kmnc(values: np.ndarray, low: np.ndarray, high: np.ndarray, k: int) -> np.ndarray:
    """(neurons, k) covered sections: [low, high] in k equal sections, high in the last; a
    value within the slack past a bound counts in that end's section."""
    cov = np.zeros((values.shape[1], k), bool)
    for n in range(values.shape[1]):
        lo, hi = low[n], high[n]
        slack = _slack(lo, hi)
        edges = [lo + (hi - lo) * i / k for i in range(k + 1)]
        for v in values[:, n]:
            _clear(v, [lo - slack, hi + slack], "KMNC value vs bound", _near(slack))
            if v < lo - slack or v > hi + slack:
                continue  # outside the profiled range: no section
            if hi == lo:  # zero-range neuron: its single value is in the last section
                cov[n, k - 1] = True
                continue
            v = min(max(v, lo), hi)
            _clear(v, edges[1:-1], "KMNC value vs section edge")
            for i in range(k):
                last = i == k - 1
                if edges[i] <= v < edges[i + 1] or (last and v == hi):
                    cov[n, i] = True
                    break
    return cov


def ref_upper_lower(values, low, high):
    slack = np.array([_slack(lo, hi) for lo, hi in zip(low, high, strict=True)])
    _clear(values, (high + slack)[None], "value vs high", _near(slack)[None])
    _clear(values, (low - slack)[None], "value vs low", _near(slack)[None])
    upper = np.array([any(v > high[n] + slack[n] for v in values[:, n]) for n in range(len(slack))])
    lower = np.array([any(v < low[n] - slack[n] for v in values[:, n]) for n in range(len(slack))])
    return upper, lower


def ref_tknc(values: np.ndarray, k: int) -> np.ndarray:
    cov = np.zeros(values.shape[1], bool)
    for x in values:
        kth = np.sort(x)[::-1][min(k, len(x)) - 1]
        _clear(x, kth, "TKNC value vs k-th largest")
        for n, v in enumerate(x):
            if v >= kth:  # ties inclusive
                cov[n] = True
    return cov


def ref_signsign(v1: np.ndarray, v2: np.ndarray) -> np.ndarray:
    """(|L1|, |L2|) pairs covered over every pair of inputs seen (Sun et al. 2019)."""
    _clear(v1, 0.0, "sign-sign value vs 0")
    _clear(v2, 0.0, "sign-sign value vs 0")
    s1, s2 = v1 > 0, v2 > 0
    cov = np.zeros((v1.shape[1], v2.shape[1]), bool)
    for a, b in itertools.combinations(range(v1.shape[0]), 2):
        flipped = [n for n in range(v1.shape[1]) if s1[a, n] != s1[b, n]]
        if len(flipped) != 1:  # exactly one neuron of layer k changes sign, all others keep it
            continue
        for m in range(v2.shape[1]):
            if s2[a, m] != s2[b, m]:
                cov[flipped[0], m] = True
    return cov


def reference(criteria, layers, profile_outs, update_outs, granularity="channel"):
    """The expected `Tracker.result()` for raw layer outputs given as {layer: array}."""
    vals = {n: neurons(update_outs[n], granularity) for n in layers}
    prof = {n: neurons(profile_outs[n], granularity) for n in layers} if profile_outs else None
    low = {n: prof[n].min(0) for n in layers} if prof else None
    high = {n: prof[n].max(0) for n in layers} if prof else None
    result = {}
    for crit in criteria:
        name = type(crit).__name__
        if isinstance(crit, C.SignSign):
            keys = [f"{a} -> {b}" for a, b in zip(layers[:-1], layers[1:], strict=True)]
            counts = []
            for a, b in zip(layers[:-1], layers[1:], strict=True):
                cov = ref_signsign(vals[a], vals[b])
                counts.append((int(cov.sum()), cov.size))
        else:
            keys = list(layers)
            counts = []
            for n in layers:
                if isinstance(crit, C.NC):
                    cov = ref_nc(nc_values(update_outs[n], granularity), crit.threshold)
                elif isinstance(crit, C.KMNC):
                    cov = ref_kmnc(vals[n], low[n], high[n], crit.k)
                elif isinstance(crit, C.NBC):
                    cov = np.concatenate(ref_upper_lower(vals[n], low[n], high[n]))
                elif isinstance(crit, C.SNAC):
                    cov = ref_upper_lower(vals[n], low[n], high[n])[0]
                elif isinstance(crit, C.TKNC):
                    cov = ref_tknc(vals[n], crit.k)
                else:
                    raise AssertionError(crit)
                counts.append((int(cov.sum()), cov.size))
        total = sum(c for c, _ in counts) / sum(t for _, t in counts)
        result[name] = {
            "total": total,
            "layers": {k: c / t for k, (c, t) in zip(keys, counts, strict=True)},
        }
    return result


def capture(model, variables, x):
    """{module path: output} of every submodule call, from Flax's capture_intermediates."""
    return {name: np.asarray(v[0]) for name, v in captured(model, variables, x).items() if name}


def not_trivial(expected, names):
    """The test data exercise each criterion: coverage strictly between 0 and 1."""
    for name in names:
        assert 0.0 < expected[name]["total"] < 1.0, (
            f"test data make {name} trivial: {expected[name]}"
        )


# =========================================================================== models and data


MLP, CNN = CoverageMLP, CoverageCNN


def rand(seed, shape, scale=1.0, offset=0.0):
    """Normal noise, plus (with `offset`) a random shift per input so channel means vary."""
    rng = np.random.default_rng(seed)
    x = (
        rng.normal(size=shape) * scale
        + rng.normal(size=(shape[0],) + (1,) * (len(shape) - 1)) * offset
    )
    return jnp.asarray(x, jnp.float32)


ALL6 = lambda: [C.NC(0.75), C.KMNC(6), C.NBC(), C.SNAC(), C.TKNC(2), C.SignSign(capacity=64)]  # noqa: E731


class Data:
    """A model, its variables, profiling batches and test batches, with Flax's captures.

    Every batch has the same size, so each compiled step is compiled once; the oracle's
    layer outputs come from one ``capture_intermediates`` call over all rows.
    """

    def __init__(self, model, x, prof, test, seed):
        self.model, self.x, self.prof, self.test = model, x, prof, test
        self.variables = random_variables(model, x, seed=seed)
        allx = jnp.concatenate(prof + [test])
        cap = capture(model, self.variables, allx)
        n = sum(len(p) for p in prof)
        self.prof_outs = {k: v[:n] for k, v in cap.items()}
        self.test_outs = {k: v[n:] for k, v in cap.items()}


@pytest.fixture(scope="module")
def mlp():
    # profile: two batches of 8; test: 8 inputs of a wider distribution, some leave the profile
    return Data(
        MLP(), rand(0, (4, 3)), [rand(1, (8, 3)), rand(2, (8, 3))], rand(3, (8, 3), 1.6), seed=0
    )


@pytest.fixture(scope="module")
def mlp_tracker(mlp):
    t = C.Tracker(mlp.model, mlp.variables, mlp.x, criteria=ALL6())
    t.profile(mlp.prof)
    return t


@pytest.fixture(scope="module")
def cnn():
    prof, test = rand(11, (12, 5, 5, 2), offset=1.0), rand(12, (12, 5, 5, 2), 1.5, offset=1.5)
    return Data(CNN(), rand(10, (2, 5, 5, 2)), [prof], test, seed=1)


# =========================================================================== against the reference


def test_mlp_all_criteria_match_reference(mlp, mlp_tracker):
    t = mlp_tracker
    t.reset()
    t.update(mlp.test[:4])
    t.update(mlp.test[4:])
    assert t.layers == ["fc1", "fc2", "head"]
    expected = reference(ALL6(), t.layers, mlp.prof_outs, mlp.test_outs)
    not_trivial(expected, ["NC", "KMNC", "NBC", "SNAC", "TKNC", "SignSign"])
    assert_result(t.result(), expected)


@pytest.mark.parametrize("granularity", ["channel", "element"])
def test_cnn_matches_reference(cnn, granularity):
    crits = ALL6()
    t = C.Tracker(cnn.model, cnn.variables, cnn.x, criteria=crits, granularity=granularity)
    assert t.layers == ["conv1", "conv2", "head"]
    assert t.sizes == {"channel": [3, 4, 3], "element": [5 * 5 * 3, 3 * 3 * 4, 3]}[granularity]
    t.profile(cnn.prof)
    t.update(cnn.test)
    expected = reference(crits, t.layers, cnn.prof_outs, cnn.test_outs, granularity)
    # element granularity: dozens of neurons per layer, so no input pair flips exactly one
    not_trivial(
        expected, ["NC", "KMNC", "TKNC"] + (["SignSign"] if granularity == "channel" else [])
    )
    assert_result(t.result(), expected)


def test_total_counts_all_neurons_together(mlp, mlp_tracker):
    """`total` is covered / all neurons of all layers, not a mean of the per-layer figures."""
    t = mlp_tracker
    t.reset()
    t.update(mlp.test[:4])
    r = t.result()
    sizes = {"fc1": 6, "fc2": 5, "head": 3}
    for name, k in [("NC", 1), ("TKNC", 1), ("SNAC", 1), ("KMNC", 6), ("NBC", 2)]:
        covered = sum(r[name]["layers"][n] * sizes[n] * k for n in sizes)
        assert r[name]["total"] == pytest.approx(covered / (k * sum(sizes.values())))
    pairs = {"fc1 -> fc2": 30, "fc2 -> head": 15}
    covered = sum(r["SignSign"]["layers"][p] * n for p, n in pairs.items())
    assert r["SignSign"]["total"] == pytest.approx(covered / 45)
    per_layer = [r["NC"]["layers"][n] for n in sizes]
    if len(set(per_layer)) > 1:
        assert r["NC"]["total"] != pytest.approx(sum(per_layer) / len(per_layer))


def test_position_activation_observes_relu_outputs(mlp):
    """`position="activation"` sees relu(fc1), tanh(fc2), and the bare head as it is."""
    crits = [C.NC(0.3), C.KMNC(3), C.TKNC(2), C.SignSign(capacity=64)]
    t = C.Tracker(mlp.model, mlp.variables, mlp.x, criteria=crits, position="activation")
    t.profile(mlp.prof)
    t.update(mlp.test)

    def acts(cap):
        return {
            "fc1": np.maximum(cap["fc1"], 0),
            "fc2": np.asarray(jnp.tanh(cap["fc2"])),
            "head": cap["head"],
        }

    p_outs, u_outs = acts(mlp.prof_outs), acts(mlp.test_outs)
    expected = reference(crits, t.layers, p_outs, u_outs)
    assert (u_outs["fc1"] == 0).any()  # relu zeros change NC scaling and KMNC sections
    assert_result(t.result(), expected)
    stats = t.profile_stats["fc1"]
    np.testing.assert_allclose(np.asarray(stats["low"]), p_outs["fc1"].min(0), atol=1e-6)


def test_profile_stats_stream(mlp, mlp_tracker):
    """Per-neuron low/high/mean/std over several profiling batches equal one pass over all."""
    allx = mlp.prof_outs["fc2"].astype(np.float64)
    s = mlp_tracker.profile_stats["fc2"]
    np.testing.assert_allclose(np.asarray(s["low"]), allx.min(0), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(s["high"]), allx.max(0), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(s["mean"]), allx.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(s["std"]), allx.std(0), rtol=1e-4, atol=1e-6)


# =========================================================================== order independence


def test_order_and_batching_do_not_matter(mlp, mlp_tracker):
    a, b = mlp.test[:4], mlp.test[4:]
    t = mlp_tracker
    results = []
    for batches in ([a, b], [jnp.concatenate([a, b])], [b, a], [a, b, a]):
        t.reset()
        for batch in batches:
            t.update(batch)
        results.append(t.result())
    for r in results[1:]:
        assert_result(r, results[0])
    assert 0 < results[0]["SignSign"]["total"] < 1


def test_reset_forgets_coverage_keeps_profile(mlp, mlp_tracker):
    t = mlp_tracker
    t.update(mlp.test[:4])
    t.reset()
    r = t.result()  # still profiled: no error
    assert all(r[name]["total"] == 0.0 for name in r)


# =========================================================================== exact edge cases

layer_a = js.mark("a", lambda p, x: x * p)  # times ones: exactly the input
layer_b = js.mark("b", lambda p, x: x * p)
layer_c = js.mark("c", lambda p, x: x * p)


def three_layers(p, x):
    """Layers a (3 neurons), b (2) and c (4) read disjoint columns of x, exactly."""
    a = layer_a(p["a"], x[:, 0:3])
    b = layer_b(p["b"], x[:, 3:5])
    c = layer_c(p["c"], x[:, 5:9])
    return a.sum(-1) + b.sum(-1) + c.sum(-1)


P3 = {"a": jnp.ones(3), "b": jnp.ones(2), "c": jnp.ones(4)}
TK = [1, 2, 3, 4, 9]


def row(a=(0, 0, 0), b=(0, 0), c=(0, 0, 0, 0)):
    return np.array([*a, *b, *c], np.float32)


def batch(*rows):
    return jnp.asarray(np.stack(rows))


@pytest.fixture(scope="module")
def t3():
    """Every criterion on the three exact layers, profiled so that on layer a neuron 0
    spans [0, 1], neuron 1 spans [-2, 2] and neuron 2 is constant 3 (zero range)."""
    crits = [C.NC(0.5), C.KMNC(4), C.NBC(), C.SNAC(), *[C.TKNC(k) for k in TK], C.SignSign()]
    t = C.Tracker(three_layers, P3, batch(row()), criteria=crits, layers=["a", "b", "c"])
    t.profile([batch(row(a=(0, -2, 3)), row(a=(1, 2, 3)))])
    return t


def test_nc_value_exactly_at_threshold_does_not_cover(t3):
    t3.reset()
    nc = lambda: t3.result()["NC"]["layers"]["a"]  # noqa: E731
    t3.update(batch(row(a=(2, 2, 2))))  # constant output: scales to 0 everywhere
    assert nc() == 0.0
    t3.update(batch(row(a=(0, 0.5, 1))))  # scaled over the whole layer output (b, c are not
    assert nc() == pytest.approx(1 / 3)  # part of it): 0, 0.5, 1 — 0.5 is not > 0.5
    t3.update(batch(row(a=(-4, 1, 6))))  # scaled 0, 0.5, 1: still not
    assert nc() == pytest.approx(1 / 3)
    t3.update(batch(row(a=(-4, 1.5, 6))))  # 0.55
    assert nc() == pytest.approx(2 / 3)


def test_nc_scaling_is_over_the_whole_layer_then_channel_mean():
    """DeepXplore scales by the min/max of the whole output, not per channel."""
    layer = js.mark("conv", lambda p, x: x * p)

    def f(p, x):
        return layer(p, x).sum()

    x = np.zeros((1, 2, 1, 2), np.float32)  # (batch, h, w, channels=2)
    x[0, :, 0, 0] = [0.0, 1.0]  # channel 0 spans [0, 1] of the layer's [0, 10]
    x[0, :, 0, 1] = [6.0, 10.0]  # channel 1: scaled 0.6 and 1.0
    t = C.Tracker(f, jnp.ones(()), jnp.asarray(x), criteria=[C.NC(0.5), C.NC(0.1)], layers=["conv"])
    t.update(jnp.asarray(x))
    r = t.result()
    assert list(r) == ["NC(threshold=0.5)", "NC(threshold=0.1)"]
    # whole-layer scaling: channel means 0.05 and 0.8 -> one of two channels for both
    # thresholds (per-channel scaling would give means 0.5 and 0.5: 0 and 2 of 2)
    assert r["NC(threshold=0.5)"]["total"] == pytest.approx(1 / 2)
    assert r["NC(threshold=0.1)"]["total"] == pytest.approx(1 / 2)


def test_kmnc_nbc_snac_at_and_beyond_bounds(t3):
    t3.reset()

    def figures():
        r = t3.result()
        return r["KMNC"]["layers"]["a"], r["NBC"]["layers"]["a"], r["SNAC"]["layers"]["a"]

    t3.update(batch(row(a=(1, 2, 3))))  # every value at its high: last section each
    assert figures() == pytest.approx((3 / 12, 0, 0))  # at a bound is not beyond it
    t3.update(batch(row(a=(0, -2, 3))))  # at low: first section (neuron 2: again its last)
    assert figures() == pytest.approx((5 / 12, 0, 0))
    t3.update(batch(row(a=(0.25, -0.0001, 3))))  # sections 1 of [0, 1] and 1 of [-2, 2]
    assert figures() == pytest.approx((7 / 12, 0, 0))
    t3.update(batch(row(a=(0.5, 0.0, 3))))  # section edges belong to the upper section
    assert figures() == pytest.approx((9 / 12, 0, 0))
    t3.update(batch(row(a=(1.5, -2.5, 3.5))))  # outside: no section; two above, one below
    assert figures() == pytest.approx((9 / 12, 3 / 6, 2 / 3))
    t3.update(batch(row(a=(-0.5, 0.0, 2.5))))  # two more below
    assert figures() == pytest.approx((9 / 12, 5 / 6, 2 / 3))


def test_tknc_ties_are_inclusive(t3):
    t3.reset()
    t3.update(batch(row(c=(1, 3, 3, 2))))
    r = t3.result()
    names = [f"TKNC(k={k})" for k in TK]
    assert [n for n in r if n.startswith("TKNC")] == names  # the same criterion twice: told apart
    got = [r[n]["layers"]["c"] for n in names]
    assert got == pytest.approx([2 / 4, 2 / 4, 3 / 4, 1.0, 1.0])


def test_signsign_pairs_exactly(t3):
    """Known covered pairs; the inputs that make them come in different batches."""
    t3.reset()
    x1 = row(a=(1, 1, 1), b=(1, 1), c=(1, 1, 1, 1))
    x2 = row(a=(-1, 1, 1), b=(-1, 1), c=(-1, -1, 1, 1))
    x3 = row(a=(-1, -1, 1), b=(-1, -1), c=(-1, -1, -1, 1))
    x4 = row(a=(5, 5, 5), b=(7, 7), c=(-1, -1, 1, 1))  # x1's signs in a and b, x2's in c
    t3.update(batch(x1))
    t3.update(batch(x3))  # x1/x3: a0, a1 flip -> no (a, b) pair; b0, b1 flip -> no (b, c) pair
    assert t3.result()["SignSign"]["total"] == 0.0
    t3.update(batch(x2, x4))
    r = t3.result()["SignSign"]
    # a -> b: x1/x2: a0 alone flips, b0 flips -> (a0, b0); x2/x3: a1 alone, b1 -> (a1, b1);
    #         x4/x2 gives (a0, b0) again -> 2 of 3·2
    # b -> c: x1/x2: b0 alone flips, c0 and c1 flip -> (b0, c0), (b0, c1); x2/x3: b1 alone,
    #         c2 flips -> (b1, c2); x4/x2: b0 alone but no c flips -> 3 of 2·4
    assert list(r["layers"]) == ["a -> b", "b -> c"]
    assert r["layers"]["a -> b"] == pytest.approx(2 / 6)
    assert r["layers"]["b -> c"] == pytest.approx(3 / 8)
    assert r["total"] == pytest.approx(5 / 14)  # denominator Σ |L_k|·|L_k+1| = 6 + 8
    allx = np.stack([x1, x3, x2, x4])
    ref = reference(
        [C.SignSign()],
        ["a", "b", "c"],
        None,
        {"a": allx[:, :3], "b": allx[:, 3:5], "c": allx[:, 5:]},
    )
    assert r == ref["SignSign"]


def test_signsign_layers_in_call_order():
    """Keys are adjacent pairs "in call order" (docstring), whatever order `layers` lists."""
    t = C.Tracker(three_layers, P3, batch(row()), criteria=[C.SignSign()], layers=["b", "a", "c"])
    assert list(t.result()["SignSign"]["layers"]) == ["a -> b", "b -> c"]


def test_signsign_capacity_is_enforced():
    """Past `capacity` inputs the docstring promises a SliceError, never a wrong figure."""
    t = C.Tracker(
        three_layers, P3, batch(row()), criteria=[C.SignSign(capacity=2)], layers=["a", "b"]
    )
    x1 = row(a=(1, 1, 1), b=(1, 1))
    x2 = row(a=(-1, 1, 1), b=(-1, 1))
    x3 = row(a=(-1, -1, 1), b=(-1, -1))
    x4 = row(a=(5, 5, 5), b=(7, 7))
    t.update(batch(x1))  # no profile needed for sign-sign
    t.update(batch(x3))  # 2 inputs: at capacity
    with pytest.raises(js.SliceError):
        t.update(batch(x4))  # a third input must be refused ...
        t.update(batch(x2))
        # ... or, if kept, x2 must still be compared with x1 -> (a0, b0) and x3 -> (a1, b1)
        assert t.result()["SignSign"]["total"] == pytest.approx(2 / 6)


def test_tuple_of_inputs():
    """A batch for a model of two inputs is a tuple of arrays."""
    la = js.mark("la", lambda p, x: x * p)
    lb = js.mark("lb", lambda p, y: y * p)

    def two(p, x, y):
        return la(p, x).sum() + lb(p, y).sum()

    t = C.Tracker(
        two,
        jnp.ones(()),
        jnp.zeros((1, 3)),
        jnp.zeros((1, 2)),
        criteria=[C.TKNC(1)],
        layers=["la", "lb"],
    )
    t.update((rows_([[1, 2, 3], [3, 2, 1]]), rows_([[1, 1], [0, 5]])))
    r = t.result()["TKNC"]["layers"]
    assert r == {"la": pytest.approx(2 / 3), "lb": pytest.approx(1.0)}  # ties: (1, 1) covers both
    with pytest.raises(js.SliceError):
        t.update(rows_([[1, 2, 3]]))  # one input missing


def rows_(r):
    return jnp.asarray(np.array(r, np.float32))


# =========================================================================== layers and format


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3, name="inner")(nn.relu(nn.Dense(3, name="pre")(x)))


class Nested(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = Block(name="block")(x)
        x = jnp.tanh(x)
        return nn.Dense(2, name="head")(x)


class Scaled(nn.Module):
    """A module with a parameter of its own *and* a child with parameters."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(3, name="lin")(x) * self.param("scale", nn.initializers.ones, (3,))


class WithScaled(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2, name="head")(Scaled(name="scaled")(x))


def test_default_layers_are_modules_with_parameters():
    x = jnp.ones((2, 3))
    model = Nested()
    t = C.Tracker(model, random_variables(model, x), x, criteria=[C.NC(0.5)])
    assert t.layers == ["block/pre", "block/inner", "head"]  # `block` owns no parameter


def test_default_layers_include_modules_with_own_parameters():
    """`scaled` owns `scale`: a module with parameters of its own (Tracker docstring; SPEC:
    "default: every module that has parameters"), so it is a layer, as is `scaled/lin`."""
    x = jnp.ones((2, 3))
    model = WithScaled()
    t = C.Tracker(model, random_variables(model, x), x, criteria=[C.NC(0.5)])
    assert set(t.layers) == {"scaled/lin", "scaled", "head"}


def test_result_format_and_table(mlp, mlp_tracker):
    t = mlp_tracker
    t.reset()
    t.update(mlp.test[:4])
    r = t.result()
    assert isinstance(r, dict)
    assert list(r) == ["NC", "KMNC", "NBC", "SNAC", "TKNC", "SignSign"]
    for res in r.values():
        assert set(res) == {"total", "layers"}
        assert isinstance(res["total"], float) and 0.0 <= res["total"] <= 1.0
        assert all(isinstance(v, float) for v in res["layers"].values())
    assert list(r["NC"]["layers"]) == ["fc1", "fc2", "head"]
    assert list(r["SignSign"]["layers"]) == ["fc1 -> fc2", "fc2 -> head"]
    table = str(r)
    for word in [*r, "fc1", "fc2", "head", "fc1 -> fc2", f"{r['NC']['total']:.4f}"]:
        assert word in table


# =========================================================================== errors


def test_profile_needed_first(mlp):
    for crits in ([C.NC(0.5), C.KMNC(3)], [C.NBC()], [C.SNAC()]):
        t = C.Tracker(mlp.model, mlp.variables, mlp.x, criteria=crits)
        with pytest.raises(js.SliceError, match="profile"):
            t.update(mlp.test)
        with pytest.raises(js.SliceError, match="profile"):
            t.result()


def test_a_nan_profile_is_refused_and_the_one_before_kept(mlp):
    """A profiling input that makes neurons NaN would leave their bounds NaN (nothing
    ever beyond them): `profile` raises, naming how many neurons of which layers, and the
    tracker goes on with the profile it had. Empty batches are skipped; only empty ones
    are no batches."""
    crits = [C.NBC(), C.KMNC(3)]
    t = C.Tracker(mlp.model, mlp.variables, mlp.x, criteria=crits)
    empty = np.asarray(mlp.prof[0])[:0]
    with pytest.raises(js.InvalidSpecError, match="only empty"):
        t.profile([empty, empty])
    t.profile([empty, mlp.prof[0], empty, mlp.prof[1]])
    t.update(mlp.test)
    before = t.result()
    poisoned = np.asarray(mlp.prof[0]).copy()
    poisoned[2, 0] = np.nan
    with pytest.raises(js.SliceError, match=r"NaN for .* of 'fc1'.*NBC, KMNC") as err:
        t.profile([poisoned])
    assert "x[np.isfinite(x)" in str(err.value)
    t.update(mlp.test)
    assert t.result() == before  # the same profile: the same inputs cover nothing new
    reference_tracker = C.Tracker(mlp.model, mlp.variables, mlp.x, criteria=crits)
    reference_tracker.profile(mlp.prof)
    reference_tracker.update(mlp.test)
    assert reference_tracker.result() == before
    only_nc = C.Tracker(mlp.model, mlp.variables, mlp.x, criteria=[C.NC(0.5)])
    only_nc.profile([poisoned])  # nothing reads the ranges: the statistics say NaN
    assert np.isnan(only_nc.profile_stats["fc1"]["low"]).any()


def test_unknown_layer_suggests_close_names(mlp):
    with pytest.raises(js.SliceError) as err:
        C.Tracker(mlp.model, mlp.variables, mlp.x, criteria=[C.NC(0.5)], layers=["fc_1"])
    assert "fc1" in str(err.value)


def test_batch_with_wrong_shape(mlp, mlp_tracker):
    for bad in [
        jnp.ones((4, 5)),
        jnp.ones((4, 3), jnp.int32),
        jnp.ones((3,)),
        (mlp.test[:4], mlp.test[:4]),
    ]:
        with pytest.raises(js.SliceError):
            mlp_tracker.update(bad)


@pytest.mark.parametrize(
    "make",
    [
        lambda: C.NC(1.0),
        lambda: C.NC(-0.1),
        lambda: C.NC(True),
        lambda: C.KMNC(0),
        lambda: C.KMNC(2.5),
        lambda: C.TKNC(0),
        lambda: C.SignSign(capacity=0),
    ],
)
def test_bad_criterion_arguments(make):
    with pytest.raises(js.SliceError):
        make()


def test_bad_tracker_options(mlp):
    m, v, x = mlp.model, mlp.variables, mlp.x
    with pytest.raises(js.SliceError, match="granularity"):
        C.Tracker(m, v, x, criteria=[C.NC(0.5)], granularity="bogus")
    with pytest.raises(js.SliceError, match="position"):
        C.Tracker(m, v, x, criteria=[C.NC(0.5)], position="bogus")
    with pytest.raises(js.SliceError):
        C.Tracker(m, v, x, criteria=["NC"])
    with pytest.raises(js.SliceError):
        C.Tracker(m, v, x, criteria=[])
    with pytest.raises(js.SliceError):
        C.Tracker(m, v, x, criteria=[C.NC(0.5)], layers="fc1")
    t = C.Tracker(m, v, x, criteria=[C.KMNC(2)])
    with pytest.raises(js.SliceError):
        t.profile([])


# =========================================================================== NNX


def test_nnx_model_reads_current_state():
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.stem = nnx.Linear(3, 4, rngs=rngs)
            self.head = nnx.Linear(4, 2, rngs=rngs)

        def __call__(self, x):
            return self.head(jax.nn.relu(self.stem(x)))

    net = Net(nnx.Rngs(0))
    x = rand(30, (6, 3))
    crits = [C.NC(0.5), C.TKNC(1)]
    t = C.Tracker(net, x, criteria=crits)
    assert t.layers == ["stem", "head"]

    def oracle():  # eager calls of the submodules
        h = net.stem(x)
        return reference(
            crits,
            ["stem", "head"],
            None,
            {"stem": np.asarray(h), "head": np.asarray(net.head(jax.nn.relu(h)))},
        )

    t.update(x)
    assert_result(t.result(), oracle())
    net.stem.bias[...] = net.stem.bias[...] + jnp.array(
        [100.0, 0.0, 0.0, 0.0]
    )  # neuron 0 always on top
    t.reset()
    t.update(x)
    assert t.result()["TKNC"]["layers"]["stem"] == 0.25
    assert_result(t.result(), oracle())


# =========================================================================== compiles


def test_construction_compiles_nothing_and_each_step_once():
    """A tracker is built from the layers' shapes: no eager computation per layer (the
    input shape is used by no other test, so nothing is in JAX's caches beforehand). The
    empty states go into the compiled steps as they are: one compile per step."""
    x = rand(40, (3, 9, 7, 3))  # odd sizes: layer shapes no other test compiles for
    model = TinyResNet()
    variables = random_variables(model, x)
    crits = [C.NC(0.5), C.KMNC(3), C.NBC(), C.SNAC(), C.TKNC(2), C.SignSign(capacity=16)]
    with count_compiles() as built:
        t = C.Tracker(model, variables, x, criteria=crits, granularity="element")
    assert len(t.layers) > 5 and built.compiles == 0
    with count_compiles() as profiled:
        t.profile([x])
    with count_compiles() as first:
        t.update(x)
    with count_compiles() as second:
        t.update(x)
    assert (profiled.compiles, first.compiles, second.compiles) == (1, 1, 0)


def test_a_batch_of_a_new_size_compiles_nothing(mlp):
    """After a batch of 8, batches of 5 and 3 are padded to 8 inside the tracker: nothing
    compiles, and every criterion's result is the reference's over the 16 inputs."""
    t = C.Tracker(mlp.model, mlp.variables, mlp.x, criteria=ALL6())
    t.profile(mlp.prof)
    t.update(mlp.test)
    extra = np.asarray(mlp.prof[0])  # 8 more inputs whose outputs the fixture captured
    with count_compiles() as later:
        t.update(extra[:5])
        t.update(extra[5:])
    assert later.compiles == 0
    outs = {k: np.concatenate([mlp.test_outs[k], mlp.prof_outs[k][:8]]) for k in mlp.test_outs}
    assert_result(t.result(), reference(ALL6(), t.layers, mlp.prof_outs, outs))
    assert int(t.states[-1][2]) == 16  # SignSign's history holds the 16 inputs, no padding


def test_profiling_a_batch_of_a_new_size_compiles_nothing(mlp):
    """Profiling batches of 8, then 5 and 3 (padded to 8 inside): nothing compiles after
    the first, and the statistics are NumPy's over the 16 inputs."""
    t = C.Tracker(mlp.model, mlp.variables, mlp.x, criteria=[C.KMNC(3)])
    first, second = (np.asarray(p) for p in mlp.prof)
    t.profile([first])
    with count_compiles() as later:
        t.profile([second[:5], second[5:]])
    assert later.compiles == 0
    for name, stats in t.profile_stats.items():
        values = neurons(mlp.prof_outs[name], "channel")
        np.testing.assert_allclose(np.asarray(stats["low"]), values.min(0), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(stats["high"]), values.max(0), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(stats["mean"]), values.mean(0), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(stats["std"]), values.std(0), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("stacked", [False, True], ids=["layers", "iterations"])
def test_the_profiling_inputs_fed_again_cover_no_corner(stacked):
    """The profile's own inputs, fed again one at a time and in uneven batches, cross no
    bound (NBC = SNAC = 0) and fall in the sections they fall in at the profile's batch
    size: XLA rounds values at batch 1 and at batch 90 a few ulps apart, which the
    bounds' tolerance absorbs."""
    model = ScannedModel()
    x = np.random.default_rng(3).normal(size=(90, 4)).astype(np.float32)
    variables = model.init(jax.random.key(1), x[:1])
    layers = ["layers[:]/mlp", "layers[:]/attn"] if stacked else None
    crits = [C.NBC(), C.SNAC(), C.KMNC(4)]

    def fed(sizes):
        t = C.Tracker(model, variables, x[:1], layers=layers, criteria=crits)
        t.profile([x])
        for chunk in np.split(x, np.cumsum(sizes)[:-1]):
            t.update(chunk)
        return {name: r["layers"] for name, r in t.result().items()}

    whole = fed([90])
    assert set(whole["NBC"].values()) == set(whole["SNAC"].values()) == {0.0}
    assert fed([1] * 90) == whole
    assert fed([7, 70, 13]) == whole


def test_padding_rows_cover_nothing(mlp, mlp_tracker):
    """`update` with `valid`: rows past the batch's inputs, filled with values that would
    cover every neuron, change nothing; the result is the reference's on the inputs."""
    t = mlp_tracker
    test = {n: neurons(mlp.test_outs[n], "channel") for n in t.layers}
    scaled = {n: nc_values(mlp.test_outs[n], "channel") for n in t.layers}
    profile = [
        js.observe.Moments.of(jnp.asarray(neurons(mlp.prof_outs[n], "channel"))) for n in t.layers
    ]
    rng = np.random.default_rng(5)
    junk = lambda v, rows: jnp.asarray(np.concatenate([v, rows]), jnp.float32)  # noqa: E731
    values = [junk(test[n], rng.normal(size=(5, test[n].shape[1])) * 100) for n in t.layers]
    sc = [junk(scaled[n], np.ones((5, scaled[n].shape[1]))) for n in t.layers]
    valid = jnp.arange(13) < 8
    result = {}
    for crit in ALL6():
        state = crit.update(crit.init(t.sizes), values, sc, profile, valid)
        counts = [(int(c), n) for c, n in crit.counts(state)]
        keys = crit.keys(t.layers)
        result[crit.name] = {
            "total": sum(c for c, _ in counts) / sum(n for _, n in counts),
            "layers": {k: c / n for k, (c, n) in zip(keys, counts, strict=True)},
        }
    assert_result(result, reference(ALL6(), t.layers, mlp.prof_outs, mlp.test_outs))


def test_scalar_layer_is_refused_by_name():
    total = js.mark("total", lambda p, x: jnp.sum(x * p))

    def f(p, x):
        return total(p, x)

    with pytest.raises(js.SliceError, match="'total'"):
        C.Tracker(f, jnp.ones(()), jnp.ones((2, 3)), criteria=[C.NC(0.5)], layers=["total"])


# =========================================================================== stacked layers


def test_stacked_layers_match_the_unrolled_twin():
    """``layers[:]/attn`` and ``layers[:]/mlp`` of a scanned stack (their iterations
    interleaved in call order), with a profile, every per-layer criterion (updated over a
    stack's iterations at once) and SignSign (which pairs neighbouring iterations): the
    reference's figures for the same layers of the unrolled twin, over two batches, the
    second padded."""
    model = ScannedModel()
    x = rand(30, (16, 4), 1.5, offset=0.5)
    variables = random_variables(model, x[:2], seed=3)
    cap = captured(ScanUnrolled(), scan_unrolled_params(variables), x)
    crits = ALL6()
    t = C.Tracker(
        model, variables, x[:2], criteria=crits, layers=["layers[:]/mlp", "layers[:]/attn"]
    )
    iterations = [(k, m) for k in range(SCAN_LAYERS) for m in ("attn", "mlp")]
    assert t.layers == [f"layers[{k}]/{m}" for k, m in iterations]
    t.profile([x[:8]])
    t.update(x[8:13])
    t.update(x[13:])  # padded to 5 rows
    twin = {f"layers[{k}]/{m}": np.asarray(cap[f"layers_{k}/{m}"][0]) for k, m in iterations}
    prof, test = {n: v[:8] for n, v in twin.items()}, {n: v[8:] for n, v in twin.items()}
    expected = reference(crits, t.layers, prof, test)
    not_trivial(expected, ["NC", "KMNC", "NBC", "SNAC", "TKNC"])
    assert_result(t.result(), expected)
    low = np.stack([neurons(prof[n], "channel").min(0) for n in t.layers])
    stats = t.profile_stats
    assert list(stats) == t.layers
    np.testing.assert_array_equal(np.stack([stats[n]["low"] for n in t.layers]), low)
