"""embshard: learned embedding-table sharding (ingest, benchmark, cost model, policy, placement export)."""
from __future__ import annotations

__version__ = "0.1.0"

from .registry import POLICY_CHAMPION_URI  # noqa: E402  (light: no MLflow import)


def load_planner(model_uri: str = POLICY_CHAMPION_URI):
    """Load the learned planner from the MLflow registry (see README, 'Using a registered planner')."""
    from .planners.registered import load_planner as _load

    return _load(model_uri)
