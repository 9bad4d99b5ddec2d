"""Scanned stacks whose values alias or whose iterations update state.

Two things a scan's bookkeeping could get silently wrong:

* a lifted cell that returns its carry as its output too (``return c, c``, the usual RNN
  cell): the loop returns that one value twice, once as the last carry and once stacked,
  and the loop as a whole (``loop``) must show its caller both;
* a `BatchNorm` inside `nn.scan` in train mode: a slice that runs some iterations
  returns the stacked statistics whole, the rows it runs updated and the others as they
  were, and raises without `mutable` as linen does.

Oracles: the cell applied iteration by iteration with `nn.apply`-style `Module.apply`
calls on its own parameters (and statistics rows), and the model's own `apply`.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import jaxslice as js

from helpers.oracles import assert_trees_all_close

# --------------------------------------------------------------------------- aliased carry


class Rnn(nn.Module):
    """``return c, c``: the new carry is also the iteration's output."""

    @nn.compact
    def __call__(self, c, x):
        c = nn.tanh(nn.Dense(6)(jnp.concatenate([c, x], -1)))
        return c, c


class Twice(nn.Module):
    """The carry returned twice as the output."""

    @nn.compact
    def __call__(self, c, x):
        c = nn.tanh(nn.Dense(6)(jnp.concatenate([c, x], -1)))
        return c, (c, c)


class WithY(nn.Module):
    """The carry and another value as the output."""

    @nn.compact
    def __call__(self, c, x):
        c = nn.tanh(nn.Dense(6)(jnp.concatenate([c, x], -1)))
        return c, (c, 2.0 * c + 1.0)


class Lstmish(nn.Module):
    """A tuple carry, returned whole as the output."""

    @nn.compact
    def __call__(self, carry, x):
        h, m = carry
        m = m + nn.Dense(6, name="gate")(jnp.concatenate([h, x], -1))
        h = nn.tanh(m)
        return (h, m), (h, m)


def zeros_carry(cell, batch):
    z = jnp.zeros((batch, 6))
    return (z, jnp.ones((batch, 6))) if cell is Lstmish else z


class Seq(nn.Module):
    cell: type
    axis: int = 1  # the time axis of the inputs and of the stacked outputs

    @nn.compact
    def __call__(self, xs):
        loop = nn.scan(
            self.cell,
            variable_broadcast="params",
            split_rngs={"params": False},
            in_axes=self.axis,
            out_axes=self.axis,
        )(name="loop")
        batch = xs.shape[1 - self.axis]
        c, ys = loop(zeros_carry(self.cell, batch), xs)
        first = jax.tree_util.tree_leaves(ys)[0]
        return nn.Dense(2, name="head")(first) + jax.tree_util.tree_leaves(c)[0].sum()


def by_hand(model, variables, xs):
    """The loop of `Seq` iteration by iteration with the cell's own `apply`:
    ``(last carry, outputs stacked on the time axis, [(carry, output) per iteration])``."""
    params = {"params": variables["params"]["loop"]}
    cell = model.cell()
    c = zeros_carry(model.cell, xs.shape[1 - model.axis])
    steps = []
    for t in range(xs.shape[model.axis]):
        c, y = cell.apply(params, c, jnp.take(xs, t, axis=model.axis))
        steps.append((c, y))
    stacked = jax.tree.map(lambda *ys: jnp.stack(ys, axis=model.axis), *[y for _, y in steps])
    return c, stacked, steps


CASES = [(Rnn, 1), (Rnn, 0), (Twice, 1), (WithY, 0), (Lstmish, 1)]


@pytest.fixture(scope="module", params=CASES, ids=lambda p: f"{p[0].__name__}-axis{p[1]}")
def seq(request):
    cell, axis = request.param
    model = Seq(cell, axis)
    shape = (3, 4, 5) if axis == 1 else (4, 3, 5)
    xs = jax.random.normal(jax.random.key(0), shape)
    variables = model.init(jax.random.key(1), xs)
    return model, variables, xs


def test_the_loop_as_a_whole_lists_the_carry_and_the_stacked_outputs(seq):
    model, variables, xs = seq
    c, ys, _ = by_hand(model, variables, xs)
    row = next(b for b in js.boundaries(model, variables, xs) if b.name == "loop")
    want = [tuple(a.shape) for a in jax.tree_util.tree_leaves((c, ys))]
    assert [tuple(a.shape) for a in row.outputs] == want


def test_end_at_the_loop_returns_the_last_carry_and_the_stacked_outputs(seq):
    model, variables, xs = seq
    c, ys, _ = by_hand(model, variables, xs)
    got = js.slice(model, variables, xs, end="loop")(xs)
    assert_trees_all_close(got, (c, ys))


def test_start_at_the_loop_reproduces_the_model(seq):
    model, variables, xs = seq
    tail = js.slice(model, variables, xs, start="loop")
    got = tail(zeros_carry(model.cell, xs.shape[1 - model.axis]), xs)
    assert_trees_all_close(got, model.apply(variables, xs))


