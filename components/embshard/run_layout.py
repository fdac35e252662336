"""The fixed paths of a run root: every stage reads and writes these, so stages pass nothing but the root.

Plain string joining (no pyarrow): the DAG imports embshard.stages, and with it this module, at parse time in
any Airflow image.
"""
from __future__ import annotations

PATHS = {"tables": "tables.parquet", "tasks": "tasks.parquet", "costs": "costs", "cost_model": "cost_model",
         "policy": "policy", "evaluation": "evaluation", "export": "export", "state": "state"}


def _join(root: str, *parts: str) -> str:
    return "/".join([str(root).rstrip("/"), *parts])


def run_root(data_root: str, run_id: str) -> str:
    """The folder of one Airflow run under the data root (its id made path-safe)."""
    return _join(data_root, str(run_id).replace(":", "-").replace("+", "-"))


def path(root: str, key: str) -> str:
    return _join(root, PATHS[key])


def relative_to_root(root: str, value):
    """`value` as a state file records it: a path under `root` relative to it (a run root copied or moved
    elsewhere then reads its own files, not the original's), anything else as it is."""
    prefix = str(root).rstrip("/") + "/"
    return value[len(prefix):] if isinstance(value, str) and value.startswith(prefix) else value


def in_root(root: str, value: str) -> str:
    """A path read from a state file: relative ones are under `root` (relative_to_root); absolute paths and URIs
    (state written before paths were recorded relative) are kept."""
    text = str(value)
    if text.startswith("/") or "://" in text or text.startswith(str(root).rstrip("/") + "/"):
        return text  # absolute, a URI, or written before under a relative root (it names the root already)
    return _join(root, text)
