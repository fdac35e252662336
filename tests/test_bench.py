"""Benchmark stage: real FBGEMM / torch kernels on tiny shards, real Parquet parts, chunk resumability."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pandas as pd
import pytest

from embshard import schemas
from embshard.bench import backends, inputs, measure_placement, runner
from embshard.bench.runner import MeasureSettings
from embshard.bench.sampler import piece_key, placement_shards, random_shards
from embshard.errors import BackendUnavailableError, EmbshardError
from embshard.features import access_bins
from embshard.jobs.bench import run
from embshard.jobs.shards import plan_shards
from embshard.placement import Placement
from embshard.tableset import TableSet

FAST = dict(batch_size=256, warmup=2, iterations=10, comm_bandwidth_gbps=10.0, comm_latency_us=20.0)
SETTINGS = MeasureSettings(**FAST)


@pytest.fixture(scope="module")
def tables_df():
    from embshard.ingest.synthetic import generate_tables

    return generate_tables(30, seed=3, bins_batch_size=2048)


@pytest.fixture(scope="module")
def ts(tables_df):
    return TableSet.from_frame(tables_df)


@pytest.fixture()
def tables_path(tmp_path, tables_df):
    p = tmp_path / "tables.parquet"
    schemas.write(tables_df, p, "tables")
    return str(p)


def _heavy(ts, k=2):
    """k tables with real work per sample (pooling >= 3, dim >= 16), largest lookups x dim first."""
    score = np.where((ts.pooling_factor >= 3) & (ts.dims >= 16), ts.pooling_factor * ts.dims, 0)
    return list(np.argsort(-score)[:k])


def test_random_shards_are_deterministic_and_sized():
    ids = [f"t{i}" for i in range(40)]
    a = random_shards(ids, 50, seed=7)
    b = random_shards(ids, 50, seed=7)
    assert a["table_ids"].map(tuple).tolist() == b["table_ids"].map(tuple).tolist()
    sizes = a["table_ids"].map(len)
    assert sizes.min() >= 1 and sizes.max() <= 15 and sizes.nunique() > 5
    assert all(len(set(t)) == len(t) for t in a["table_ids"])
    assert a["sample_id"].is_unique and (a["origin"] == "random").all()
    assert random_shards(ids[:3], 5, seed=0)["table_ids"].map(len).max() <= 3


def test_placement_shards_one_per_non_empty_device(ts):
    sub = ts.subset(range(6))
    pl = Placement.from_assignment(sub, [0, 0, 2, 2, 2, 0], 4, 2**40, planner="size_greedy", task_id="task7")
    df = placement_shards(pl.to_frame(), 4)
    assert len(df) == 2  # devices 1 and 3 are empty
    assert sorted(map(len, df["table_ids"])) == [3, 3]
    assert (df["origin"] == "placement:size_greedy").all() and (df["num_devices"] == 4).all()
    with pytest.raises(EmbshardError, match="device 2 of only 2"):
        placement_shards(pl.to_frame(), 2)


def test_plan_shards_are_devices_of_real_plans_and_their_neighbours():
    from embshard.ingest.synthetic import generate_tables

    big = TableSet.from_frame(generate_tables(220, seed=5, bins_batch_size=2048))
    a = plan_shards(big, 60, memory_bytes_per_device=2**40, seed=4)
    b = plan_shards(big, 60, memory_bytes_per_device=2**40, seed=4)
    assert a["table_ids"].map(tuple).tolist() == b["table_ids"].map(tuple).tolist()  # a pure function of the seed
    assert len(a) == 60 and a["sample_id"].is_unique
    assert not a.apply(piece_key, axis=1).duplicated().any()  # a set of pieces (whole tables or split) once
    sizes = a["table_ids"].map(len)
    # Crowded devices as in 100-200-table tasks, never more than the cap, never empty.
    assert sizes.min() >= 1 and sizes.max() <= 60 and sizes.max() > 15
    assert set(a["num_devices"]) <= {2, 4, 8, 16} and a["num_devices"].nunique() >= 3
    origins = a["origin"].str.removeprefix("plan:")
    assert origins.str.endswith("+move").any() and (~origins.str.endswith("+move")).any()
    assert set(origins.str.removesuffix("+move").str.removesuffix("+replica").str.removesuffix("+split")) <= {
        "dim_greedy", "size_greedy", "lookup_greedy", "size_lookup_greedy"}
    # Tables that fit no device give no plan: one clear error, not an empty list.
    with pytest.raises(EmbshardError, match="memory"):
        plan_shards(big, 5, memory_bytes_per_device=1, seed=0)


def test_bin_sampling_reproduces_the_access_distribution(ts):
    rng = np.random.default_rng(0)
    for i in range(len(ts)):
        rows = int(ts.rows[i])
        if rows < 50_000:  # small tables saturate: all rows are hot, bins cannot be matched
            continue
        stride = inputs._stride(rows, rng)
        idx = inputs.sample_from_bins(20_000, ts.bins[i], rows, rng, stride)
        assert len(idx) == 20_000 and idx.min() >= 0 and idx.max() < rows
        got = access_bins(idx)
        # The same fraction of cold (count-1) ids and the same hot tail, within sampling tolerance.
        assert abs(got[0] - ts.bins[i][0]) < 0.1, (i, got[:4], ts.bins[i][:4])
        assert abs(np.dot(got, np.arange(17)) - np.dot(ts.bins[i], np.arange(17))) < 0.6


def test_row_cap_keeps_small_tables_and_fits_budget():
    rows, dims = np.array([10, 1_000, 10**8]), np.array([8, 8, 64])
    assert inputs.row_cap(rows, dims, 10**12) is None
    cap = inputs.row_cap(rows, dims, 10**6)
    assert 1_000 < cap < 10**8
    assert (np.minimum(rows, cap) * dims).sum() * 4 <= 10**6 < (np.minimum(rows, cap + 1) * dims).sum() * 4


def test_fused_costs_positive_and_two_tables_cost_more(ts):
    cfg = runner.make_config(SETTINGS.replace(backend="fbgemm"))
    assert cfg.backend == "fbgemm" and cfg.timer == "thread_cpu" and cfg.threads == 1
    a, b = _heavy(ts)
    total: dict[str, float] = {}
    # The best of 3 interleaved measurements each: on a busy machine one measurement of b alone had read above
    # a and b fused (1.21 against 1.11 ms; thread CPU time still moves with the caches other processes share).
    for _ in range(3):
        for key, members in {"a": [a], "b": [b], "ab": [a, b]}.items():
            m = runner.measure_shard(ts, members, cfg, num_devices=4)
            assert m["fwd_compute_ms"] > 0 and m["bwd_compute_ms"] > 0 and m["fwd_comm_ms"] > 0
            total[key] = min(total.get(key, float("inf")), m["fwd_compute_ms"] + m["bwd_compute_ms"])
    assert total["ab"] > max(total["a"], total["b"]), total


def test_cpu_builds_recycle_freed_memory_in_the_heap():
    import platform
    import subprocess

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt is glibc's")
    # Process-wide, so in fresh interpreters: is a 64 MiB block served from the heap (recycled) or by mmap?
    code = ("import sys, torch; from embshard.bench import backends\n"
            "if sys.argv[1] == 'build': backends.build('fbgemm', [1000, 50], [8, 16], 'cpu')\n"
            "t = torch.empty(64 * 2**20, dtype=torch.uint8)\n"
            "lo, hi = 0, 0\n"
            "for line in open('/proc/self/maps'):\n"
            "    if line.rstrip().endswith('[heap]'):\n"
            "        lo, hi = (int(x, 16) for x in line.split()[0].split('-'))\n"
            "print(lo <= t.data_ptr() < hi)\n")

    def in_heap(mode):
        return subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True,
                              check=True).stdout.split()[-1] == "True"
    assert not in_heap("none")   # glibc's default: large blocks are mmap'd and unmapped when freed
    assert in_heap("build")      # after a CPU build: from the heap, whose freed pages stay mapped for the next


def test_torch_backend_runs_on_cpu_with_mixed_dims(ts):
    cfg = runner.make_config(SETTINGS.replace(backend="torch"))
    members = _heavy(ts, 4)
    assert len({int(ts.dims[i]) for i in members}) >= 2  # exercises one fused call per dim
    m = runner.measure_shard(ts, members, cfg, num_devices=8)
    assert cfg.backend == "torch" and m["fwd_compute_ms"] > 0 and m["bwd_compute_ms"] > 0
    # Forward of the torch op returns the FBGEMM layout (B, sum dims).
    dims = [int(ts.dims[i]) for i in members]
    op = backends.TorchShard([100] * len(dims), dims, "cpu")
    rng = np.random.default_rng(0)
    per_table = [(rng.integers(0, 100, 2 * 5), np.full(5, 2)) for _ in dims]
    out = op.forward(op.prepare(per_table, "cpu"))
    assert tuple(out.shape) == (5, sum(dims))


def test_backend_selection_and_forced_backend_errors(monkeypatch):
    assert backends.select_backend("auto", "cpu") == "fbgemm"
    assert backends.select_backend("torch", "cpu") == "torch"
    with pytest.raises(BackendUnavailableError, match="CUDA is not available"):
        backends.select_backend("auto", "cuda")
    with pytest.raises(EmbshardError, match="unknown backend"):
        backends.select_backend("tpu", "cpu")
    # FBGEMM missing: the import system refuses the modules (None in sys.modules), as on a torch-only host.
    monkeypatch.setitem(sys.modules, "fbgemm_gpu", None)
    monkeypatch.setitem(sys.modules, backends._TBE_MODULE, None)
    with pytest.raises(BackendUnavailableError, match="backend 'fbgemm' was forced") as err:
        backends.select_backend("fbgemm", "cpu")
    assert "fbgemm-gpu-cpu" in str(err.value)
    assert backends.select_backend("auto", "cpu") == "torch"


def test_oversized_shard_is_scaled_and_oversized_batch_refused(ts):
    big = int(np.argmax(ts.rows * ts.dims))
    cfg = runner.make_config(SETTINGS.replace(backend="fbgemm", max_shard_gb=0.01))
    m = runner.measure_shard(ts, [big], cfg, num_devices=4)
    assert 0 < m["row_scale"] < 1 and m["fwd_compute_ms"] > 0
    cfg = runner.make_config(SETTINGS.replace(backend="fbgemm", max_shard_gb=0.001, batch_size=200_000))
    with pytest.raises(EmbshardError, match="lower --batch-size"):
        runner.measure_shard(ts, _heavy(ts, 3), cfg, num_devices=4)


def test_a_per_table_cap_keeps_a_tables_rows_whatever_shares_its_shard(ts):
    """--max-table-gb: a large table keeps the same rows alone and beside other large tables (the shard's shared
    cap leaves it fewer rows when crowded)."""
    big = [int(i) for i in np.argsort(-(ts.rows * ts.dims))[:3]]
    row_bytes = int(ts.dims[big[0]]) * 4
    cap_gb = min(int(ts.rows[big[0]]) * row_bytes / 2, 2**26) / runner.GiB  # under the largest table's weights
    cfg = runner.make_config(SETTINGS.replace(backend="fbgemm", max_table_gb=cap_gb))
    alone = runner.shard_inputs(ts, big[:1], cfg)
    crowded = runner.shard_inputs(ts, big, cfg)
    assert alone.rows[0] == crowded.rows[0] == int(cap_gb * runner.GiB) // row_bytes < int(ts.rows[big[0]])
    assert all(r <= max(int(cap_gb * runner.GiB) // (int(ts.dims[t]) * 4), 1) for r, t in zip(crowded.rows, big))
    # The shard's own cap still binds beyond that (water-filling), and a GPU-style config has no per-table cap.
    tight = runner.make_config(SETTINGS.replace(backend="fbgemm", max_table_gb=cap_gb, max_shard_gb=cap_gb / 4))
    assert sum(r * int(ts.dims[t]) * 4 for r, t in zip(runner.shard_inputs(ts, big, tight).rows, big)) \
        <= cap_gb / 4 * runner.GiB
    assert runner.resolve_settings(SETTINGS)["max_table_gb"] is None  # off by default
    shared = runner.make_config(SETTINGS.replace(backend="fbgemm", max_shard_gb=cap_gb))
    assert runner.shard_inputs(ts, big, shared).rows[0] < runner.shard_inputs(ts, big[:1], shared).rows[0]


def test_costs_measured_with_a_per_table_cap_are_not_resumed_without_it(tables_path, tmp_path):
    """The per-table cap is in the costs folder's fingerprint: a rerun without it is refused, never mixed."""
    out = str(tmp_path / "run")
    run(tables_path, "random:2", out, SETTINGS.replace(max_table_gb=0.001), max_tables=2, progress=False)
    with pytest.raises(EmbshardError, match="other settings") as err:
        run(tables_path, "random:2", out, SETTINGS, max_tables=2, progress=False)
    assert "max_table_gb" in str(err.value)


