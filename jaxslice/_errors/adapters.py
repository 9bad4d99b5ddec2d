"""Errors particular to one model library: a target jaxslice cannot slice as given, and
what that library's slices and edited models refuse."""

from __future__ import annotations

from .base import (
    InputMismatchError,
    InvalidSpecError,
    SliceError,
    UnsupportedTargetError,
    VariablesMismatchError,
)
from .variables import ModelChangedError

# --------------------------------------------------------------------------- linen, plain


class LinenNoVariablesError(UnsupportedTargetError):
    """A linen module was sliced without its variables."""

    TEMPLATE = (
        "A linen module is sliced with its variables and sample inputs: "
        "js.slice(model, variables, x, end=...). No variables were given; create them "
        "with `variables = model.init(jax.random.key(0), x)`."
    )


class PlainNoParamsError(UnsupportedTargetError):
    """A plain function was sliced without its parameters argument."""

    TEMPLATE = (
        "A plain function is sliced as js.slice(fn, params, *inputs, end=...): its first "
        "argument holds the parameters. Pass `None` if it has none."
    )


class SlicedTargetArgumentsError(InputMismatchError):
    """A slice passed as a target was given its variables, as a plain function is."""

    TEMPLATE = (
        "A slice or an edited model passed as a target is called as it is called itself, "
        "`sub(*inputs)`, with its own variables (`sub.variables`), but the first argument "
        "has the structure of {what}. Pass its inputs only: js.boundaries(sub, x); to run "
        "it with other variables, pass its `apply`: js.intermediates(sub.apply, variables, x)."
    )


# --------------------------------------------------------------------------- NNX


class NNXSliceExportStateError(SliceError):
    """An NNX slice that updates state in its current mode was exported."""

    TEMPLATE = (
        "In its current mode this slice updates {names} (batch statistics, random-number "
        "counters), and an exported program returns only the slice's outputs. Switch it to "
        "evaluation mode first: `sub.eval()` (it switches the model's own submodules; "
        "`sub.train()` switches them back)."
    )


class NNXSliceNotCopyableError(SliceError):
    """An NNX slice was pickled or deep-copied."""

    TEMPLATE = (
        "An NNX slice shares the model's variables and holds compiled programs, so it cannot "
        "be pickled or deep-copied. Save the model's state instead (`nnx.state(model)`, e.g. "
        "with orbax) and the recipe (start, end, sample input shapes); after loading the "
        "model, slice it again."
    )


class NNXSlicePartReplacedError(ModelChangedError):
    """A submodule an NNX slice holds was replaced in the model since it was sliced."""

    TEMPLATE = (
        "The model's submodule {path} was replaced since this slice was made ({old} then, "
        "{new} now). The slice holds the old one, so it would run one's code with the "
        "other's variables. Slice the model again to use the new {path}: a slice follows "
        "new values of its submodules' variables, not new submodules."
    )


class NNXModeVariablesError(SliceError):
    """An NNX slice reads, in the mode it is called in, variables it does not hold."""

    TEMPLATE = (
        "In this mode the slice reads variables it does not hold: {paths}. Slice the model "
        "again after switching it to this mode."
    )


class LinenNodeStateError(SliceError):
    """A new linen node updated state or drew random numbers while called."""

    TEMPLATE = (
        "The new node ({kind}) needs {what} while called (batch statistics updated, or a "
        "dropout mask drawn), which an inserted node is not given. Insert it in evaluation "
        "mode (`use_running_average=True`, `deterministic=True`), or a node without batch "
        "statistics or random draws."
    )


class NNXNodeStateError(SliceError):
    """A new NNX node updated its own state while called."""

    TEMPLATE = (
        "The new node ({kind}) updated its own state while called ({paths}), which an "
        "edit cannot keep. Switch it to evaluation mode before inserting it (`node.eval()`), "
        "or insert a node without batch statistics or random draws."
    )


class NNXEditedExportStateError(SliceError):
    """An edited NNX model that updates state in its current mode was exported."""

    TEMPLATE = (
        "In its current mode the edited model updates {names} (batch statistics, random-number "
        "counters), and an exported program returns only its outputs. Switch it to evaluation "
        "mode first: `edited.eval()`."
    )


