"""embshard: learned embedding-table sharding (ingest, benchmark, cost model, policy, placement export)."""
from __future__ import annotations

from .registry import POLICY_CHAMPION_URI  # light: no MLflow import
from .version import __version__

__all__ = ["POLICY_CHAMPION_URI", "__version__", "load_planner"]


def load_planner(model_uri: str = POLICY_CHAMPION_URI, **kw):
    """Load the learned planner from the MLflow registry (see README, 'Using a registered planner'). Keywords go
    to the planner: `search_evaluations` (the search's work budget), `time_budget_s` (its safety cap), `seed`."""
    from .planners.registered import load_planner as _load

    return _load(model_uri, **kw)
