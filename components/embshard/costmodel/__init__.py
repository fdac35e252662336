"""The learned cost model: per-table encoder, SUM per device, fwd/bwd compute and comm heads, overall head.

`CostModel` (prediction API) and `load(uri)` (a registry URI such as models:/embshard-cost@champion, or a local
folder written by CostModel.save). The train_cost_model stage is embshard.jobs.train_cost. Imports are lazy so that
`embshard --help` does not pull torch.
"""
from __future__ import annotations

from ..registry import COST_MODEL as REGISTERED_NAME

__all__ = ["CostModel", "load", "REGISTERED_NAME"]


def __getattr__(name):
    if name == "CostModel":
        from .model import CostModel

        return CostModel
    raise AttributeError(name)


def load(uri: str):
    """A CostEnsemble from `models:/embshard-cost@<alias>` (or any MLflow model URI) or a local model folder."""
    import os

    from .ensemble import CostEnsemble

    if "://" not in uri and ":/" not in uri and os.path.isdir(uri):
        return CostEnsemble.load_dir(uri)
    from .. import registry

    # A local sqlite store: the ensemble's files directly (alias resolved now; no MLflow import, seconds saved).
    arts = registry.local_artifacts(uri)
    if arts is not None:
        if "ensemble" not in arts or "policy_weights" in arts:
            from ..errors import EmbshardError

            raise EmbshardError("this registry entry is not a cost model", path=uri,
                                fix=f"use a version of '{REGISTERED_NAME}'")
        return CostEnsemble.from_files(arts)
    registry.connect()
    wrapper = registry.load_python_model(uri)
    model = getattr(wrapper, "model", None)
    if not isinstance(model, CostEnsemble):
        from ..errors import EmbshardError

        raise EmbshardError("this registry entry is not a cost model", path=uri,
                            fix=f"use a version of '{REGISTERED_NAME}'")
    return model