def test_iterations_of_an_aliased_carry(seq):
    model, variables, xs = seq
    _, _, steps = by_hand(model, variables, xs)
    got = js.slice(model, variables, xs, end=["loop[2]", "loop[:]"])(xs)
    stacked = jax.tree.map(lambda *s: jnp.stack(s), *steps)
    assert_trees_all_close(got, (steps[2], stacked))


# --------------------------------------------------------------------------- stacked state


class NormCell(nn.Module):
    @nn.compact
    def __call__(self, c, _):
        return nn.BatchNorm(use_running_average=False)(nn.Dense(4)(c)), None


class Stack(nn.Module):
    reverse: bool = False

    @nn.compact
    def __call__(self, x):
        layers = nn.scan(
            NormCell,
            variable_axes={"params": 0, "batch_stats": 0},
            split_rngs={"params": True},
            length=3,
            reverse=self.reverse,
        )
        return layers(name="layers")(x, None)[0]


LENGTH = 3


def _distinct(variables):
    """Non-trivial statistics, so that "unchanged" and "updated" differ clearly."""
    return jax.tree.map(
        lambda a: a + 0.1 * jnp.arange(a.size, dtype=a.dtype).reshape(a.shape), variables
    )


@pytest.fixture(scope="module")
def stack():
    model = Stack()
    x = jax.random.normal(jax.random.key(2), (5, 4))
    return model, _distinct(model.init(jax.random.key(3), x)), x


def _row(tree, k):
    return jax.tree.map(lambda a: a[k], tree)


def layer_by_layer(variables, x, reverse=False):
    """Each iteration with the cell's own `apply` on its rows: the carry after each
    iteration (by row), and each row's updated statistics."""
    params, stats = variables["params"]["layers"], variables["batch_stats"]["layers"]
    carries, rows = [None] * LENGTH, [None] * LENGTH
    c = x
    for k in reversed(range(LENGTH)) if reverse else range(LENGTH):
        rows_k = {"params": _row(params, k), "batch_stats": _row(stats, k)}
        (c, _), new = NormCell().apply(rows_k, c, None, mutable=["batch_stats"])
        carries[k], rows[k] = c, new["batch_stats"]
    return carries, rows


def stats_with_rows(variables, rows, ran):
    """The stacked statistics with the rows `ran` taken from `rows`, the others old."""
    old = variables["batch_stats"]["layers"]
    new = jax.tree.map(
        lambda o, *r: jnp.stack([r[k] if k in ran else o[k] for k in range(LENGTH)]), old, *rows
    )
    return {"batch_stats": {"layers": new}}


def test_the_oracles_agree(stack):
    model, variables, x = stack
    carries, rows = layer_by_layer(variables, x)
    y, updates = model.apply(variables, x, mutable=["batch_stats"])
    assert_trees_all_close(y, carries[-1])
    assert_trees_all_close(updates, stats_with_rows(variables, rows, range(LENGTH)))


def test_a_slice_of_some_iterations_returns_their_rows_updated(stack):
    model, variables, x = stack
    carries, rows = layer_by_layer(variables, x)
    sub = js.slice(model, variables, x, end="layers[1]")
    out, updates = sub.apply(sub.variables, x, mutable=["batch_stats"])
    assert_trees_all_close(out, (carries[1], None))
    want = stats_with_rows(variables, rows, {0, 1})
    assert_trees_all_close(updates, want)
    # Rows 0-1 as the model itself updates them; row 2 exactly as it was.
    _, full = model.apply(variables, x, mutable=["batch_stats"])
    assert_trees_all_close(_row(updates, slice(0, 2)), _row(full, slice(0, 2)))
    old = variables["batch_stats"]["layers"]["BatchNorm_0"]["mean"][2]
    assert (updates["batch_stats"]["layers"]["BatchNorm_0"]["mean"][2] == old).all()


def test_without_mutable_a_slice_that_updates_statistics_raises_as_linen_does(stack):
    model, variables, x = stack
    with pytest.raises(Exception):  # noqa: B017 - linen's own error
        model.apply(variables, x)
    for end in ["layers[1]", "layers[1]/BatchNorm_0", "layers[:]/BatchNorm_0", "layers"]:
        sub = js.slice(model, variables, x, end=end)
        with pytest.raises(js.SliceError, match="batch_stats"):
            sub(x)


