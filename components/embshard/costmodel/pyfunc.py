"""The MLflow pyfunc wrapper of the cost model (importable class: no pickled lambdas, nothing in __main__).

Artifacts: `ensemble` (JSON: members, interval z) and per member k `member<k>_weights` (state_dict .pt) and
`member<k>_config` (JSON with the architecture, the feature scaler, batch size and cache size).
`predict` takes a DataFrame with one row per (shard, table): the 21 raw feature columns
(embshard.features.FEATURE_NAMES), `shard` (int id) and `num_devices`; it returns one row per shard with
fwd_compute_ms, bwd_compute_ms, comm_ms, total_ms and, per head, the ensemble's interval (`*_low`, `*_high`,
fitted to hold 90% of measured validation costs). Python callers use `.model` (a CostEnsemble) directly.
"""
from __future__ import annotations

import pandas as pd
from mlflow.pyfunc import PythonModel  # mypy does not see mlflow.pyfunc.PythonModel (mlflow.pyfunc is lazy)


class CostModelPyfunc(PythonModel):
    def __init__(self):
        self.model = None

    def load_context(self, context) -> None:
        from .ensemble import CostEnsemble

        self.model = CostEnsemble.from_files(context.artifacts)

    def predict(self, context, model_input: pd.DataFrame, params: dict | None = None) -> pd.DataFrame:  # noqa: ARG002 (MLflow's signature)
        return predict_frame(self.model, model_input)


def predict_frame(model, model_input: pd.DataFrame) -> pd.DataFrame:
    """The pyfunc's output for `model_input` (one row per (shard, table)), from a CostEnsemble."""
    import numpy as np

    from ..features import FEATURE_NAMES

    df = pd.DataFrame(model_input)
    out = []
    for nd, part in df.groupby("num_devices", sort=True):
        codes, ids = pd.factorize(part["shard"], sort=True)
        order = np.argsort(codes, kind="stable")
        bounds = np.cumsum(np.bincount(codes, minlength=len(ids)))[:-1]
        shards = np.split(order, bounds)
        cols = model.predict_columns(part[FEATURE_NAMES].to_numpy(np.float32), shards, int(nd))
        out.append(pd.DataFrame({"shard": ids, "num_devices": int(nd), **cols}))
    return pd.concat(out, ignore_index=True)


def example_input(tables, num_devices: int = 4) -> pd.DataFrame:
    """A small valid input (two shards of the first tables): the model's signature and docs example."""
    from ..features import FEATURE_NAMES

    n = min(3, len(tables))
    feats = pd.DataFrame({"dim": tables.dims[:n], "rows": tables.rows[:n],
                          "pooling_factor": tables.pooling_factor[:n], "size_bytes": tables.size_bytes[:n],
                          **{c: tables.bins[:n, i] for i, c in enumerate(FEATURE_NAMES[4:])}})
    shard = [0] + [1] * (n - 1) if n > 1 else [0]
    return pd.DataFrame({"shard": shard, "num_devices": int(num_devices), **{c: feats[c] for c in FEATURE_NAMES}})
