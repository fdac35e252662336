"""Planners: baselines, TorchRec's planner, and the learned policy with search; one interface (base.Planner)."""
from __future__ import annotations

from ..errors import EmbshardError
from .base import Planner

LEARNED = "learned"


def available_planners() -> list[str]:
    from .baselines import BASELINES

    return [LEARNED, *BASELINES, "torchrec_table_wise", "torchrec_full"]


def get_planner(name: str, **kw) -> Planner:
    """A planner by name. `learned` takes model_uri=... (default models:/embshard-policy@champion)."""
    from .baselines import make_baseline

    if name == LEARNED or name.startswith("learned"):
        from .learned import load_planner

        return load_planner(kw.get("model_uri") or "models:/embshard-policy@champion", **{
            k: v for k, v in kw.items() if k != "model_uri"})
    if name.startswith("torchrec_"):
        from .torchrec_planner import TorchRecPlanner

        search = name[len("torchrec_"):]
        return TorchRecPlanner(search=search, **{k: v for k, v in kw.items() if k in ("timeout_s", "batch_size")})
    try:
        return make_baseline(name, seed=kw.get("seed", 0))
    except KeyError:
        raise EmbshardError(f"unknown planner {name!r}", field="planner",
                            fix=f"choose one of {', '.join(available_planners())}") from None
