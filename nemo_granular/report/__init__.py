"""The comparison report: embedded and NeMo-RL run directories → ``report.md`` with plots,
the benchmark-suite table and noise-aware verdicts on the papers' claims (docs/comparison.md)."""

from .build import report_from_runs
from .runs import Run, load_run

__all__ = ["report_from_runs", "load_run", "Run"]
