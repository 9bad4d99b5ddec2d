"""The slicing pipeline, one stage per module, in data-flow order.

target --trace.py (markers.py)--> jaxpr --build.py--> Graph (graph.py)
  --plan.py (names.py, ports.py, analysis.py, diagnose.py)--> Plan
  --emit.py--> a JAX function --program.py--> compiled entries per call signature,
the engine every user-facing object is a view of.
"""
