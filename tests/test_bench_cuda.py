"""The CUDA path of the benchmark: FBGEMM's CUDA table-batched-embedding kernels timed with CUDA events.

Runs where CUDA exists (a GPU host with a CUDA build of torch and of fbgemm-gpu); skipped, with the reason,
elsewhere (CI has no GPU). Real kernels, real Parquet parts: the same stage as `embshard bench --device cuda`.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from embshard import schemas  # noqa: E402
from embshard.bench import backends, measure_placement  # noqa: E402
from embshard.bench.runner import MeasureSettings  # noqa: E402
from embshard.jobs.bench import run  # noqa: E402
from embshard.placement import Placement, Shard  # noqa: E402
from embshard.tableset import TableSet  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device here (torch.cuda.is_available() is False)")


@pytest.fixture(scope="module")
def tables_df():
    from embshard.ingest.synthetic import generate_tables

    return generate_tables(24, seed=5, bins_batch_size=4096)


def _fbgemm_cuda_or_skip():
    reason = backends.fbgemm_status("cuda")
    if reason is not None:
        pytest.skip(f"FBGEMM has no CUDA kernels on this host: {reason}")


def test_fbgemm_cuda_bench_writes_costs(tmp_path, tables_df):
    _fbgemm_cuda_or_skip()
    p = tmp_path / "tables.parquet"
    schemas.write(tables_df, p, "tables")
    parts = run(str(p), "random:6", str(tmp_path / "run"), MeasureSettings(backend="fbgemm", device="cuda"),
                max_tables=12, progress=False)
    df = schemas.read(parts[0], "costs")
    assert len(df) == 6
    assert (df["backend"] == "fbgemm").all() and (df["timer"] == "cuda_events").all()
    assert (df["batch_size"] == 65_536).all()  # the GPU default
    assert df["hardware"].iloc[0].startswith("cuda:")
    assert (df["fwd_compute_ms"] > 0).all() and (df["bwd_compute_ms"] > 0).all()
    assert (df["comm_model"] == "constants:nvlink").all() and (df["fwd_comm_ms"] > 0).all()
    # more tables, more work: the biggest shard costs more than the smallest
    n = df["table_ids"].map(len)
    total = df["fwd_compute_ms"] + df["bwd_compute_ms"]
    assert total[n.idxmax()] > total[n.idxmin()]


def test_fbgemm_cuda_updates_rows_exact_sgd():
    """The backward really updates the rows touched (exact SGD inside the CUDA backward kernel)."""
    _fbgemm_cuda_or_skip()
    op = backends.FbgemmShard([100, 50], [8, 16], "cuda")
    before = op.op.weights_dev.detach().clone()
    lengths = np.array([1, 2, 1, 0], dtype=np.int64)  # B=2, T=2
    batch = op.prepare_concat(np.array([3, 7, 9, 4], dtype=np.int64), lengths, "cuda")
    out = op.forward(batch)
    assert tuple(out.shape) == (2, 24)
    op.backward(out, torch.ones_like(out))
    torch.cuda.synchronize()
    assert (op.op.weights_dev != before).sum().item() == 8 * 3 + 16 * 1  # rows 3, 7, 9 of t0 and row 4 of t1


def test_cuda_measure_placement_with_input_workers(tables_df, monkeypatch):
    """measure_placement on CUDA (the evaluation path), inputs made by worker processes."""
    _fbgemm_cuda_or_skip()
    monkeypatch.setenv("EMBSHARD_BENCH_WORKERS", "2")
    ts = TableSet.from_frame(tables_df)
    shards = [Shard(i, i % 3) for i in range(9)]
    pl = Placement(ts, 4, 80 * 2**30, shards, planner="test", task_id="t")
    df = measure_placement(pl, MeasureSettings(device="cuda", batch_size=4096))
    assert len(df) == 4 and df.loc[3, "total_ms"] == 0.0
    assert (df.loc[:2, "fwd_compute_ms"] > 0).all() and (df["backend"] == "fbgemm").all()


def test_torch_backend_on_cuda(tmp_path, tables_df):
    """The fallback backend (one fused embedding_bag per dim) also runs on the GPU."""
    p = tmp_path / "tables.parquet"
    schemas.write(tables_df, p, "tables")
    parts = run(str(p), "random:3", str(tmp_path / "run"),
                MeasureSettings(backend="torch", device="cuda", batch_size=8192), progress=False)
    df = schemas.read(parts[0], "costs")
    assert len(df) == 3 and (df["backend"] == "torch").all() and (df["fwd_compute_ms"] > 0).all()


def test_pipeline_stages_measure_on_the_gpu(tmp_path, monkeypatch):
    """The DAG's stage path with device=cuda: ingest, sample_shards (the calibration of the GPU's hardware) and
    one benchmark chunk write GPU costs (the `device` param reaching the stages, not only `embshard bench`)."""
    _fbgemm_cuda_or_skip()
    from embshard import stages

    monkeypatch.setenv("EMBSHARD_CALIBRATION_DIR", str(tmp_path / "calibration"))
    root = str(tmp_path / "run")
    params = {"device": "cuda", "num_tables": 30, "hot_large_fraction": 0.0, "num_tasks": 2, "tables_per_task": "6-10",
              "devices": 2, "memory_gb": 64, "bench_shards": 12, "bench_chunks": 2, "bench_batch_size": 4096}
    stages.run("ingest", root, params)
    stages.run("sample_shards", root, params)
    res = stages.run("benchmark", root, params, chunk=0)
    assert res["device"] == "cuda"
    df = schemas.read(res["parts"][0], "costs")
    assert df["hardware"].iloc[0].startswith("cuda:") and (df["timer"] == "cuda_events").all()
    assert (df["batch_size"] == 4096).all()
    expected = "measured" if torch.cuda.device_count() >= 2 else "model"
    assert (df["comm_source"] == expected).all()
