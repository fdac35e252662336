"""Planners: baselines, TorchRec's planner, and the learned policy with search; one interface (base.Planner)."""
from __future__ import annotations

from ..errors import EmbshardError
from ..registry import POLICY_CHAMPION_URI, POLICY_MODEL
from .base import Planner

LEARNED = "learned"
POLICY_ONLY = "policy_only"


def learned_uri(name: str, default: str | None = None) -> str:
    """Model URI of a learned planner name: learned (champion or `default`), learned@ALIAS, learned/VERSION."""
    for prefix in (LEARNED, POLICY_ONLY):
        if name.startswith(prefix):
            rest = name[len(prefix):]
            if rest.startswith("@"):
                return f"models:/{POLICY_MODEL}@{rest[1:]}"
            if rest.startswith("/"):
                return f"models:/{POLICY_MODEL}/{rest[1:]}"
    return default or POLICY_CHAMPION_URI


def available_planners() -> list[str]:
    from .baselines import BASELINES

    return [LEARNED, *BASELINES, "torchrec_table_wise", "torchrec_full"]


def get_planner(name: str, **kw) -> Planner:
    """A planner by name. `learned` takes model_uri=... (default models:/embshard-policy@champion)."""
    from .baselines import make_baseline

    if name.startswith(LEARNED) or name.startswith(POLICY_ONLY):
        from ..policy.model import load_planner

        uri = learned_uri(name, kw.get("model_uri"))
        opts = {k: v for k, v in kw.items()
                if k in ("time_budget_s", "search_evaluations", "num_samples", "column_splits", "seed")}
        if name.startswith(POLICY_ONLY):  # ablation: one greedy rollout, no portfolio, no search
            opts.update(num_samples=0, portfolio=False, column_splits=False, search_evaluations=0, cost_greedy=False)
        planner = load_planner(uri, **opts)
        planner.name = name
        return planner
    if name.startswith("torchrec_"):
        from .torchrec_planner import TorchRecPlanner

        search = name[len("torchrec_"):]
        return TorchRecPlanner(search=search, **{k: v for k, v in kw.items() if k in ("timeout_s", "batch_size")})
    try:
        return make_baseline(name, seed=kw.get("seed", 0))
    except KeyError:
        raise EmbshardError(f"unknown planner {name!r}", field="planner",
                            fix=f"choose one of {', '.join(available_planners())}") from None
