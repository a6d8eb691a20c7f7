"""The papers' benchmark suites (SSPO, SPPO, ESPO protocols): NeMo-RL ``run_eval`` commands for every
checkpoint of a cluster run, the same mechanics in-process for embedded runs, and ``evals.json``
results for the report (docs/comparison.md)."""

from .suite import BENCHMARKS, PROTOCOLS, SUITES, protocols_for

__all__ = ["BENCHMARKS", "PROTOCOLS", "SUITES", "protocols_for"]