class NNXEditedNotCopyableError(SliceError):
    """An edited NNX model was pickled or deep-copied."""

    TEMPLATE = (
        "An edited NNX model shares the model's variables and holds compiled programs, so it "
        "cannot be pickled or deep-copied. Save the model's and the nodes' state instead "
        "(`nnx.state(edited)`) and edit the model again after loading it."
    )


# --------------------------------------------------------------------------- Equinox


class EquinoxWrappedModelError(UnsupportedTargetError):
    """A function that wraps an Equinox model (a `jax.vmap` of one, say) was sliced."""

    TEMPLATE = (
        "This function wraps an Equinox model ({kind}), so jaxslice cannot see the model's "
        "parameters: they would be traced as constants. Slice the model itself on one "
        "example and batch the slice: `sub = js.slice(model, x[0], end=...)`, then "
        "`jax.vmap(sub)(x)`. For layers that need a batch axis name (BatchNorm), slice a "
        "module that vmaps inside, e.g. `eqx.filter_vmap(model, axis_name='batch')`."
    )


class EquinoxUnheldVariablesError(SliceError):
    """An Equinox slice whose parts were replaced reads variables it does not hold."""

    TEMPLATE = (
        "The slice reads variables it does not hold: {paths}. Its parts were replaced by "
        "modules of another structure; slice the changed model again."
    )


class EquinoxOtherSliceError(SliceError):
    """An Equinox slice's `merge` was given a slice with other parts."""

    TEMPLATE = (
        "`trained` is not a slice with the same parts as this one (at {paths}); pass the "
        "slice you trained, e.g. `sub.merge(model, trained_sub)`."
    )


class EquinoxMergeMismatchError(VariablesMismatchError):
    """A trained Equinox slice holds an array of another shape or dtype than the model's."""

    TEMPLATE = (
        "The trained slice's {path} is {trained}, where the model holds {held}: merge writes "
        "back parts of the shapes and dtypes it was sliced with (cast trained arrays back, "
        "e.g. with `jax.tree.map`, or slice the changed model again)."
    )


class EquinoxStructureChangedError(SliceError):
    """An edited Equinox model (or its model) no longer has the structure it was edited with."""

    TEMPLATE = (
        "The edited model's structure is not the one it was edited with ({what} changed; "
        "`eqx.nn.inference_mode` or a swapped layer does this). Edit the changed model again: "
        "`js.edit(eqx.nn.inference_mode(model), x)` with the same edits."
    )


class EquinoxOtherEditedError(SliceError):
    """An edited Equinox model's `merge` was given another edited model."""

    TEMPLATE = (
        "`trained` is not this edited model after training; pass `edited.merge(model, trained)`."
    )


# --------------------------------------------------------------------------- Haiku


class HaikuNoParamsError(UnsupportedTargetError):
    """A Haiku transform was sliced without its params (and state)."""

    TEMPLATE = (
        "A Haiku function is sliced with its parameters{state} and sample inputs: "
        "js.slice(f, params{state_arg}, x, end=...). Create them with `f.init(key, x)`."
    )

    @classmethod
    def of(cls, stateful: bool) -> HaikuNoParamsError:
        """The error for a transform with state (`stateful`) or without."""
        state, state_arg = (" and state", ", state") if stateful else ("", "")
        return cls(stateful=stateful, state=state, state_arg=state_arg)


class HaikuRngKeywordError(InvalidSpecError):
    """Haiku's own `rng=` keyword was passed instead of `rngs=`."""

    TEMPLATE = (
        "jaxslice passes Haiku's `rng` as `rngs=key` (the keyword every jaxslice call takes "
        "for random keys): js.slice(f, params, x, end=..., rngs=key), sub(x, rngs=key)."
    )


class HaikuApplyArgumentsError(InputMismatchError):
    """A Haiku slice's `apply` got fewer arguments before the inputs than Haiku's takes."""

    TEMPLATE = (
        "A slice of this transform is applied as Haiku's own `apply` is: "
        "sub.apply({order}, *inputs); got {got} argument(s) before the inputs. Pass None as "
        "`rng` where the slice draws no random numbers."
    )


