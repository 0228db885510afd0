"""Benchmarks: workloads (``specctl.bench.workloads``) of chat requests to time speculative decoding on.

Importing this package stays cheap (no torch); the names below are re-exported for convenience.
"""

from specctl.bench.workloads import WORKLOADS, Request, load_workload, render_prompt

__all__ = ["WORKLOADS", "Request", "load_workload", "render_prompt"]
