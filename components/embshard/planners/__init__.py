"""Planners: baselines, TorchRec's planner, and the learned compositions (proposers + refiners, planners.compose);
one interface (base.Planner)."""
from __future__ import annotations

from ..errors import EmbshardError
from ..registry import POLICY_CHAMPION_URI, POLICY_MODEL
from .base import Planner

LEARNED = "learned"
# The learned compositions (planners.compose.COMPOSITIONS), longest first so that a name's prefix is found.
LEARNED_COMPOSITIONS = ("learned_with_torchrec", "no_dominant_cut", "no_column_splits", "no_row_splits",
                        "no_replicas", "no_cost_greedy", "no_portfolio", "no_branches", "policy_only", "no_splits",
                        "no_policy", "no_search", "learned")


def composition_of(name: str) -> str | None:
    """The learned composition a planner name asks for (e.g. learned@champion -> learned), else None."""
    for comp in LEARNED_COMPOSITIONS:
        if name == comp or name.startswith((f"{comp}@", f"{comp}/")):
            return comp
    return None


def is_planner_name(name: str) -> bool:
    """Whether `name` names a planner `get_planner` knows: a baseline, a TorchRec planner, or a learned composition
    (planners.compose.COMPOSITIONS) alone or with a non-empty @ALIAS or /VERSION."""
    from .baselines import BASELINES

    if name in BASELINES or name in ("torchrec_table_wise", "torchrec_full"):
        return True
    comp = composition_of(name)
    return comp is not None and (name == comp or len(name) > len(comp) + 1)


def learned_uri(name: str, default: str | None = None) -> str:
    """Model URI of a learned planner name: learned (champion or `default`), learned@ALIAS, learned/VERSION
    (or any learned composition's name in place of `learned`)."""
    comp = composition_of(name)
    if comp is not None:
        rest = name[len(comp):]
        if rest.startswith("@"):
            return f"models:/{POLICY_MODEL}@{rest[1:]}"
        if rest.startswith("/"):
            return f"models:/{POLICY_MODEL}/{rest[1:]}"
    return default or POLICY_CHAMPION_URI


def available_planners() -> list[str]:
    from .baselines import BASELINES

    others = [c for c in LEARNED_COMPOSITIONS if c != LEARNED]
    return [LEARNED, *BASELINES, "torchrec_table_wise", "torchrec_full", *others]


# The settings get_planner takes; each planner uses its own of them and leaves the others (an evaluation passes
# one set to every planner). Any other name is a mistake ('sead=3' had planned with seed 0 without a word).
PLANNER_SETTINGS = ("model_uri", "time_budget_s", "search_evaluations", "num_samples", "seed", "column_splits",
                    "timeout_s", "batch_size")


def get_planner(name: str, **kw) -> Planner:
    """A planner by name. `learned` takes model_uri=... (default models:/embshard-policy@champion; a name with
    @ALIAS or /VERSION, e.g. learned/2, names its model itself and model_uri is then only a default); the learned
    compositions also take time_budget_s, search_evaluations, num_samples and seed, TorchRec's timeout_s and
    batch_size, the baselines seed (PLANNER_SETTINGS; a setting another kind of planner takes is left unused)."""
    from .baselines import make_baseline

    unknown = sorted(set(kw) - set(PLANNER_SETTINGS))
    if unknown:
        raise EmbshardError(f"unknown planner setting {unknown[0]!r}", field=unknown[0],
                            fix=f"use the settings {', '.join(PLANNER_SETTINGS)}")
    comp = composition_of(name)
    if comp is not None:
        from .registered import load_planner

        uri = learned_uri(name, kw.get("model_uri"))  # a name's @ALIAS or /VERSION wins over model_uri (a default)
        opts = {k: v for k, v in kw.items() if k in ("time_budget_s", "search_evaluations", "num_samples", "seed")}
        if kw.get("column_splits") is False and comp == LEARNED:  # the former switch: no split refinement
            comp = "no_splits"
        planner = load_planner(uri, composition_name=comp, **opts)
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
