"""Golden plans: the planners place fixed inputs exactly as recorded in tests/data/planner_golden.json.

The file was written by the planner code before its refactor into proposers and refiners (issue 23) and
regenerated once for row- and k-way column splits (issue 24: before regenerating, `no_splits` matched the former
`no_column_splits` plans piece for piece and every baseline its former plan, except round-robin on t80_d8_ens,
which used to fail and now cuts a table to fit), and once when the split search began carrying other kinds of first
cut on as branches (t40_d4 `no_cost_greedy` now takes the branch that replicates a table first; every other plan
and all search work unchanged), and once when slices of a table side by side on one device began to be joined
(splitting.merge_shared_slices: t40_d4 `learned` and t80_d8_ens `no_cost_greedy` each had a table cut into slices
that all sat on one device; that table is now whole, every other piece, start and search work unchanged). A change
of any placement (device, column or row range of any
piece), the candidate the search started from or the search work it did fails here. Regenerate only for an
intended change of plans:
    EMBSHARD_REGEN_GOLDEN=1 python -m pytest tests/test_planner_golden.py
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from embshard.costmodel.ensemble import CostEnsemble
from embshard.costmodel.model import CostModel, CostModelConfig
from embshard.errors import EmbshardError
from embshard.features import FeatureScaler
from embshard.ingest.synthetic import generate_tables
from embshard.planners.baselines import BASELINES, make_baseline
from embshard.planners.learned import LearnedPlanner
from embshard.policy.core import PolicyNet
from embshard.tableset import TableSet

GOLDEN = Path(__file__).parent / "data" / "planner_golden.json"
# (name, tables, table seed, devices, memory slack over an even split, ensemble members, search work or None for
# the default budget)
CASES = [("t40_d4", 40, 11, 4, 1.3, 1, None), ("t80_d8_ens", 80, 12, 8, 1.15, 2, None),
         ("t120_d2", 120, 13, 2, 1.6, 1, 6000)]
# The learned compositions (planners.compose.COMPOSITIONS) and extra settings.
VARIANTS = {
    "learned": {},
    "policy_only": {},
    "no_splits": {},
    "no_portfolio": {},
    "no_cost_greedy": {"search_evaluations": 5000},
}


def _world(n, table_seed, devices, slack, members):
    torch.manual_seed(100 + table_seed)
    ts = TableSet.from_frame(generate_tables(n, seed=table_seed, bins_batch_size=512))
    scaler = FeatureScaler.fit(ts.features())
    models = [CostModel.create(CostModelConfig(), scaler) for _ in range(members)]
    model = models[0] if members == 1 else CostEnsemble(models)
    policy = PolicyNet()
    mem = int(max(ts.size_bytes.sum() / devices * slack, ts.size_bytes.max() * 1.01))
    return ts, model, policy, mem


def _pieces(p):
    return [[s.table, s.device, s.col_offset, s.col_size, s.row_offset, s.row_size]
            + (["replicated"] if s.kind == "replicated" else []) for s in p.shards]


def _cost_greedy(ts, model, devices, mem):
    from embshard.planners.compose import CostGreedy, Problem
    from embshard.types import DeviceTopology

    a = CostGreedy().propose(Problem(ts, DeviceTopology(devices, mem), "t", model))
    return None if a is None else [int(d) for d in a]


def current_plans() -> dict:
    out: dict = {}
    for name, n, seed, devices, slack, members, work in CASES:
        ts, model, policy, mem = _world(n, seed, devices, slack, members)
        case: dict = {}
        for variant, kw in VARIANTS.items():
            kw = {"search_evaluations": work, **kw} if work is not None else kw
            p = LearnedPlanner(policy, model, composition_name=variant, **kw).plan(ts, devices, mem, name)
            case[variant] = {"pieces": _pieces(p), "start_candidate": p.meta["start_candidate"],
                             "search_evaluations": p.meta["search_evaluations"]}
        for b in BASELINES:
            try:
                case[b] = {"pieces": _pieces(make_baseline(b).plan(ts, devices, mem, name))}
            except EmbshardError as exc:  # random and round-robin may find no room on a tight budget
                case[b] = {"error": type(exc).__name__}
        case["cost_greedy"] = _cost_greedy(ts, model, devices, mem)
        out[name] = case
    return out


@pytest.fixture(scope="module")
def plans():
    return current_plans()


def test_golden_file_is_there_or_regenerated(plans):
    if os.environ.get("EMBSHARD_REGEN_GOLDEN") == "1":
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps(plans, indent=None, separators=(",", ":")) + "\n")
    assert GOLDEN.exists()


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_plans_match_the_golden_file(plans, case):
    golden = json.loads(GOLDEN.read_text())[case]
    got = plans[case]
    assert sorted(got) == sorted(golden)
    for planner in golden:
        assert got[planner] == golden[planner], f"{case}: {planner} changed its plan"
