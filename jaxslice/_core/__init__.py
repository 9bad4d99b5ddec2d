"""The slicing pipeline, one stage per module, in data-flow order.

target --trace.py (markers.py)--> jaxpr --build.py--> Graph (graph.py)
  (build.py flattens the jaxpr; calls.py groups markers into calls, lifted.py reads
   linen's lifted transforms, scopes.py named-scope regions)
  --plan.py (names.py, ports.py, analysis.py, diagnose.py; loops.py and its
   loop_requests.py, loop_expander.py, loop_rows.py for iterations of scans)--> Plan
  --emit.py--> a JAX function --program.py--> compiled entries per call signature,
the engine every user-facing object is a view of (arguments.py binds a call's inputs,
variables.py its variables, jitted.py puts repeated calls under `jax.jit`,
exporting.py serves `export`). evaluate.py runs a whole graph with hooks, scans kept.
jaxprs.py is the one evaluator (a rule per kind of equation) and its toolkit; build.py,
loop_expander.py and evaluate.py give it their rules.
"""
