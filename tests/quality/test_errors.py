"""Every bad input gets a `js.SliceError` subclass whose message names what is wrong and
how to fix it: the closest names, the choices, the missing boundary."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jaxslice as js

ERRORS = [
    js.UnknownBoundaryError,
    js.AmbiguousBoundaryError,
    js.MissingInputError,
    js.DisconnectedError,
    js.InputMismatchError,
    js.UnsupportedTargetError,
    js.InvalidSpecError,
    js.BoundaryInLoopError,
    js.VariablesMismatchError,
]


@pytest.mark.parametrize("cls", ERRORS, ids=lambda c: c.__name__)
def test_every_error_is_a_slice_error(cls):
    assert issubclass(cls, js.SliceError)
    assert issubclass(js.SliceError, Exception)


def _slice(zoo, **kw):
    return js.slice(zoo.model, zoo.variables, zoo.x, **kw)


# --------------------------------------------------------------------------- unknown names


def test_misspelled_end_suggests_the_closest_name(resnet):
    with pytest.raises(js.UnknownBoundaryError) as info:
        _slice(resnet, end="stage_1")
    msg = str(info.value)
    assert "'stage_1'" in msg
    assert "'stage1'" in msg


def test_misspelled_start_suggests_the_closest_name(resnet):
    with pytest.raises(js.UnknownBoundaryError, match="'head'"):
        _slice(resnet, start="haed")


def test_leaf_name_suggests_full_paths(resnet):
    with pytest.raises(js.UnknownBoundaryError) as info:
        _slice(resnet, end="conv1")
    assert "'stage1/conv1'" in str(info.value)
    assert "'stage2/conv1'" in str(info.value)


def test_names_are_never_prefix_matches(resnet):
    with pytest.raises(js.UnknownBoundaryError):
        _slice(resnet, end="stage")
    with pytest.raises(js.UnknownBoundaryError):
        _slice(resnet, end="stage2/")


def test_unknown_name_in_end_list_and_dict(resnet):
    with pytest.raises(js.UnknownBoundaryError, match="'stem'"):
        _slice(resnet, end=["head", "stme"])
    with pytest.raises(js.UnknownBoundaryError, match="'head'"):
        _slice(resnet, end={"a": "stem", "b": "hed"})


def test_call_index_out_of_range(shared_zoo):
    with pytest.raises(js.UnknownBoundaryError) as info:
        _slice(shared_zoo, end="shared@2")
    assert "shared@0" in str(info.value) and "shared@1" in str(info.value)


def test_call_index_on_module_called_once_beyond_zero(resnet):
    with pytest.raises(js.UnknownBoundaryError):
        _slice(resnet, end="stem@1")


def test_unknown_name_in_plain_function():
    mark = js.mark("layer", lambda p, x: x * p)
    with pytest.raises(js.UnknownBoundaryError, match="'layer'"):
        js.slice(lambda p, x: mark(p, x) + 1, jnp.ones(3), jnp.ones(3), end="lyaer")


# --------------------------------------------------------------------------- ambiguous names


@pytest.mark.parametrize("where", ["start", "end"])
def test_bare_name_of_module_called_twice_lists_the_calls(shared_zoo, where):
    with pytest.raises(js.AmbiguousBoundaryError) as info:
        _slice(shared_zoo, **{where: "shared"})
    msg = str(info.value)
    assert "shared@0" in msg and "shared@1" in msg
    assert "2" in msg


def test_ambiguous_with_a_port(shared_zoo):
    with pytest.raises(js.AmbiguousBoundaryError, match="shared@1"):
        _slice(shared_zoo, start="shared:output")


# --------------------------------------------------------------------------- missing inputs


def test_missing_skip_connection_names_its_module_and_suggests_the_fix(skip_zoo):
    with pytest.raises(js.MissingInputError) as info:
        _slice(skip_zoo, start="enc2", end="dec")
    msg = str(info.value)
    assert "'enc1'" in msg
    assert "enc1:output" in msg  # the port to add to start
    assert "start=" in msg


def test_missing_residual_input_names_the_block_input(resnet):
    with pytest.raises(js.MissingInputError) as info:
        _slice(resnet, start="stage1/conv2", end="stage1")
    msg = str(info.value)
    assert "stage1" in msg
    assert "stage1:input" in msg or "stage1/conv1:input" in msg


def test_missing_input_of_plain_function_residual():
    dense = lambda p, x: x @ p  # noqa: E731
    l1, l2 = js.mark("l1", dense), js.mark("l2", dense)

    def model(p, x):
        h = l1(p, x)
        return l2(p, jnp.tanh(h)) + h

    with pytest.raises(js.MissingInputError) as info:
        js.slice(model, jnp.eye(3), jnp.ones((2, 3)), start="l2", end=None)
    assert "'l1'" in str(info.value) and "l1:output" in str(info.value)


def test_missing_model_input_is_reported():
    """The end also needs a second model input that no start provides."""
    l1 = js.mark("l1", lambda p, x: x @ p)

    def model(p, x, y):
        return l1(p, x) + y

    with pytest.raises(js.MissingInputError, match="model's own input"):
        js.slice(model, jnp.eye(3), jnp.ones((2, 3)), jnp.ones((2, 3)), start="l1", end=None)


# --------------------------------------------------------------------------- disconnected


def test_end_before_start_is_disconnected(resnet):
    with pytest.raises(js.DisconnectedError) as info:
        _slice(resnet, start="head", end="stem")
    msg = str(info.value)
    assert "stem" in msg and "head" in msg


def test_end_not_depending_on_start_is_disconnected(unused_zoo):
    with pytest.raises(js.DisconnectedError, match="probe"):
        _slice(unused_zoo, start="probe:output", end="head")


def test_unused_start_is_disconnected(resnet):
    with pytest.raises(js.DisconnectedError) as info:
        _slice(resnet, start=["stage2", "head"], end="stage2")
    assert "head" in str(info.value)


def test_unused_model_inputs_start_reads_as_the_start_given(resnet):
    with pytest.raises(js.DisconnectedError) as info:
        _slice(resnet, start=[None, "head"], end="head")
    assert str(info.value).startswith(
        "The start None (the model's inputs) is not used by 'head:output'; remove it"
    )


def test_missing_value_for_an_extra_output_suggests_an_end_or_a_mode():
    """A model returning ``(out, cache)``, the cache holding every layer's key: from
    ``l2`` the whole output needs ``l1``'s key, and the message also offers ending at
    the output wanted or slicing in a mode without the cache. Following it works (the
    oracle: Flax's own apply and recorded intermediates)."""
    import flax.linen as nn

    from helpers.oracles import captured

    class Layer(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4, name="proj")(x), nn.Dense(3, name="key")(x)

    class Cached(nn.Module):
        @nn.compact
        def __call__(self, x, return_cache=True):
            h, k1 = Layer(name="l1")(x)
            h, k2 = Layer(name="l2")(h)
            out = nn.Dense(2, name="head")(h)
            return (out, (k1, k2)) if return_cache else out

    model, x = Cached(), jnp.ones((2, 4))
    variables = model.init(jax.random.key(0), x)
    with pytest.raises(js.MissingInputError) as info:
        js.slice(model, variables, x, start="l2")
    text = str(info.value)
    assert "end the slice at the part you need instead, for example end=['head', 'l2/key']" in text
    assert "`return_cache=False`" in text
    h = captured(model, variables, x)["l1"][0][0]
    want = model.apply(variables, x, return_cache=False)
    assert jnp.allclose(js.slice(model, variables, x, start="l2", end="head")(h), want, atol=1e-6)
    sub = js.slice(model, variables, x, start="l2", return_cache=False)
    assert jnp.allclose(sub(h), want, atol=1e-6)


def test_no_end_advice_when_the_whole_output_needs_the_value():
    l1, l2 = js.mark("l1", lambda p, x: x @ p), js.mark("l2", lambda p, x: x @ p)

    def model(p, x):  # one output, which reads l1's output through a residual
        h = l1(p, x)
        return l2(p, jnp.tanh(h)) + h

    with pytest.raises(js.MissingInputError) as info:
        js.slice(model, jnp.eye(3), jnp.ones((2, 3)), start="l2", end=None)
    assert "Only part of the model's output" not in str(info.value)


# --------------------------------------------------------------------------- bad inputs at call time


def test_wrong_number_of_inputs(resnet):
    sub = _slice(resnet, start="head")
    (feat,) = resnet.args_of("head")
    with pytest.raises(js.InputMismatchError, match="1"):
        sub(feat, feat)
    with pytest.raises(js.InputMismatchError):
        sub()


def test_wrong_structure_of_a_tuple_input(tuple_zoo):
    sub = _slice(tuple_zoo, start="pair:output", end="head")
    a = jnp.ones((2, 4), jnp.float32)
    with pytest.raises(js.InputMismatchError):
        sub(a)
    with pytest.raises(js.InputMismatchError):
        sub([a, a])


def test_wrong_feature_shape_and_dtype(resnet):
    sub = _slice(resnet, start="head")
    with pytest.raises(js.InputMismatchError, match=r"float32\[2, 8\]"):
        sub(jnp.ones((2, 9), jnp.float32))
    with pytest.raises(js.InputMismatchError, match="int32"):
        sub(jnp.ones((2, 8), jnp.int32))


def test_full_variables_passed_to_apply(resnet):
    sub = _slice(resnet, start="head")
    (feat,) = resnet.args_of("head")
    with pytest.raises(js.VariablesMismatchError) as info:
        sub.apply(resnet.variables, feat)
    assert "not used by the slice" in str(info.value)
    assert "sub.variables" in str(info.value)


def test_a_slice_given_its_variables_as_a_target_says_how_to_call_it(resnet):
    sub = _slice(resnet, start="head")
    (feat,) = resnet.args_of("head")
    with pytest.raises(js.InputMismatchError) as info:
        js.intermediates(sub, sub.variables, feat)
    assert "pass its `apply`: js.intermediates(sub.apply, variables, x)" in str(info.value)
    assert list(js.intermediates(sub.apply, sub.variables, feat)) == ["head"]


# --------------------------------------------------------------------------- warnings


def test_a_one_argument_closure_warns_that_its_argument_is_taken_as_parameters():
    import flax.linen as nn

    model, x = nn.Dense(3), jnp.ones((2, 4))
    variables = model.init(jax.random.key(0), x)
    with pytest.warns(js.SingleArgumentWarning, match="takes one argument") as record:
        js.boundaries(lambda t: model.apply(variables, t), x)
    assert record[0].filename == __file__  # points at the user's call
    assert "js.slice(lambda params, t: model(t), None, tokens)" in str(record[0].message)
    js.boundaries(lambda p, t: model.apply(p, t), variables, x)  # no warning (errors here)
    js.boundaries(lambda p, t=None: model.apply(p, x), variables)  # takes two: no warning


# --------------------------------------------------------------------------- bad targets and specs


def test_target_that_is_neither_module_nor_callable():
    with pytest.raises(js.UnsupportedTargetError) as info:
        js.boundaries(42, jnp.ones(3))
    assert "int" in str(info.value)
    with pytest.raises(js.UnsupportedTargetError):
        js.slice("model", jnp.ones(3), end=None)


def test_linen_module_without_variables(resnet):
    with pytest.raises(js.UnsupportedTargetError, match="init"):
        js.boundaries(resnet.model)


@pytest.mark.parametrize(
    "kw",
    [
        {"end": 3},
        {"start": 3},
        {"end": []},
        {"start": []},
        {"end": {}},
        {"end": 1.5},
        {"end": ["stem", 3]},
    ],
    ids=str,
)
def test_invalid_start_or_end(resnet, kw):
    with pytest.raises(js.InvalidSpecError):
        _slice(resnet, **kw)


def test_invalid_spec_message_shows_the_value(resnet):
    with pytest.raises(js.InvalidSpecError, match="3"):
        _slice(resnet, end=3)


@pytest.mark.parametrize("name", ["", 3, None])
def test_mark_needs_a_non_empty_name(name):
    with pytest.raises(js.InvalidSpecError):
        js.mark(name)


def _positions_model(p, x, pos):
    """Two blocks passed the model's own `pos` input, after an embedding of `x`."""
    e = js.mark("embed", lambda x: x * p)(x)
    a = js.mark("a", lambda h, pos: jnp.tanh(h) * pos)(e, pos)
    b = js.mark("b", lambda h, pos: jnp.sin(h) + pos)(e * 2.0, pos)
    return a + b


def test_a_model_input_taken_by_two_starts_gets_a_fix_that_works():
    p, x, pos = jnp.float32(0.5), jnp.linspace(-1.0, 1.0, 4), jnp.arange(4.0)
    with pytest.raises(js.InvalidSpecError) as info:
        js.slice(_positions_model, p, x, pos, start=["a", "b"])
    text = str(info.value)
    assert "an input of the model" in text and "the same array" in text
    assert "Add None to `start`" in text and "start=['a', 'b', None]" in text
    sub = js.slice(_positions_model, p, x, pos, start=["a", "b", None])
    e = x * p
    assert jnp.allclose(sub(e, e * 2.0, x, pos), _positions_model(p, x, pos))


def test_a_start_made_only_of_model_inputs_beside_none_is_refused_with_advice():
    p, x, pos = jnp.float32(0.5), jnp.linspace(-1.0, 1.0, 4), jnp.arange(4.0)
    with pytest.raises(js.InvalidSpecError) as info:
        js.slice(_positions_model, p, x, pos, start=["embed", None])
    text = str(info.value)
    assert "'embed' takes nothing but the model's own inputs" in text
    assert "Leave 'embed' out: start=None." in text
    assert "container" not in text.split("(one would be silently ignored).")[1]


# --------------------------------------------------------------------------- loops


def test_boundary_inside_a_while_body_is_an_error_naming_the_whole_loop():
    step = js.mark("step", lambda c: c * 0.5)

    def model(p, x):
        with jax.named_scope("loop"):
            c = jax.lax.while_loop(lambda c: c.sum() > 1.0, step, x + p)
        return c

    p, x = jnp.zeros(4), jnp.full(4, 3.0)
    with pytest.raises(js.BoundaryInLoopError) as info:
        js.slice(model, p, x, end="loop/step")
    assert "while" in str(info.value) and "'loop'" in str(info.value)
    # Slicing at the loop as a whole works.
    assert jnp.allclose(js.slice(model, p, x, end="loop")(x), model(p, x))


def test_bare_name_of_a_call_in_a_scan_body_says_how_to_name_an_iteration():
    step = js.mark("step", lambda c, x: (jnp.tanh(c + x), c))

    def model(p, xs):
        with jax.named_scope("loop"):
            c, _ = jax.lax.scan(step, p, xs)
        return c

    p, xs = jnp.zeros(4), jnp.ones((3, 4))
    with pytest.raises(js.UnknownBoundaryError) as info:
        js.slice(model, p, xs, end="loop/step")
    assert "'loop/step[0]'" in str(info.value) and "'loop/step[:]'" in str(info.value)
    with pytest.raises(js.UnknownBoundaryError, match="runs 3 times"):
        js.slice(model, p, xs, end="loop/step[3]")
    with pytest.raises(js.InvalidSpecError, match="not start"):
        js.slice(model, p, xs, start="loop/step[:]", end="loop/step[2]")
    # Slicing at the loop as a whole works.
    assert jnp.allclose(js.slice(model, p, xs, end="loop")(xs), model(p, xs))


# --------------------------------------------------------------------------- built from facts


def _error_classes() -> list[type]:
    import jaxslice._errors as errors

    return [getattr(errors, name) for name in errors.__all__]


def test_an_error_is_built_from_facts_that_stay_readable(shared_zoo):
    with pytest.raises(js.UnknownBoundaryError) as info:
        _slice(shared_zoo, end="shared@2")
    error = info.value
    assert error.facts["spec"] == "shared@2" and error.facts["count"] == 2
    assert str(error) == type(error).TEMPLATE.format(**error.facts)
    assert error.args == (str(error),)


def test_a_plain_message_is_still_accepted():
    error = js.InvalidSpecError("my own message")
    assert str(error) == "my own message" and error.facts == {}
    assert str(js.AmbiguousBoundaryError("text", name="x")) == "text"


def test_errors_pickle_with_their_facts(resnet):
    import pickle

    with pytest.raises(js.InputMismatchError) as info:
        js.slice(resnet.model, resnet.variables, resnet.x, start="stage1")(resnet.x, resnet.x)
    error = info.value
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error) and str(again) == str(error)
    assert again.facts == error.facts
    # A fact that does not pickle travels as its repr; the message is unchanged.
    odd = js.UnknownBoundaryError(name="x", hint=lambda: None)
    again = pickle.loads(pickle.dumps(odd))
    assert str(again) == str(odd) and again.facts["hint"] == repr(odd.facts["hint"])


def test_every_error_class_subclasses_a_public_category_and_says_when_it_is_raised():
    public = {c for c in vars(js).values() if isinstance(c, type) and issubclass(c, js.SliceError)}
    for cls in _error_classes():
        assert issubclass(cls, js.SliceError)
        assert public & set(cls.__mro__), cls
        assert cls.__doc__ and cls.__doc__.strip(), cls
        if cls not in public:
            assert "\n" not in cls.__doc__.strip(), f"{cls.__name__}: one line"
            assert cls.TEMPLATE, cls
            assert cls.__name__ not in js.__all__, cls


def test_every_template_formats_from_the_facts_it_names():
    import string

    for cls in _error_classes():
        fields = {f for _, f, _, _ in string.Formatter().parse(cls.TEMPLATE) if f}
        facts = {f: 1.0 for f in fields}
        assert str(cls(**facts)) == cls.TEMPLATE.format(**facts)
