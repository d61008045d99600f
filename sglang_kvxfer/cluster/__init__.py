"""The local-cluster harness: TP groups of rank processes on this host and the request
streams that drive them, used by the ``kvxfer`` commands, the tests and the benchmarks.

Owns ``group.py`` (``RankGroup``: spawn, watch, restart and stop one role's rank
processes), ``rank.py`` (the rank process: a ``KVManager`` running synthetic requests),
``workload.py`` (request streams and their summaries), ``baseline.py`` (plain movers of the
same bytes) and ``plot.py`` (the benchmark figure). Must not parse command-line arguments
or print: that is ``cli/``'s job. Names load on first use, so importing this package
starts nothing and pulls in neither msgpack nor matplotlib.
"""

from __future__ import annotations

import importlib

# name -> module that defines it
_EXPORTS = {
    "RankGroup": "group",
    "make_spec": "group",
    "open_groups": "group",
    "arm_parent_death_signal": "group",
    "describe_exit": "group",
    "StopFlag": "group",
    "rank_main": "rank",
    "make_requests": "workload",
    "run_workload": "workload",
    "summarize": "workload",
    "RequestResult": "workload",
    "METHODS": "baseline",
    "measure_baseline": "baseline",
    "plot_records": "plot",
    "config_label": "plot",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
