"""The planners' typed vocabulary (embshard.types) and the composition of the learned planner: a topology
reaches the placement, shard kinds, the cost estimators' protocol, and compositions built from parts."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from embshard.costmodel.ensemble import CostEnsemble
from embshard.costmodel.model import CostModel, CostModelConfig
from embshard.costmodel.reference import AnalyticEstimator
from embshard.errors import EmbshardError, InfeasiblePlacementError
from embshard.features import FeatureScaler
from embshard.ingest.synthetic import generate_tables
from embshard.placement import Placement
from embshard.planners.baselines import make_baseline
from embshard.planners.compose import (
    COMPOSITIONS,
    ComposedPlanner,
    Composition,
    CostGreedy,
    DominantCuts,
    Heuristic,
    LocalSearch,
    Splits,
    composition,
)
from embshard.policy.core import PolicyNet
from embshard.tableset import TableSet
from embshard.types import CostEstimator, DeviceTopology, Shard


@pytest.fixture(scope="module")
def world():
    torch.manual_seed(0)
    ts = TableSet.from_frame(generate_tables(24, seed=5, bins_batch_size=512))
    model = CostModel.create(CostModelConfig(), FeatureScaler.fit(ts.features()))
    mem = int(max(ts.size_bytes.sum() / 4 * 1.3, ts.size_bytes.max() * 1.01))
    return ts, model, mem


def test_a_topology_or_two_ints_give_the_same_plan_and_the_placement_keeps_the_topology(world):
    ts, _, mem = world
    topo = DeviceTopology(4, mem, hardware="cuda:H100", hosts=(0, 0, 1, 1))
    a = make_baseline("size_greedy").plan(ts, topo, task_id="t")
    b = make_baseline("size_greedy").plan(ts, 4, mem, "t")
    assert a.device_of_shards().tolist() == b.device_of_shards().tolist()
    assert a.devices is topo and a.devices.local_world_size == 2 and not a.devices.same_host(1, 2)
    assert b.devices == DeviceTopology(4, mem)
    with pytest.raises(EmbshardError, match="host entries"):
        DeviceTopology(4, mem, hosts=(0, 1))


def test_a_topology_never_silently_ignores_what_it_names(world, caplog):
    """Bandwidths are not modelled (one calibrated all-to-all): setting one is a one-line error, not a plan that
    ignores it. A hardware name other than the cost model's gets the warning `place --hardware` gives: the costs
    are still the model's measurements."""
    from dataclasses import replace

    ts, model, mem = world
    for field in ("intra_node_bandwidth_gbps", "inter_node_bandwidth_gbps"):
        with pytest.raises(EmbshardError, match=f"{field}=25.0 is not used") as err:
            DeviceTopology(8, mem, hosts=(0,) * 4 + (1,) * 4, **{field: 25.0})
        assert err.value.field == field
    cpu_model = CostModel.create(replace(CostModelConfig(), hardware="cpu:AMD EPYC", element_bytes_seen=[4]),
                                 FeatureScaler.fit(ts.features()))
    planner = ComposedPlanner(Composition([CostGreedy()], [], []), cpu_model, name="greedy")
    with caplog.at_level("WARNING"):
        on_gpu = planner.plan(ts, DeviceTopology(4, mem, hardware="cuda:NVIDIA H100"), task_id="t")
    assert "measured on cpu:AMD EPYC but the topology's hardware is cuda:NVIDIA H100" in caplog.text
    # A training job that reads only the plan learns it too: the model's hardware and the warnings, in its meta
    # (plan.json's `meta`); it had them only from the log of `embshard place`.
    assert on_gpu.meta["model_hardware"] == "cpu:AMD EPYC"
    hardware_lines = [w for w in on_gpu.meta["warnings"] if "measured on" in w]
    assert len(hardware_lines) == 1 and "cuda:NVIDIA H100" in hardware_lines[0]
    caplog.clear()
    with caplog.at_level("WARNING"):
        same = planner.plan(ts, DeviceTopology(4, mem, hardware="cpu:AMD EPYC"), task_id="t")
        planner.plan(ts, DeviceTopology(4, mem), task_id="t")
    assert "measured on" not in caplog.text
    assert not [w for w in same.meta.get("warnings", []) if "measured on" in w]
    # FP16 tables: the Python API says what `place` says (it had said nothing), once per plan
    fp16 = replace(ts, bytes_per_element=np.where(np.arange(len(ts)) == 0, 2, ts.bytes_per_element))
    with caplog.at_level("WARNING"):
        half = planner.plan(fp16, DeviceTopology(4, mem), task_id="t")
    assert caplog.text.count("of a type the cost model was never measured on") == 1
    assert [w for w in half.meta["warnings"] if "never measured" in w] == [
        next(r.getMessage() for r in caplog.records if "never measured" in r.getMessage()).removeprefix("t: ")]


