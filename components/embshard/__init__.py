"""embshard: learned embedding-table sharding (ingest, benchmark, cost model, policy, placement export)."""
from __future__ import annotations

__version__ = "0.1.0"


def load_planner(model_uri: str = "models:/embshard-policy@champion"):
    """Load the learned planner from the MLflow registry (see README, 'Using a registered planner')."""
    from .planners.learned import load_planner as _load

    return _load(model_uri)
