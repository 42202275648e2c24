"""Tables, figures and loaders over the results tree (``results/<profile>/...``, docs/ENGINES.md).

Everything here *reads* what the jobs wrote and renders it; nothing recomputes a result. The pipeline calls
``python -m minite.report table|figure ...``; the notebooks import the loaders and figure functions.
"""
from minite.report.load import (
    load_diagnostics,
    load_evals,
    load_kernels,
    load_learner,
    load_stability,
    load_stability_summary,
)
from minite.report.tables import PAPER, throughput_table, write_throughput_table

__all__ = ["PAPER", "load_diagnostics", "load_evals", "load_kernels", "load_learner", "load_stability",
           "load_stability_summary", "throughput_table", "write_throughput_table"]
