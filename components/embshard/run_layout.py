"""The fixed paths of a run root: every stage reads and writes these, so stages pass nothing but the root.

Plain string joining (no pyarrow): the DAG imports embshard.stages, and with it this module, at parse time in
any Airflow image.
"""
from __future__ import annotations

PATHS = {"tables": "tables.parquet", "tasks": "tasks.parquet", "costs": "costs", "cost_model": "cost_model",
         "policy": "policy", "evaluation": "evaluation", "export": "export", "state": "state"}


def _join(root: str, *parts: str) -> str:
    return "/".join([str(root).rstrip("/"), *parts])


def path(root: str, key: str) -> str:
    return _join(root, PATHS[key])