@pytest.mark.parametrize(
    ("end", "ran", "value"),
    [
        ("layers[1]/BatchNorm_0", {0, 1}, lambda carries: carries[1]),
        ("layers[-1]/BatchNorm_0", {0, 1, 2}, lambda carries: carries[2]),
        ("layers[:]/BatchNorm_0", {0, 1, 2}, lambda carries: jnp.stack(carries)),
        ("layers", {0, 1, 2}, lambda carries: (carries[2], None)),
    ],
)
def test_per_iteration_stacked_and_whole_loop_ends(stack, end, ran, value):
    model, variables, x = stack
    carries, rows = layer_by_layer(variables, x)
    sub = js.slice(model, variables, x, end=end)
    out, updates = sub.apply(sub.variables, x, mutable=["batch_stats"])
    assert_trees_all_close(out, value(carries))
    assert_trees_all_close(updates, stats_with_rows(variables, rows, ran))


def test_an_end_inside_an_iteration_before_its_norm_leaves_that_row(stack):
    model, variables, x = stack
    _, rows = layer_by_layer(variables, x)
    sub = js.slice(model, variables, x, end="layers[1]/Dense_0")
    _, updates = sub.apply(sub.variables, x, mutable=["batch_stats"])
    assert_trees_all_close(updates, stats_with_rows(variables, rows, {0}))


def test_a_slice_starting_at_an_iteration_updates_that_row_on(stack):
    model, variables, x = stack
    carries, rows = layer_by_layer(variables, x)
    tail = js.slice(model, variables, x, start="layers[1]")
    out, updates = tail.apply(tail.variables, carries[0], mutable=["batch_stats"])
    y, full = model.apply(variables, x, mutable=["batch_stats"])
    assert_trees_all_close(out, y)
    assert_trees_all_close(updates, stats_with_rows(variables, rows, {1, 2}))
    assert_trees_all_close(_row(updates, slice(1, 3)), _row(full, slice(1, 3)))


def test_updated_rows_under_jit_and_merged_back(stack):
    model, variables, x = stack
    _, rows = layer_by_layer(variables, x)
    sub = js.slice(model, variables, x, end="layers[0]")
    step = jax.jit(lambda v, x: sub.apply(v, x, mutable=["batch_stats"]))
    _, updates = step(sub.variables, x)
    merged = sub.merge(variables, {**sub.variables, **updates})
    assert_trees_all_close(
        merged["batch_stats"], stats_with_rows(variables, rows, {0})["batch_stats"]
    )
    assert (
        merged["params"]["layers"]["Dense_0"]["kernel"]
        is variables["params"]["layers"]["Dense_0"]["kernel"]
    )


def test_a_reverse_scan_runs_and_updates_the_rows_from_the_last(stack):
    _, _, x = stack
    model = Stack(reverse=True)
    variables = _distinct(model.init(jax.random.key(3), x))
    carries, rows = layer_by_layer(variables, x, reverse=True)
    sub = js.slice(model, variables, x, end="layers[1]")
    out, updates = sub.apply(sub.variables, x, mutable=["batch_stats"])
    assert_trees_all_close(out, (carries[1], None))
    assert_trees_all_close(updates, stats_with_rows(variables, rows, {1, 2}))


class Outer(nn.Module):
    @nn.compact
    def __call__(self, c, _):
        inner = nn.scan(
            NormCell,
            variable_axes={"params": 0, "batch_stats": 0},
            split_rngs={"params": True},
            length=2,
        )
        return inner(name="inner")(c, None)[0], None


class Nested(nn.Module):
    @nn.compact
    def __call__(self, x):
        outer = nn.scan(
            Outer,
            variable_axes={"params": 0, "batch_stats": 0},
            split_rngs={"params": True},
            length=3,
        )
        return outer(name="outer")(x, None)[0]


@pytest.mark.parametrize(
    ("end", "ran"),
    [
        ("outer[1]", {(0, 0), (0, 1), (1, 0), (1, 1)}),
        ("outer[1]/inner[0]", {(0, 0), (0, 1), (1, 0)}),
        ("outer[0]/inner[1]/BatchNorm_0", {(0, 0), (0, 1)}),
    ],
)
def test_nested_scans_update_the_rows_of_the_iterations_run(end, ran):
    model = Nested()
    x = jax.random.normal(jax.random.key(4), (5, 4))
    variables = _distinct(model.init(jax.random.key(5), x))
    _, full = model.apply(variables, x, mutable=["batch_stats"])
    sub = js.slice(model, variables, x, end=end)
    _, updates = sub.apply(sub.variables, x, mutable=["batch_stats"])

    def pick(new, old):
        rows = [[new[i, k] if (i, k) in ran else old[i, k] for k in range(2)] for i in range(3)]
        return jnp.stack([jnp.stack(r) for r in rows])

    assert_trees_all_close(
        updates, jax.tree.map(pick, full, {"batch_stats": variables["batch_stats"]})
    )


def test_iterations_with_a_gap_between_them_refuse_to_drop_the_updates(stack):
    model, variables, x = stack
    with pytest.raises(js.SliceError, match="consecutive"):
        js.slice(
            model, variables, x, start=["layers[0]", "layers[2]"], end=["layers[0]", "layers[2]"]
        )
