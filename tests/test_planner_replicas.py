"""Replicas in the cost model and the planner (issue 24): a replica's predicted cost carries its all-reduce (and
no all-to-all of its outputs), as the benchmark measures it; the Splits refiner replicates a tiny very hot table
when that lowers the predicted slowest device, never when its copies do not fit, and plans stay placeable."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from embshard.bench.comm import CommModel, replica_grad_bytes
from embshard.costmodel.reference import AnalyticEstimator
from embshard.ingest.synthetic import generate_tables
from embshard.placement import Placement
from embshard.planners.learned import LearnedPlanner
from embshard.planners.scoring import TaskScorer, piece_features, placement_costs, replica_extra_ms
from embshard.tableset import TableSet
from embshard.types import DeviceTopology, Shard

D = 8


@pytest.fixture(autouse=True)
def comm_constants(monkeypatch):
    monkeypatch.setenv("EMBSHARD_COMM_BANDWIDTH_GBPS", "10")
    monkeypatch.setenv("EMBSHARD_COMM_LATENCY_US", "20")


def analytic() -> AnalyticEstimator:
    """A bandwidth model whose all-to-all runs at the 10 GB/s the all-reduce is priced with (1e-7 ms per byte)."""
    est = AnalyticEstimator()
    est.batch_size = 65536.0
    est.coef = np.array([[2e-9, 0.05], [4e-9, 0.05], [1e-7, 0.05]])
    return est


def tiny_hot(n: int = 24, seed: int = 3, rows: int = 500) -> tuple[TableSet, int]:
    """Synthetic tables plus one tiny table (`rows` rows) with 60x the lookup work of the hottest other one."""
    ts = TableSet.from_frame(generate_tables(n, seed=seed, bins_batch_size=2048))
    t = int(np.argmin(ts.size_bytes))
    rows_a, pooling = ts.rows.copy(), ts.pooling_factor.copy()
    rows_a[t] = rows
    pooling[t] = 60 * float(np.max(ts.dims * ts.pooling_factor)) / float(ts.dims[t])
    size = ts.size_bytes.copy()
    size[t] = rows * int(ts.dims[t]) * int(ts.bytes_per_element[t])
    return replace(ts, rows=rows_a, pooling_factor=pooling, size_bytes=size), t


def test_the_scorer_adds_the_allreduce_and_drops_the_replicas_all_to_all():
    ts, t = tiny_hot()
    model = analytic()
    shards = [Shard(i, i % D) for i in range(len(ts)) if i != t] + [Shard(t, d, kind="replicated") for d in range(D)]
    extra = replica_extra_ms(model, ts, shards, D)
    assert extra is not None and (extra[:-D] == 0).all()
    ring = CommModel(20e-6, 10e9, "given").allreduce_ms(replica_grad_bytes(int(ts.rows[t]), int(ts.dims[t])), D)
    # the analytic model's all-to-all of the table's dim, fwd + bwd head: batch x dim x bytes x (D-1)/D x 1e-9
    a2a = 65536.0 * int(ts.dims[t]) * 4 * (D - 1) / D * 1e-7
    assert extra[-D:] == pytest.approx(ring - a2a, rel=1e-4)
    pl = Placement(ts, D, 1 << 40, shards, task_id="t")
    feats = piece_features(ts, shards, D)
    base = TaskScorer(model, feats, D).device_costs(pl.device_of_shards())
    assert placement_costs(model, pl) == pytest.approx(base + ring - a2a, rel=1e-5)
    # an FP16 table's replica all-reduces its gradient in its weights' type: half the bytes of an FP32 one's
    bpe, size = ts.bytes_per_element.copy(), ts.size_bytes.copy()
    bpe[t], size[t] = 2, int(ts.rows[t]) * int(ts.dims[t]) * 2
    half = replace(ts, bytes_per_element=bpe, size_bytes=size)
    ring16 = CommModel(20e-6, 10e9, "given").allreduce_ms(replica_grad_bytes(int(ts.rows[t]), int(ts.dims[t]), 2), D)
    # (this analytic model prices the all-to-all it takes back by the table's bytes too: half of it)
    assert ring16 < ring and replica_extra_ms(model, half, shards, D)[-D:] == pytest.approx(ring16 - a2a / 2,
                                                                                            rel=1e-4)


def test_replica_costs_asked_again_from_the_task_cache_are_the_same():
    """The split search keeps each table's comm heads for the task (search.CutCache) and asks about many candidate
    tables at once (replica_extras): the same ms as asking about each table's replicas alone, without a cache."""
    from embshard.planners.scoring import replica_extras

    ts, t = tiny_hot()
    model = analytic()
    tabs = np.array([t, 0, 3, t, 5], dtype=np.int64)
    cache: dict = {}
    first = replica_extras(model, ts, tabs[:3], ts.dims[tabs[:3]], D, cache=cache)
    again = replica_extras(model, ts, tabs, ts.dims[tabs], D, cache=cache)  # 5 new, the others cached
    alone = [replica_extra_ms(model, ts, [Shard(int(x), d, kind="replicated") for d in range(D)], D)[0]
             for x in tabs]
    assert again[:3] == pytest.approx(first, rel=1e-12)
    assert again == pytest.approx(np.array(alone), rel=1e-9)
    ring = CommModel(20e-6, 10e9, "given")
    grads = np.array([replica_grad_bytes(int(ts.rows[x]), int(ts.dims[x])) for x in tabs])
    assert ring.allreduce_ms(grads, D) == pytest.approx([ring.allreduce_ms(float(g), D) for g in grads], rel=1e-15)
    assert (ring.allreduce_ms(grads, 1) == 0).all() and ring.allreduce_ms(np.zeros(2), D).tolist() == [0.0, 0.0]


