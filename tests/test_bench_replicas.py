"""Replicas measured on real kernels (issue 24): a device holding a replica looks up its B/D samples of the
table in its full copy, sends no all-to-all for it, and all-reduces its gradient (bench.comm); the ruler and
measure_placement measure placements holding replicas."""
from __future__ import annotations

import numpy as np
import pytest

from embshard.bench import comm, inputs, runner
from embshard.bench.runner import MeasureSettings
from embshard.placement import Placement
from embshard.tableset import TableSet
from embshard.types import Shard

FAST = dict(batch_size=512, warmup=2, iterations=10, comm_bandwidth_gbps=10.0, comm_latency_us=20.0)
D = 4


@pytest.fixture(scope="module")
def ts():
    from embshard.ingest.synthetic import generate_tables

    return TableSet.from_frame(generate_tables(12, seed=5, bins_batch_size=2048))


@pytest.fixture(scope="module")
def cfg():
    c = MeasureSettings(**FAST).config()
    yield c
    runner.close_config(c)


def test_keep_samples_keeps_the_first_share():
    idx = np.array([5, 1, 9, 3, 7, 2], dtype=np.int64)
    lens = np.array([2, 0, 3, 1], dtype=np.int64)
    got_i, got_l = inputs.keep_samples(idx, lens, 2)
    assert got_i.tolist() == [5, 1] and got_l.tolist() == [2, 0, 0, 0]
    assert inputs.replica_share(2048, 8) == 256 and inputs.replica_share(10, 4) == 3


def test_allreduce_model_is_a_ring():
    m = comm.CommModel(latency_s=10e-6, bandwidth_Bps=1e9, source="given")
    g = comm.replica_grad_bytes(1000, 64)
    assert g == 1000 * 64 * 4
    # a data-parallel table's gradient has its weights' type: an FP16 replica all-reduces half the bytes
    assert comm.replica_grad_bytes(1000, 64, 2) == 1000 * 64 * 2
    assert comm.replica_grad_bytes(np.array([1000, 10]), np.array([64, 8]), np.array([2, 4])).tolist() == [
        1000 * 64 * 2, 10 * 8 * 4]
    assert m.allreduce_ms(g, 4) == pytest.approx(1e3 * (10e-6 + 2 * g * 3 / 4 / 1e9))
    assert m.allreduce_ms(g, 1) == 0.0
    # a W-rank group moving what a D-device ring moves per device
    assert comm.allreduce_numel(g, 8, 2) * 4 * 2 * (1 / 2) == pytest.approx(2 * g * 7 / 8, rel=1e-3)