def test_shard_kinds_and_the_coverage_rules_of_a_placement(world):
    ts, _, mem = world
    assert Shard(0, 1).kind == "whole" and Shard(0, 1, 0, 4).kind == "column" and Shard(0, 1, row_size=3).kind == "row"
    assert Shard(0, 1) == Shard(0, 1, 0, None)
    with pytest.raises(EmbshardError, match="shard kind"):
        Shard(0, 1, kind="diagonal")
    rows, dim = int(ts.rows[0]), int(ts.dims[0])
    rest = [Shard(i, 0) for i in range(1, len(ts))]

    def check(pieces):
        Placement(ts, 4, 10**15, pieces + rest).check()

    # valid: row ranges covering the rows once, column slices covering the columns once, a replica per device
    check([Shard(0, 1, row_offset=0, row_size=rows // 3), Shard(0, 2, row_offset=rows // 3, row_size=rows - rows // 3)])
    check([Shard(0, 1, 0, 4), Shard(0, 2, 4, dim - 4)])
    check([Shard(0, d, kind="replicated") for d in range(4)])
    bad = {
        "rows 0..1 are missing": [Shard(0, 1, row_offset=1, row_size=rows - 1)],
        f"{rows - 1} of {rows} rows placed": [Shard(0, 1, row_offset=0, row_size=rows - 1)],
        "placed twice": [Shard(0, 1, row_offset=0, row_size=rows), Shard(0, 2, row_offset=rows - 1, row_size=1)],
        "mixes column and row": [Shard(0, 1, 0, 4), Shard(0, 2, row_offset=0, row_size=rows)],
        "not once on each": [Shard(0, d, kind="replicated") for d in range(3)],
        "placed whole 2 times": [Shard(0, 1), Shard(0, 2)],
        "also column-sliced": [Shard(0, 1, 0, dim, row_offset=0, row_size=rows)],
    }
    for message, pieces in bad.items():
        with pytest.raises(InfeasiblePlacementError, match=message):
            check(pieces)
    with pytest.raises(InfeasiblePlacementError, match="not placed"):
        Placement(ts, 4, 10**15, rest).check()


def test_row_and_replica_pieces_carry_their_share_of_the_lookups(world):
    from embshard.costmodel.scoring import piece_features

    ts, _, _ = world
    rows = int(ts.rows[0])
    whole, row, rep = piece_features(ts, [Shard(0, 0), Shard(0, 1, row_offset=0, row_size=rows // 4),
                                          Shard(0, 2, kind="replicated")], num_devices=8)
    assert row[0] == whole[0] and row[1] == rows // 4 and row[2] == pytest.approx(whole[2] * (rows // 4) / rows)
    assert row[3] == rows // 4 * whole[0] * ts.bytes_per_element[0] and (row[4:] == whole[4:]).all()
    assert rep[2] == pytest.approx(whole[2] / 8) and rep[3] == whole[3]


def test_every_cost_estimator_implements_the_protocol_and_scores_sums(world):
    ts, model, _ = world
    analytic = AnalyticEstimator()
    analytic.coef, analytic.batch_size = np.array([[1e-6, 0.1], [2e-6, 0.2], [1e-7, 0.05]]), 512.0
    for est in (model, CostEnsemble([model, model]), analytic):
        assert isinstance(est, CostEstimator)
        enc = est.encode(ts.features())
        both = est.totals_from_sums(enc[:2].sum(0, keepdim=True), 4)
        assert both.shape == (1,) and float(both[0]) > 0
        assert est.member_totals_from_sums(enc[:2].sum(0, keepdim=True), 4).shape == (est.num_members, 1)
    # the analytic estimator's heads are its formulas: linear in the summed bytes, one intercept per device
    enc = analytic.encode(ts.features())
    one, two = (analytic.heads_from_sums(enc[i:i + 1].sum(0), 4) for i in (0, 1))
    pair = analytic.heads_from_sums(enc[:2].sum(0), 4)
    intercept = torch.tensor(analytic.coef[:, 1], dtype=torch.float32)
    torch.testing.assert_close(pair, one + two - intercept, rtol=1e-4, atol=1e-4)
    assert float(analytic.totals_from_sums(torch.zeros(3), 4)) == 0.0  # an empty device costs nothing


def test_compositions_are_built_from_parts_and_a_custom_one_plans(world):
    ts, model, mem = world
    learned = composition("learned", PolicyNet())
    assert [p.name for p in learned.proposers][:3] == ["policy_greedy", "policy_sampled", "cost_greedy"]
    assert [type(r) for r in learned.refiners] == [LocalSearch, Splits, DominantCuts]
    assert [type(r) for r in composition("no_dominant_cut", PolicyNet()).refiners] == [LocalSearch, Splits]
    only = composition("policy_only", PolicyNet())
    assert [p.name for p in only.proposers] == ["policy_greedy"] and only.refiners == [] and only.fallbacks
    assert {"learned", "policy_only", "no_portfolio", "no_splits", "no_column_splits",
            "no_cost_greedy"} <= set(COMPOSITIONS)
    with pytest.raises(EmbshardError, match="unknown composition"):
        composition("best", None)
    # No policy at all: cost greedy and one heuristic, searched; never predicted worse than its candidates.
    custom = ComposedPlanner(Composition([CostGreedy(), Heuristic("size_greedy")], [], [LocalSearch(2)]), model,
                             name="custom", search_evaluations=2000)
    p = custom.plan(ts, DeviceTopology(4, mem), task_id="t")
    assert p.planner == "custom" and p.meta["start_candidate"] in ("cost_greedy", "size_greedy")
    assert p.meta["search_evaluations"] > 0 and p.memory_per_device().max() <= mem
    from embshard.planners.scoring import placement_costs

    assert placement_costs(model, p).max() <= min(p.meta["candidate_costs"].values()) * (1 + 1e-6)
    assert "proposers_without_plan" not in p.meta


def test_policy_imports_no_planners_or_bench_and_planners_import_no_export():
    """The direction algorithms -> types holds between these packages (every import counts, also in functions)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "components" / "embshard"
    forbidden = {"policy": ("planners", "bench", "jobs", "export"), "planners": ("export", "bench", "jobs"),
                 "costmodel": ("planners", "policy", "bench", "jobs")}
    bad = []
    for pkg, banned in forbidden.items():
        for path in (root / pkg).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom):
                    names = [node.module or ""] + [a.name for a in node.names]
                    if node.level == 2 and any(n.split(".")[0] in banned for n in names[:1]) or \
                            node.level == 2 and node.module is None and any(a.name in banned for a in node.names):
                        bad.append(f"{pkg}/{path.name}: from {'.' * node.level}{node.module or ''}")
                    elif node.level == 0 and node.module and any(node.module.startswith(f"embshard.{b}")
                                                                 for b in banned):
                        bad.append(f"{pkg}/{path.name}: from {node.module}")
    assert bad == []


def test_torchrecs_plan_is_a_proposal_that_local_search_can_refine(world):
    pytest.importorskip("torchrec")
    from embshard.planners.compose import TorchRecProposal
    from embshard.planners.scoring import placement_costs

    ts, model, mem = world
    sub = ts.subset(np.arange(12))
    planner = ComposedPlanner(Composition([TorchRecProposal("full", timeout_s=20)], [], [LocalSearch(1)]), model,
                              name="torchrec_searched", search_evaluations=3000)
    p = planner.plan(sub, 4, int(sub.size_bytes.sum()), "t")
    assert p.meta["start_candidate"] == "torchrec_full"
    assert placement_costs(model, p).max() <= p.meta["candidate_costs"]["torchrec_full"] * (1 + 1e-6)


def test_policies_registered_before_the_move_still_unpickle():
    """Versions registered before PolicyPythonModel moved to planners.registered were pickled with its old
    module path; the gate loads the champion to measure it, so an upgrade must not break that load."""
    import pickle

    from embshard.planners.registered import PolicyPythonModel

    old_reference = pickle.dumps(PolicyPythonModel, protocol=0).replace(b"embshard.planners.registered",
                                                                        b"embshard.policy.model")
    assert b"embshard.policy.model" in old_reference
    assert pickle.loads(old_reference) is PolicyPythonModel


def test_proposers_that_place_nothing_are_said(world, caplog):
    """Under tight memory the policy's rollouts placed nothing and the plan started from dim_greedy; nothing in
    the output said so (a user saw only the prediction jump from 16.6 to 22.5 ms)."""
    import logging

    from embshard.planners.compose import ComposedPlanner, Composition, Heuristic, LocalSearch

    class Nothing:
        name = "policy_greedy"

        def propose(self, problem):  # noqa: ARG002 (the Proposer signature)
            return None

    ts, model, mem = world
    planner = ComposedPlanner(Composition([Nothing(), Heuristic("size_greedy")], [], [LocalSearch(1)]), model,
                              name="custom", search_evaluations=500)
    with caplog.at_level(logging.INFO, logger="embshard.planners.compose"):
        p = planner.plan(ts, DeviceTopology(4, mem), task_id="t")
    assert p.meta["proposers_without_plan"] == ["policy_greedy"] and p.meta["start_candidate"] == "size_greedy"
    assert "t: policy_greedy placed nothing (within memory, or at all); the plan starts from size_greedy" in caplog.text
    # ... and `place`'s report says it too (an INFO log is not shown by default: a user saw "planner learned" only)
    from embshard.placement_report import device_table

    assert "note: policy_greedy placed nothing within memory; the plan starts from size_greedy" in device_table(p)