def test_measure_placement_one_row_per_device(ts):
    sub = ts.subset(_heavy(ts, 4))
    pl = Placement.from_assignment(sub, [0, 0, 2, 2], 3, 2**40, task_id="t")
    pl.shards[3] = type(pl.shards[3])(3, 2, col_offset=0, col_size=4)  # a column slice: measured at dim 4
    df = measure_placement(pl, SETTINGS)
    assert df["device"].tolist() == [0, 1, 2]
    assert df.loc[1, "total_ms"] == 0 and df.loc[1, "table_ids"] == []
    assert (df.loc[[0, 2], ["fwd_compute_ms", "bwd_compute_ms", "fwd_comm_ms", "total_ms"]] > 0).all().all()
    assert (df["comm_source"] == "model").all()


def test_run_writes_parts_and_rerun_skips_them(tables_path, tmp_path):
    out = str(tmp_path / "run")
    parts = run(tables_path, "random:5", out, SETTINGS, num_chunks=2, max_tables=4, progress=False)
    assert [os.path.basename(p) for p in parts] == ["part-00000-of-00002.parquet", "part-00001-of-00002.parquet"]
    costs = schemas.read(os.path.join(out, "costs"), "costs")
    assert len(costs) == 5 and costs["sample_id"].is_unique
    assert (costs["fwd_compute_ms"] > 0).all() and (costs["bwd_compute_ms"] > 0).all()
    assert set(costs["chunk"]) == {0, 1} and (costs["comm_source"] == "model").all()
    assert (costs["backend"] == "fbgemm").all() and costs["hardware"].str.startswith("cpu:").all()
    assert not os.path.exists(os.path.join(out, "costs", ".partial", "part-00000-of-00002"))
    before = costs.set_index("sample_id")["measured_at"]
    again = run(tables_path, "random:5", out, SETTINGS, num_chunks=2, max_tables=4, progress=False)
    assert again == parts
    after = schemas.read(os.path.join(out, "costs"), "costs").set_index("sample_id")["measured_at"]
    assert after.equals(before)  # nothing re-measured
    with pytest.raises(EmbshardError, match="2-chunk run, not 3"):
        run(tables_path, "random:5", out, SETTINGS, num_chunks=3, chunk=0, progress=False)