def test_replica_shard_uses_its_share_of_the_batch_and_pays_the_allreduce(ts, cfg):
    t = int(np.argmax(ts.pooling_factor))
    whole = runner.shard_inputs(ts, [t], cfg)
    rep = runner.shard_inputs(ts, [t], cfg, replicas=[D])
    share = inputs.replica_share(cfg.batch_size, D)
    lens_w = [ln for _, ln in whole.batches]
    lens_r = [ln for _, ln in rep.batches]
    assert all(int(ln[share:].sum()) == 0 for ln in lens_r)  # only the device's ceil(B/D) samples look up
    assert rep.rows == whole.rows and rep.dims == whole.dims  # the full table
    ratio = sum(int(ln.sum()) for ln in lens_r) / sum(int(ln.sum()) for ln in lens_w)
    assert 0.5 / D < ratio < 2.0 / D
    mw = runner.measure_shard(ts, [t], cfg, num_devices=D)
    mr = runner.measure_shard(ts, [t], cfg, num_devices=D, replicas=[D])
    grad = comm.replica_grad_bytes(int(ts.rows[t]), int(ts.dims[t]), int(ts.bytes_per_element[t]))
    assert mr["allreduce_ms"] == pytest.approx(cfg.comm.allreduce_ms(grad, D))
    # an FP16 table's replica all-reduces a gradient of its own type: half the bytes
    from dataclasses import replace

    bpe, size = ts.bytes_per_element.copy(), ts.size_bytes.copy()
    bpe[t], size[t] = 2, int(ts.rows[t]) * int(ts.dims[t]) * 2
    m16 = runner.measure_shard(replace(ts, bytes_per_element=bpe, size_bytes=size), [t], cfg, num_devices=D,
                               replicas=[D])
    half = comm.replica_grad_bytes(int(ts.rows[t]), int(ts.dims[t]), 2)
    assert half == grad / 2 and m16["allreduce_ms"] == pytest.approx(cfg.comm.allreduce_ms(half, D))
    assert mr["fwd_comm_ms"] == 0.0  # no all-to-all of a replica's outputs
    assert mr["bwd_comm_ms"] == pytest.approx(mr["allreduce_ms"])
    assert mw["fwd_comm_ms"] > 0 and mw.get("allreduce_ms", 0.0) == 0.0
    # with another table beside it, only that table's dim is all-to-all'd
    other = (t + 1) % len(ts.table_ids)
    both = runner.measure_shard(ts, [t, other], cfg, num_devices=D, replicas=[D, 0])
    assert both["fwd_comm_ms"] == pytest.approx(cfg.comm.time_ms(cfg.batch_size, int(ts.dims[other]), D))


def _replica_placement(ts, t: int) -> Placement:
    others = [i for i in range(len(ts.table_ids)) if i != t]
    shards = [Shard(i, k % D) for k, i in enumerate(others)] + [Shard(t, d, kind="replicated") for d in range(D)]
    return Placement(ts, D, 1 << 40, shards, task_id="rep")


def test_placements_with_replicas_measure_and_rule(ts):
    t = int(np.argmin(ts.rows))
    pl = _replica_placement(ts, t)
    pl.check()
    df = runner.measure_placement(pl, MeasureSettings(**FAST))
    assert len(df) == D and (df["allreduce_ms"] > 0).all() and (df["total_ms"] > 0).all()
    from embshard.ruler import Entry, measure_rounds, shard_keys

    whole = Placement(ts, D, 1 << 40, [Shard(s.table, s.device) for s in pl.shards if s.kind != "replicated"]
                      + [Shard(t, 0)], task_id="rep")
    e1, e2 = Entry("replica", pl), Entry("whole", whole)
    assert shard_keys(e1)[0] != shard_keys(e2)[0]  # a replica is another shard than the whole table
    costs, dev = measure_rounds([e1, e2], 2, MeasureSettings(**FAST))
    assert costs.shape == (2, 2) and (costs > 0).all()


def test_plan_json_round_trip_of_a_replica_measures(ts, tmp_path):
    from embshard.export import plan_json

    pl = _replica_placement(ts, int(np.argmin(ts.rows)))
    plan_json.write_plan_json(pl, tmp_path / "plan.json")
    back = plan_json.placement_from_plan(plan_json.read_plan_json(tmp_path / "plan.json"), ts)
    assert sorted((s.table, s.device, s.kind) for s in back.shards) == sorted(
        (s.table, s.device, s.kind) for s in pl.shards)
    df = runner.measure_placement(back, MeasureSettings(**FAST))
    assert (df["allreduce_ms"] > 0).all()


def test_measured_allreduce_among_a_comm_group(ts):
    """With a comm group (gloo, 2 ranks) the replica's all-reduce is a real all_reduce, timed."""
    t = int(np.argmin(ts.rows))
    c = MeasureSettings(batch_size=256, warmup=1, iterations=10, comm_ranks=2).config()
    try:
        assert c.comm_source == "measured"
        m = runner.measure_shard(ts, [t], c, num_devices=D, replicas=[D])
    finally:
        runner.close_config(c)
    assert m["allreduce_ms"] > 0 and m["fwd_comm_ms"] == 0.0
    assert m["bwd_comm_ms"] == pytest.approx(m["allreduce_ms"])


