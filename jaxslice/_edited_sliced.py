"""`Edited`: what `Editor.build` returns for a linen model or a plain function.

A `js.Sliced` of the edited model (`_edited.EditedModel`), whose keyword arguments also
take the call-time inputs. Its variables are the model's with each new module's under
its node name (`_edited.EditPlan`), so two things let training come back to the model:
`merge` writes the model's entries of trained variables into the model's variables and
leaves the new modules' out, and `nodes` gives the new modules' variables apart, each in
its module's own layout. An edited Haiku function (`adapters._haiku_slice.HaikuEdited`)
offers both in Haiku's dicts over this object.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from . import _compat
from ._core import exporting
from ._core.program import SliceProgram
from ._edited import EditPlan
from ._sliced import Sliced


class Edited(Sliced):
    """An edited linen model or plain function: a `js.Sliced` of the edited model whose
    keyword arguments also take the call-time inputs (``edited(x, delta=v)``).

    Its variables are the model's with each new module's under its node name; `merge`
    writes trained ones back to the model (without the new modules) and `nodes` gives
    the new modules' apart.
    """

    def __init__(self, program: SliceProgram, plan: EditPlan):
        super().__init__(program)
        self._plan = plan
        self._call_inputs = plan.tables.call_inputs()

    def merge(self, full_variables: Any, new_variables: Any) -> Any:
        """The model's variables with its entries replaced from the edited model's.

        `new_variables` has the structure of ``edited.variables`` (or is a part of it,
        such as the updated state returned with `mutable`): the model's entries replace
        those of `full_variables`, the new modules' are left out (`nodes` gives them), so
        the result is what the model needs to run as trained, without the edits. Leaves
        not replaced are the same objects as in `full_variables`.

        Raises:
          VariablesMismatchError: if the model's entries of `new_variables` hold a path
            the model does not have, or a leaf of another shape or dtype than the model's.

        >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxslice as js
        >>> model = nn.Sequential([nn.Dense(4), nn.Dense(2)])
        >>> x = jnp.ones((1, 3))
        >>> variables = model.init(jax.random.key(0), x)
        >>> g = js.edit(model, variables, x)
        >>> edited = g.insert_after("layers_0", nn.Dense(4), key=jax.random.key(1), name="a").build()
        >>> trained = jax.tree.map(lambda w: w + 1, edited.variables)
        >>> merged = edited.merge(variables, trained)
        >>> sorted(merged["params"])
        ['layers_0', 'layers_1']
        >>> bool((merged["params"]["layers_1"]["bias"] == 1).all())
        True
        >>> sorted(edited.nodes(trained)["a"]["params"])
        ['bias', 'kernel']
        """
        return super().merge(full_variables, self._plan.model_entries(new_variables))

    def nodes(self, variables: Any = None) -> dict[str, Any]:
        """The new modules' variables, apart from the model's: ``{node name: its
        variables}``, each in its module's own layout (for a linen module what its
        ``init`` returns, ``{"params": ...}``, so ``module.apply(nodes[name], h)`` runs
        it; stacked per iteration for a node at ``[:]``).

        Args:
          variables: the edited model's variables (e.g. trained ones), or a part of them;
            entries it lacks are taken from ``edited.variables``. Default:
            ``edited.variables``.

        Raises:
          VariablesMismatchError: if `variables` hold a path the edited model does not
            have, or a leaf of another shape or dtype.
        """
        return self._plan.node_entries(self.variables if variables is None else variables)

    def export(
        self,
        *,
        batch: str | None = "b",
        variables_as_input: bool = False,
        platforms: Any = None,
        variables: Any = None,
        pick: Callable[[Any], Any] | None = None,
    ) -> Any:
        """The edited model as a `jax.export.Exported` (see `js.Sliced.export`).

        Call-time inputs are keyword arguments of the exported function, at their
        examples' shapes; with `batch`, their first axis after the loops' leading axes
        is the symbolic batch size where the example had the model's batch size there.
        `variables` replaces `self.variables`; `pick` selects from the result.
        """
        program = self._slice_program()

        def call_inputs(dim: Any) -> dict[str, Any]:
            leaves = jax.tree_util.tree_leaves(program.input_specs(None)[0])
            size = leaves[0].shape[0] if leaves and leaves[0].shape else None
            specs = {}
            for name, (node, sample) in self._call_inputs.items():
                shape, lead = list(sample.shape), len(node.stacked)
                if dim is not None and len(shape) > lead and shape[lead] == size:
                    shape[lead] = dim
                specs[name] = jax.ShapeDtypeStruct(tuple(shape), sample.dtype)
            return specs

        pick = pick or (lambda out: out)

        def run(v: Any, /, *inputs: Any, **kw: Any) -> Any:  # call-time inputs may be `v`
            return pick(self.apply(v, *inputs, **kw))

        return exporting.export(
            program.base,
            run,
            self.variables if variables is None else variables,
            batch=batch,
            variables_as_input=variables_as_input,
            platforms=platforms,
            more_inputs=call_inputs,
        )


_compat.register_frames_exclusion(__file__)