class HaikuNoRngError(InputMismatchError):
    """A slice of a transform without random keys was called with `rng`."""

    TEMPLATE = (
        "This transform takes no random key (`hk.without_apply_rng`): call the slice without `rng`."
    )


class HaikuUnusedParamsError(VariablesMismatchError):
    """A Haiku slice's `apply` was given params of modules the slice does not use."""

    TEMPLATE = (
        "The params passed hold modules the slice does not use: {extra}. Pass `sub.params` "
        "(or `sub.extract(params)`), or params of that structure."
    )


# --------------------------------------------------------------------------- Keras


class KerasBackendError(UnsupportedTargetError):
    """A Keras model runs on a backend other than JAX."""

    TEMPLATE = (
        "This Keras model runs on the {backend!r} backend; jaxslice traces models with JAX. "
        "Set the backend before importing Keras: `KERAS_BACKEND=jax` (or "
        "`os.environ['KERAS_BACKEND'] = 'jax'` first thing in your program)."
    )


class KerasNotBuiltError(UnsupportedTargetError):
    """A Keras model without variables (not built yet) was sliced."""

    TEMPLATE = (
        "The Keras model has no variables yet: build it first (call it once on a sample "
        "input, or `model.build(input_shape)`), then slice it."
    )


class KerasRngsError(InvalidSpecError):
    """`rngs=` was passed for a Keras model."""

    TEMPLATE = (
        "A Keras model draws random numbers from its layers' seed generators, whose states "
        'are variables (the "non_trainable" group); `rngs=` does not apply. Call the '
        'slice in training mode with `mutable=["non_trainable"]` to get the advanced '
        "seed states back, and pass them in the next call."
    )


class KerasNodeStateError(SliceError):
    """A new Keras layer updated its own non-trainable state while called."""

    TEMPLATE = (
        "The new layer {kind} updated its own non-trainable state while called (moving "
        "statistics, random-seed states), which an edit cannot keep. Insert it in inference "
        "mode (edit with `training=False`) or insert a layer without such state."
    )


class KerasNodeModeError(KerasNodeStateError):
    """A new Keras layer behaves differently in training, which an inserted node is not told."""

    TEMPLATE = (
        "The new layer {kind} behaves differently in training (its `call` takes `training`: "
        "batch statistics, dropout), but an inserted node is not told the model's mode and "
        "cannot keep the state it would update, so it would run as in neither mode "
        "faithfully. Insert a layer without a training mode, or this layer's inference "
        "form as a function: `lambda h: layer(h, training=False)`."
    )


class KerasNotSavableError(InvalidSpecError):
    """A Keras slice of a model without a config was saved as a `.keras` file."""

    TEMPLATE = (
        "This Keras slice cannot be saved as a `.keras` file: {why}. Give the model's class "
        "a `get_config` (as Keras asks of subclassed models), or save the slice's weights "
        "instead (`sub.save_weights(path)`, loaded with `sub.load_weights(path)` into a "
        "slice made the same way), or save the model itself."
    )


class KerasEditedNotSavableError(InvalidSpecError):
    """An edited Keras model was saved as a `.keras` file, which Keras cannot rebuild."""

    TEMPLATE = (
        "An edited Keras model cannot be saved as a `.keras` file: Keras rebuilds a model "
        "from its config, and the edits (the functions and layers given to `js.edit`) have "
        "none. Save its weights instead (`edited.save_weights(path)`, loaded with "
        "`edited.load_weights(path)` into the model edited the same way), or save the "
        "model as trained without the inserted layers (`edited.model.save(path)`) and each "
        "inserted layer apart (`edited.nodes[name]`)."
    )


class KerasEditedOtherModelError(InvalidSpecError):
    """An edited Keras model's `merge` was given another model than the one edited."""

    TEMPLATE = (
        "`edited.merge(model, variables)` writes into the Keras model that was edited "
        "({expected}), whose variables the edited model shares; it was given {got}. Pass "
        "`edited.model`, or edit the other model with `js.edit` first."
    )


class KerasInputNamesError(InputMismatchError):
    """A Keras slice was given a dict of inputs without one of its input names."""

    TEMPLATE = (
        "This Keras model's inputs are named {names}; the dict of inputs given has the "
        "keys {given}, without {missing}. Pass a dict with those keys, or a list of the "
        "inputs in that order."
    )