def test_a_resumed_run_measures_a_corrupted_chunk_again(tables_path, tmp_path, caplog):
    """Writes are atomic, but a disk or a hand edit can break a finished part or a measured shard: the rerun (the
    fix the readers' errors give) measures those again instead of trusting them; the other chunk is kept."""
    import logging

    import pyarrow.parquet as pq

    out = str(tmp_path / "run")
    kw = dict(settings=SETTINGS, num_chunks=2, max_tables=4, progress=False)
    parts = run(tables_path, "random:5", out, **kw)
    before = schemas.read(os.path.join(out, "costs"), "costs").set_index("sample_id")["measured_at"]
    with open(parts[1], "r+b") as f:
        f.truncate(100)
    with pytest.raises(EmbshardError, match="part-00001-of-00002"):
        schemas.read(os.path.join(out, "costs"), "costs")
    with caplog.at_level(logging.WARNING):
        assert run(tables_path, "random:5", out, **kw) == parts
    assert "finished chunk 1 cannot be read" in caplog.text
    after = schemas.read(os.path.join(out, "costs"), "costs").set_index("sample_id")["measured_at"]
    assert len(after) == 5
    chunk0 = [i for i in before.index if i in set(pq.read_table(parts[0]).column("sample_id").to_pylist())]
    assert after[chunk0].equals(before[chunk0])  # the readable chunk was not measured again
    # A part without a column is named (not the folder, not 'NaN in row ...').
    table = pq.read_table(parts[1])
    pq.write_table(table.drop_columns(["bwd_compute_ms"]), parts[1])
    with pytest.raises(EmbshardError, match="part-00001-of-00002.parquet: field 'bwd_compute_ms': missing column"):
        schemas.read(os.path.join(out, "costs"), "costs")