def test_a_recorded_calibration_prices_the_allreduce():
    from embshard.costmodel.scoring import replica_comm_model

    class WithConfig:
        class config:  # noqa: N801 - a stand-in for CostModelConfig
            comm_calibration = {"latency_s": 5e-6, "bandwidth_Bps": 2e9, "source": "calibrated:gloo-2proc"}

    m = replica_comm_model(WithConfig(), D)
    assert (m.latency_s, m.bandwidth_Bps) == (5e-6, 2e9)


def test_the_refiner_replicates_a_tiny_very_hot_table():
    ts, t = tiny_hot()
    topo = DeviceTopology(D, int(ts.size_bytes.sum()))
    model = analytic()
    plans = {c: LearnedPlanner(None, model, composition_name=c, search_evaluations=6000).plan(ts, topo)
             for c in ("no_policy", "no_replicas")}
    p = plans["no_policy"]
    p.check()
    assert sorted(s.device for s in p.shards if s.kind == "replicated" and s.table == t) == list(range(D))
    assert p.meta["replicas"] >= 1
    assert not any(s.kind == "replicated" for s in plans["no_replicas"].shards)
    assert placement_costs(model, p).max() < placement_costs(model, plans["no_replicas"]).max()


def test_no_replica_when_its_copies_do_not_fit():
    """The hot table is the candidate with room for its copies, and no candidate when one other device lacks it."""
    from embshard.planners.search import SearchState, replica_candidate

    ts, t = tiny_hot(rows=400_000)
    model = analytic()
    shards = [Shard(i, i % D) for i in range(len(ts))]
    feats = piece_features(ts, shards, D)
    assign = np.array([s.device for s in shards])
    used = np.bincount(assign, weights=ts.size_bytes, minlength=D)
    b = int(assign[t])
    on_b = np.flatnonzero(assign == b)
    roomy = SearchState(TaskScorer(model, feats, D), ts.size_bytes.copy(), int(used.max() + ts.size_bytes[t]), assign)
    single = roomy.scorer.single_costs()[on_b]
    assert replica_candidate(ts, shards, roomy, model, on_b, single) == t
    tight_mem = int(max(used[d] for d in range(D) if d != b) + ts.size_bytes[t] - 1)
    tight = SearchState(TaskScorer(model, feats, D), ts.size_bytes.copy(), max(tight_mem, int(used[b])), assign)
    assert replica_candidate(ts, shards, tight, model, on_b, single) != t


def test_a_table_never_looked_up_is_no_replica_candidate():
    """A trace's unread table (pooling 0) was replicated on all 8 devices: a replica saves lookups, and it has
    none; the model's price of an empty table's fixed cost only multiplies."""
    from dataclasses import replace

    from embshard.planners.search import SearchState, replica_candidate

    ts, t = tiny_hot()
    model = analytic()
    shards = [Shard(i, i % D) for i in range(len(ts))]
    assign = np.array([s.device for s in shards])
    on_t = np.flatnonzero(assign == assign[t])

    def candidate(tables):
        feats = piece_features(tables, shards, D)
        state = SearchState(TaskScorer(model, feats, D), tables.size_bytes.copy(), int(tables.size_bytes.sum()),
                            assign)
        return replica_candidate(tables, shards, state, model, on_t, state.scorer.single_costs()[on_t])

    assert candidate(ts) == t
    pooling = ts.pooling_factor.copy()
    pooling[t] = 0.0
    assert candidate(replace(ts, pooling_factor=pooling)) != t


def test_baselines_never_replicate():
    from embshard.planners.baselines import make_baseline

    ts, _ = tiny_hot()
    for name in ("size_greedy", "lookup_greedy"):
        assert not any(s.kind == "replicated" for s in make_baseline(name).plan(ts, D, int(ts.size_bytes.sum())).shards)


def test_place_names_replicated_tables_apart_from_cut_ones_and_counts_them_apart():
    """`place`'s report: a replicated table is not "cut" (it is whole on every device), each device row counts its
    pieces of cut tables and its replicas apart, and a long list says how many more there are."""
    from embshard.placement_report import device_table, split_summary

    ts = TableSet.from_frame(generate_tables(20, seed=3, bins_batch_size=512))
    ts = replace(ts, dims=np.full(20, 16), size_bytes=ts.rows * 16 * ts.bytes_per_element)
    shards = [Shard(0, 0, col_offset=0, col_size=8), Shard(0, 1, col_offset=8, col_size=8)]
    shards += [Shard(t, d, kind="replicated") for t in (1, 2) for d in range(2)]
    shards += [Shard(t, t % 2) for t in range(3, 20)]
    p = Placement(ts, 2, int(ts.size_bytes.sum()), shards)
    p.check()
    line = split_summary(p)
    assert line.startswith(f"cut tables (1): {ts.table_ids[0]} in 2 column slices; ")
    assert line.endswith(f"replicated on every device (2): {ts.table_ids[1]}, {ts.table_ids[2]}")
    rows = device_table(p).splitlines()
    assert rows[1].split()[:4] == ["device", "tables", "pieces", "replicas"]
    assert rows[2].split()[2:4] == ["1", "2"]  # device 0: one column slice, two replicas
    many = Placement(ts, 2, int(ts.size_bytes.sum()), [Shard(t, d, kind="replicated") for t in range(20)
                                                         for d in range(2)])
    assert split_summary(many, limit=12).endswith(" and 8 more (plan.json lists them)")