def test_plan_shards_replicate_small_hot_tables_and_bench_measures_them(tmp_path):
    """The plan sampler replicates a plan's hottest small table sometimes; the benchmark measures those shards
    (B/D samples, the all-reduce) and the cost data trains on them as planners score them (1/D of the lookups;
    the comm target as if the replica sent its outputs: the scorer adds the all-reduce back)."""
    import pandas as pd

    from embshard import schemas
    from embshard.costmodel.data import _piece_rows, comm_targets
    from embshard.ingest.synthetic import generate_tables
    from embshard.jobs.bench import run
    from embshard.jobs.shards import plan_shards

    tdf = generate_tables(120, seed=5, bins_batch_size=2048)
    big = TableSet.from_frame(tdf)
    a = plan_shards(big, 60, memory_bytes_per_device=2**40, seed=4)
    reps = a[a["origin"].str.contains(r"\+replica")]
    assert len(reps) and reps["replicas"].map(lambda v: v is not None and max(v) == 1).all()
    assert a[~a["origin"].str.contains(r"\+replica")]["replicas"].map(lambda v: v is None).all()
    for _, r in reps.iterrows():
        for tid, flag in zip(r["table_ids"], r["replicas"]):
            if flag == 1:
                assert big.size_bytes[big.index_of([tid])[0]] <= 64 * 2**20
    # measure a few shards with replicas and a few without
    some = pd.concat([reps.head(3), a[~a["origin"].str.contains(r"\+replica")].head(2)], ignore_index=True)
    schemas.write(tdf, tmp_path / "tables.parquet", "tables")
    schemas.write(some, tmp_path / "shards.parquet", "shards")
    parts = run(str(tmp_path / "tables.parquet"), str(tmp_path / "shards.parquet"), str(tmp_path / "run"),
                settings=MeasureSettings(**FAST), progress=False)
    cdf = pd.concat([schemas.read(p, "costs") for p in parts], ignore_index=True)
    with_rep = cdf[cdf["replicas"].map(lambda v: v is not None and max(v) == 1)]
    assert len(with_rep) == 3 and (with_rep["allreduce_ms"] > 0).all() and (with_rep["replica_a2a_ms"] > 0).all()
    targets = comm_targets(cdf)
    shards = [big.index_of(list(v)) for v in cdf["table_ids"]]
    features, _, is_split = _piece_rows(tdf, cdf, shards)
    for s in range(len(cdf)):
        row = cdf.iloc[s]
        comm = row["fwd_comm_ms"] + row["bwd_comm_ms"]
        if row["replicas"] is not None and max(row["replicas"]) == 1:
            assert targets[s] == pytest.approx(comm - row["allreduce_ms"] + row["replica_a2a_ms"])
            k = list(row["replicas"]).index(1)
            t = big.index_of([row["table_ids"][k]])[0]
            assert features[shards[s][k]][2] == pytest.approx(big.pooling_factor[t] / int(row["num_devices"]))
            assert is_split[s]
        else:
            assert targets[s] == pytest.approx(comm)


def test_placement_shards_carry_replicas():
    import pandas as pd

    from embshard.bench.sampler import piece_key, placement_shards, replica_list

    pdf = pd.DataFrame({"task_id": "t", "table_id": ["a", "b", "b", "c"], "device": [0, 0, 1, 1],
                        "kind": ["whole", "replicated", "replicated", "whole"], "planner": "p"})
    sh = placement_shards(pdf, 2)
    assert sh["replicas"].tolist() == [[0, 1], [1, 0]]
    assert replica_list(sh, 0) == [0, 2] and replica_list(sh, 1) == [2, 0]
    whole = placement_shards(pdf.assign(kind="whole", table_id=["a", "b", "x", "c"]), 2)
    assert piece_key(sh.iloc[0]) != piece_key(whole.iloc[0])