def test_crash_mid_chunk_loses_nothing_and_duplicates_nothing(tables_path, tmp_path, monkeypatch):
    out = str(tmp_path / "run")
    kw = dict(settings=SETTINGS, num_chunks=1, chunk=0, max_tables=3, progress=False)
    monkeypatch.setenv("EMBSHARD_BENCH_FAIL_AFTER", "3")
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(tables_path, "random:6", out, **kw)
    partial = os.path.join(out, "costs", ".partial", "part-00000-of-00001")
    kept = {f: schemas.read(os.path.join(partial, f), "costs") for f in sorted(os.listdir(partial))}
    assert len(kept) == 3
    assert not os.path.exists(os.path.join(out, "costs", "part-00000-of-00001.parquet"))
    monkeypatch.delenv("EMBSHARD_BENCH_FAIL_AFTER")
    run(tables_path, "random:6", out, **kw)
    costs = schemas.read(os.path.join(out, "costs"), "costs")
    assert len(costs) == 6 and costs["sample_id"].is_unique
    for row in kept.values():  # the rows measured before the crash are kept as they were
        got = costs[costs["sample_id"] == row["sample_id"].iloc[0]]
        assert got["measured_at"].iloc[0] == row["measured_at"].iloc[0]


def test_killed_cli_process_resumes(tables_path, tmp_path, capsys):
    from embshard.cli import main

    out = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "embshard", "bench", "--tables", tables_path, "--shards", "random:12",
           "--out", out, "--max-tables", "3", "--batch-size", "256", "--warmup", "2", "--iterations", "10",
           "--comm-bandwidth-gbps", "10", "--comm-latency-us", "20", "--no-progress"]
    partial = os.path.join(out, "costs", ".partial", "part-00000-of-00001")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if os.path.isdir(partial) and len([f for f in os.listdir(partial) if f.endswith(".parquet")]) >= 2:
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = {f for f in os.listdir(partial) if f.endswith(".parquet")}
    assert 2 <= len(done) < 12
    before = pd.concat([schemas.read(os.path.join(partial, f), "costs") for f in done])
    # The resume in this process (the killed one above was the real command): it checks what the job does.
    capsys.readouterr()
    rc = main(cmd[3:])
    res = capsys.readouterr()
    assert rc == 0, res.err[-2000:]
    assert "12 shards" in res.out
    costs = schemas.read(os.path.join(out, "costs"), "costs")
    assert len(costs) == 12 and costs["sample_id"].is_unique
    merged = before.merge(costs, on="sample_id", suffixes=("_old", ""))
    assert len(merged) == len(before) and (merged["measured_at_old"] == merged["measured_at"]).all()


