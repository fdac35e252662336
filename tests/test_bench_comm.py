"""Benchmark communication (real gloo all-to-all between local processes) and trace replay."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from embshard import schemas
from embshard.bench import comm, inputs, runner
from embshard.bench.runner import MeasureSettings
from embshard.jobs.bench import run
from embshard.tableset import TableSet


def test_comm_model_bytes_and_given_constants():
    m = comm.comm_model("cpu:x", "cpu", bandwidth_gbps=1.0, latency_us=10.0)
    assert m.source == "given"
    # 1024 samples x 100 dims x 4 B x 3/4 = 307,200 B at 1 GB/s = 0.3072 ms, + 0.01 ms latency
    assert abs(m.time_ms(1024, 100, 4) - 0.3172) < 1e-9
    assert m.time_ms(1024, 100, 1) == 0.0  # one device: no all-to-all


def test_measured_comm_and_calibration_with_gloo(tmp_path, small_tables_df, monkeypatch):
    monkeypatch.delenv("EMBSHARD_COMM_BANDWIDTH_GBPS", raising=False)
    tables = str(tmp_path / "tables.parquet")
    schemas.write(small_tables_df, tables, "tables")
    out = str(tmp_path / "run")
    parts = run(tables, [["t0000", "t0001"], ["t0002"]], out,
                MeasureSettings(batch_size=256, warmup=1, iterations=10, comm_ranks=2), progress=False)
    costs = schemas.read(parts[0], "costs")
    # The shards belong to 4-device tasks (run's default): measured among the 2 ranks there are, each rank sending
    # what a device of a 4-device task sends (comm.group_numel), and recorded as 4-device shards.
    assert (costs["comm_source"] == "measured").all() and (costs["num_devices"] == 4).all()
    assert comm.group_numel(256, 100, 4, 2) == 256 * 100 * 3 // 4 * 2
    assert comm.group_numel(256, 100, 1, 2) == 0  # one device: no all-to-all
    assert (costs["fwd_comm_ms"] > 0).all() and (costs["bwd_comm_ms"] > 0).all()
    assert (costs["comm_model"] == "gloo:2ranks").all()
    # The calibrated model: fitted once, cached in the run folder for every later chunk.
    model = comm.comm_model("cpu:test", "cpu", out=out)
    assert model.source.startswith("calibrated:gloo") and model.bandwidth_Bps > 1e6 and model.latency_s > 0
    cached = json.loads(Path(out, comm.CALIBRATION_FILE).read_text())
    assert cached["cpu:test"]["bandwidth_Bps"] == model.bandwidth_Bps
    assert comm.comm_model("cpu:test", "cpu", out=out) == model


def test_trace_replay_uses_the_real_indices(tmp_path, small_tables_df):
    from embshard.ingest.dlrm import read_table_trace
    from embshard.ingest.synthetic import write_dlrm_traces

    df = small_tables_df.head(4).copy()
    trace = str(tmp_path / "trace.pt")
    write_dlrm_traces(df, trace, batch_size=300, seed=1)
    df["trace_file"] = trace
    df["trace_table_index"] = np.arange(4)
    # as ingest records them: the mean bag length of the trace itself
    df["pooling_factor"] = [read_table_trace(trace, t)[1].mean() for t in range(4)]
    ts = TableSet.from_frame(schemas.validate(df, "tables"))

    idx, lens = read_table_trace(trace, 2)
    spec = runner._table_inputs(ts, np.array([2]), None)[0]
    windows = inputs.trace_windows(spec, 128, 3)
    # Window j holds samples j*128 .. j*128+127 (wrapping at 300) of the trace, indices untouched.
    offs = np.concatenate([[0], np.cumsum(lens)])
    assert np.array_equal(windows[0][1], lens[:128]) and np.array_equal(windows[0][0], idx[:offs[128]])
    wrap = (256 + np.arange(128)) % 300
    assert np.array_equal(windows[2][1], lens[wrap])
    # Scaled rows: the same access structure (distinct ids stay distinct) within the smaller table.
    spec.scaled_rows = max(len(np.unique(np.concatenate([w[0] for w in windows]))), 1)
    scaled = inputs.trace_windows(spec, 128, 3)
    assert scaled[0][0].max() < spec.scaled_rows
    assert np.array_equal(np.unique(scaled[0][0], return_counts=True)[1].sum(), len(windows[0][0]))
    assert (sorted(np.unique(scaled[0][0], return_counts=True)[1])
            == sorted(np.unique(windows[0][0], return_counts=True)[1]))
    cfg = runner.make_config(MeasureSettings(batch_size=128, warmup=1, iterations=10, comm_bandwidth_gbps=10,
                                             comm_latency_us=5))
    m = runner.measure_shard(ts, [0, 1, 2, 3], cfg, num_devices=4)
    assert m["fwd_compute_ms"] > 0 and m["bwd_compute_ms"] > 0


def test_a_trace_regenerated_after_ingest_is_refused_not_replayed(tmp_path, small_tables_df):
    """A trace exported again at the same path (other samples, other ids) was replayed silently, its ids folded
    into the rows ingested from the old one: the bench now checks the trace against what ingest recorded."""
    from embshard.errors import EmbshardError
    from embshard.ingest.dlrm import tables_from_trace
    from embshard.ingest.synthetic import write_dlrm_traces

    df = small_tables_df.head(4).copy()
    trace = str(tmp_path / "trace.pt")
    write_dlrm_traces(df, trace, batch_size=300, seed=1)
    ts = TableSet.from_frame(tables_from_trace(trace, rows=df["rows"].to_numpy(), dims=df["dim"].to_numpy(),
                                               progress=False))
    spec = runner._table_inputs(ts, np.array([2]), None)[0]
    assert len(inputs.trace_windows(spec, 128, 2)) == 2  # the trace it was ingested from replays
    write_dlrm_traces(df, trace, batch_size=500, seed=2)  # regenerated at the same path (in the same process)
    with pytest.raises(EmbshardError, match="changed since its tables were ingested") as err:
        inputs.trace_windows(spec, 128, 2)
    assert err.value.field == "trace_file" and "ingest the trace again" in str(err.value)


def test_one_calibration_per_hardware_is_shared_by_runs_and_redone_only_when_asked(tmp_path, monkeypatch):
    """Runs adopt the stored calibration of their hardware (so a model and later measurements agree on comm);
    only `recalibrate` measures again, and the spread over the calibration's repeats is kept."""
    import json

    from embshard.bench import comm

    calls = []

    def fake_calibrate(world_size=2, repeats=3):
        calls.append(world_size)
        return comm.CommModel(1e-5 * len(calls), 2e9, "calibrated:test", spread=0.05 * len(calls))

    monkeypatch.setattr(comm, "calibrate", fake_calibrate)
    monkeypatch.delenv("EMBSHARD_CALIBRATION_DIR", raising=False)
    assert comm.adopt_calibration(str(tmp_path / "run0"), "cpu:x") is None  # no shared folder: each run its own
    monkeypatch.setenv("EMBSHARD_CALIBRATION_DIR", str(tmp_path / "shared"))
    first = comm.adopt_calibration(str(tmp_path / "run1"), "cpu:x")
    second = comm.adopt_calibration(str(tmp_path / "run2"), "cpu:x")
    assert len(calls) == 1 and first == second and second.spread == 0.05
    for run_dir in ("run1", "run2"):
        stored = json.loads((tmp_path / run_dir / comm.CALIBRATION_FILE).read_text())["cpu:x"]
        assert stored["latency_s"] == 1e-5 and comm.run_calibration(str(tmp_path / run_dir), "cpu:x") == stored
        # every measuring stage of the run reads that file
        assert comm.comm_model("cpu:x", "cpu", out=str(tmp_path / run_dir)) == first
    third = comm.adopt_calibration(str(tmp_path / "run3"), "cpu:x", recalibrate=True)
    assert len(calls) == 2 and third.latency_s == 2e-5
    assert comm.adopt_calibration(str(tmp_path / "run4"), "cpu:x") == third  # the new one is kept
    other = comm.adopt_calibration(str(tmp_path / "run5"), "cpu:y")  # another machine: its own
    assert len(calls) == 3 and other.latency_s == pytest.approx(3e-5)


