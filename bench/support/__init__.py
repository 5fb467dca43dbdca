"""Modules the benchmarks import, never run on their own (so they take no ``--quick``):
``recovery_timing`` (figures from run records), ``chaos_figures`` (the chaos benchmark's
figures and goals) and ``recovery_reference`` (the Ray Train V2 reference job)."""