def test_cli_errors_are_one_line(tables_path, tmp_path, capsys):
    from embshard.cli import main

    assert main(["bench", "--tables", tables_path, "--shards", "random:2", "--out", str(tmp_path),
                 "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert "CUDA is not available" in err and len(err.splitlines()) == 1
    assert main(["bench", "--tables", tables_path, "--shards", "bogus:2", "--out", str(tmp_path)]) == 2


def test_input_workers_make_the_same_inputs_as_in_process(ts, tmp_path, monkeypatch):
    """The GPU path makes shard inputs in helper processes (`python -m embshard.bench.input_worker`, never a
    re-import of the entry script): they must equal the in-process ones."""
    cfg = runner.make_config(MeasureSettings(device="cpu", backend="torch", batch_size=512, comm_bandwidth_gbps=10.0,
                                             comm_latency_us=20.0))
    jobs = [([0, 3, 5], None, "a"), ([1, 2], None, "b"), (_heavy(ts, 3), None, "c")]
    with runner.InputPrefetcher(ts, cfg, jobs, workers=2) as pre:
        assert len(pre.procs) == 2 and all("embshard.bench.input_worker" in p.args for p in pre.procs)
        got = [pre.get(k) for k in range(len(jobs))]
    assert all(p.poll() is not None for p in pre.procs) or not pre.procs  # closed with the context
    for (members, cols, where), g in zip(jobs, got):
        want = runner.shard_inputs(ts, members, cfg, cols, where)
        assert g.rows == want.rows and g.dims == want.dims and g.row_scale == want.row_scale
        for (gi, gl), (wi, wl) in zip(g.batches, want.batches):
            np.testing.assert_array_equal(gi, wi)
            np.testing.assert_array_equal(gl, wl)
        # split back per table, the layout the torch backend needs
        per = g.per_table(0)
        assert len(per) == len(members) and all(len(ln) == 512 for _, ln in per)
        assert sum(len(i) for i, _ in per) == len(g.batches[0][0])
    monkeypatch.setenv("EMBSHARD_BENCH_WORKERS", "0")
    assert runner.input_workers("cuda") == 0
    monkeypatch.delenv("EMBSHARD_BENCH_WORKERS")
    assert runner.input_workers("cpu") == 0 and runner.input_workers("cuda") >= 1


def test_sample_shards_splits_the_budget_between_random_and_plan_shards_inside_each_pool(tmp_path):
    from embshard import pools
    from embshard.ingest.synthetic import generate_tables
    from embshard.jobs import shards as shards_job
    from embshard.jobs import tasks

    tables = str(tmp_path / "tables.parquet")
    tdf = generate_tables(120, seed=2, bins_batch_size=2048)
    schemas.write(tdf, tables, "tables")
    tasks_path = tasks.run(tables, str(tmp_path), num_tasks=3, tables_per_task="10-20", devices=4, memory_gb=64,
                           seed=0)
    tdf = schemas.read(tables, "tables")
    df = schemas.read(shards_job.run(tables, tasks_path, str(tmp_path), num_shards=60, seed=0), "shards")
    kind = df["origin"].str.split(":").str[0]
    for pool, n in (("train", 40), ("test", 20)):
        members = set(pools.members(tdf, pool, 0))
        mine = df[df["sample_id"].str.startswith(f"{pool}-")]
        assert all(set(ids) <= members for ids in mine["table_ids"])  # a shard never mixes pools
        assert (kind[mine.index] == "random").sum() == n - n // 2
        assert (kind[mine.index] == "plan").sum() == n // 2
    assert df[kind == "plan"]["table_ids"].map(len).max() > 15   # larger than any random shard
    assert (kind == "single").sum() >= len(pools.members(tdf, "train", 0))
    assert not df.apply(piece_key, axis=1).duplicated().any()


def test_sample_shards_reuses_its_list_only_for_the_same_inputs(tmp_path):
    """A retried stage gets the same list; a root re-ingested with other tables gets a new one drawn from them
    (the old list would put tables of today's test pool into train shards)."""
    from embshard import pools
    from embshard.ingest.synthetic import generate_tables
    from embshard.jobs import shards as shards_job
    from embshard.jobs import tasks

    tables = str(tmp_path / "tables.parquet")

    def sample(seed: int) -> pd.DataFrame:
        schemas.write(generate_tables(40, seed=seed, bins_batch_size=2048), tables, "tables")
        tasks_path = tasks.run(tables, str(tmp_path), num_tasks=2, tables_per_task="6-10", devices=2, memory_gb=512,
                               seed=seed)
        return schemas.read(shards_job.run(tables, tasks_path, str(tmp_path), num_shards=9, seed=seed), "shards")

    first = sample(0)
    target = tmp_path / shards_job.SHARDS_FILE
    mtime = target.stat().st_mtime_ns
    assert sample(0).equals(first) and target.stat().st_mtime_ns == mtime  # same inputs: the same file, kept
    again = sample(5)
    test_pool = set(pools.members(schemas.read(tables, "tables"), "test", 5))
    train_rows = again[again["sample_id"].str.startswith("train-")]
    assert not any(set(ids) & test_pool for ids in train_rows["table_ids"])
    assert not again.equals(first)


def test_gpu_input_workers_follow_the_pods_cpu_limit_not_the_nodes_cores(tmp_path, monkeypatch):
    """In a pod limited to 8 CPUs on a big node, os.cpu_count() is the node's: the cgroup limit decides (v2
    cpu.max, v1 cfs quota); no limit falls back to the affinity."""
    from embshard import hardware
    from embshard.bench import runner

    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("800000 100000\n")
    monkeypatch.setattr(os, "cpu_count", lambda: 96)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(96)), raising=False)
    assert hardware.usable_cpus(str(v2)) == 8
    (v2 / "cpu.max").write_text("max 100000\n")
    assert hardware.usable_cpus(str(v2)) == 96
    v1 = tmp_path / "v1" / "cpu"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("250000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert hardware.usable_cpus(str(tmp_path / "v1")) == 3  # 2.5 CPUs: the next whole one
    monkeypatch.setattr(hardware, "usable_cpus", lambda: 8)
    monkeypatch.delenv("EMBSHARD_BENCH_WORKERS", raising=False)
    assert runner.input_workers("cuda") == 6 and runner.input_workers("cpu") == 0