def test_busy_cores_sees_another_process_spinning():
    """The load a calibration records is read from /proc/stat: a process spinning on one core is about one core
    (a lower bound only: the test machine may be busier still)."""
    import os
    import subprocess
    import sys

    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        busy = comm.busy_cores(1.0)
    finally:
        spinner.kill()
        spinner.wait()
    assert busy is not None and 0.7 <= busy <= (os.cpu_count() or 1) + 1e-9


def test_a_calibration_on_a_busy_machine_waits_then_is_flagged(monkeypatch, caplog, tmp_path):
    """Calibrating waits (a bounded while) for other processes to leave the cores it needs; when they do not, the
    calibration records their load and the run warns in one line how to fix it. Old files without the record
    still read (as quiet)."""
    import logging

    monkeypatch.setattr(comm.os, "cpu_count", lambda: 2)
    assert comm.busy_limit(2) == 0.5
    loads = iter([1.5, 1.2, 0.1])
    monkeypatch.setattr(comm, "busy_cores", lambda seconds=0.5: next(loads))
    assert comm.wait_for_quiet(2, max_wait_s=60) == 0.1  # waited through two busy samples
    monkeypatch.setattr(comm, "busy_cores", lambda seconds=0.5: 1.3)
    assert comm.wait_for_quiet(2, max_wait_s=0) == 1.3  # gave up at once: the load is recorded, not hidden
    with caplog.at_level(logging.WARNING, logger=comm.log.name):
        comm.warn_if_busy(comm.CommModel(2e-4, 7e8, "calibrated:gloo-2proc", 0.5, busy_cores=1.3), "every run",
                          "run the pipeline with --param recalibrate_comm=true")
        comm.warn_if_busy(comm.CommModel(2e-4, 2e9, "calibrated:gloo-2proc", 0.1, busy_cores=0.1), "every run",
                          "never said")
        # A CLI command (bench, evaluate) keeps its calibration in its output folder: the fix is to delete that file,
        # not a pipeline param the command does not have.
        monkeypatch.setattr(comm, "calibrate", lambda ranks: comm.CommModel(2e-4, 7e8, "calibrated:gloo-2proc", 0.5,
                                                                            busy_cores=1.3))
        comm.comm_model("cpu:test-busy", "cpu", out=str(tmp_path))
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 2 and "1.3 of 2 cores" in warned[0] and "recalibrate_comm=true" in warned[0]
    assert f"delete {tmp_path / comm.CALIBRATION_FILE}" in warned[1] and "recalibrate_comm" not in warned[1]
    old = {"latency_s": 2e-4, "bandwidth_Bps": 7e8, "source": "calibrated:gloo-2proc", "spread": 0.5}
    assert comm.model_from_dict(old).busy_cores == 0.0


def test_a_model_priced_for_another_network_is_named_with_the_factor():
    """A cost model records the calibration it was trained on; where this machine's differs by more than 25%, one
    line says by how much its predicted communication is off and what to do (the split suite moved 0.767 -> 0.543
    with the calibration alone)."""
    here = comm.CommModel(2.4e-4, 0.66e9, "calibrated:gloo-2proc")
    trained = {"latency_s": 1.5e-4, "bandwidth_Bps": 1.48e9, "source": "calibrated:gloo-2proc"}
    msg = comm.calibration_mismatch(trained, here)
    assert msg is not None and "1.48 GB/s" in msg and "0.66 GB/s" in msg and "(0.45x)" in msg and "fix:" in msg
    assert comm.calibration_mismatch({**trained, "bandwidth_Bps": 0.75e9}, here) is None  # within 25%
    assert comm.calibration_mismatch(None, here) is None  # a model without a record: nothing to compare
    assert comm.calibration_mismatch({**trained, "bandwidth_Bps": 0.5e9}, here) is not None  # 1.32x the other way
