"""Working-set features, the cost-model ensemble (mean, intervals, calibration), the search's uncertainty guard,
`embshard predict`, and the ruler's ranking check of the cost model."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch

from embshard import schemas
from embshard.features import feature_matrix, working_set_bytes, working_set_rows


def _model(seed: int, batch_size: int = 1024, cache_bytes: int = 32 * 2**20):
    from embshard.costmodel.model import CostModel, CostModelConfig
    from embshard.features import FeatureScaler
    from embshard.ingest.synthetic import generate_tables

    torch.manual_seed(seed)
    feats = feature_matrix(generate_tables(24, seed=3, bins_batch_size=512))
    cfg = CostModelConfig(target_scale=[0.5, 1.0, 0.2], batch_size=batch_size, cache_bytes=cache_bytes)
    return CostModel.create(cfg, FeatureScaler.fit(feats), feats), feats


def test_working_set_is_what_the_benchmark_draws():
    """The feature must equal the unique rows the benchmark's input generator puts in a batch of that size."""
    from embshard.bench.inputs import bin_counts
    from embshard.ingest.synthetic import generate_tables

    df = generate_tables(30, seed=1, bins_batch_size=4096)
    feats = feature_matrix(df)
    for batch in (256, 2048):
        got = working_set_rows(feats, batch)
        want = [bin_counts(int(round(batch * pf)), b, int(r)).sum()
                for pf, b, r in zip(df["pooling_factor"], df[schemas.BIN_COLUMNS].to_numpy(), df["rows"])]
        np.testing.assert_allclose(got, want, rtol=0.02, atol=1.0)
    # bytes: unique rows x dim x FP32 weights; never more rows than the table has
    assert (working_set_rows(feats, 10**9) <= feats[:, 1]).all()
    np.testing.assert_allclose(working_set_bytes(feats, 512), working_set_rows(feats, 512) * feats[:, 0] * 4)


def test_the_hardware_enters_the_model():
    """The same tables on a machine with a smaller cache, or at a larger batch, are other inputs to the network."""
    from embshard.costmodel.model import NUM_EXTRA, WORKING_SET

    a, feats = _model(0, cache_bytes=32 * 2**20)
    b, _ = _model(0, cache_bytes=2 * 2**20)
    ea, eb = a.encode(feats), b.encode(feats)
    ratio = eb[:, -NUM_EXTRA + WORKING_SET] / ea[:, -NUM_EXTRA + WORKING_SET]
    np.testing.assert_allclose(ratio.numpy(), 16.0, rtol=1e-4)
    assert not torch.allclose(ea[:, :-NUM_EXTRA], eb[:, :-NUM_EXTRA])


def test_ensemble_is_the_mean_of_its_members_and_keeps_the_sum_decomposition(tmp_path):
    from embshard.costmodel.ensemble import CostEnsemble

    members = [_model(s)[0] for s in range(3)]
    _, feats = _model(0)
    ens = CostEnsemble(members, interval_z=2.0)
    shards = [np.array([0, 3, 5]), np.array([7]), np.array([1, 2, 4, 8, 9])]
    per = np.stack([m.predict_shards(feats, shards, 4) for m in members])
    np.testing.assert_allclose(ens.predict_shards(feats, shards, 4), per.mean(0), rtol=1e-5)
    # device sums of concatenated encodings give the same answer (what the scorer and the policy use)
    enc = ens.encode(feats)
    sums = torch.stack([enc[torch.from_numpy(s)].sum(0) for s in shards])
    np.testing.assert_allclose(ens.heads_from_sums(sums, 4).numpy(), per.mean(0), rtol=1e-4)
    mean, low, high = ens.predict_shards_interval(feats, shards, 4)
    assert (low <= mean + 1e-9).all() and (mean <= high + 1e-9).all()
    ens.save(str(tmp_path / "ens"))
    again = CostEnsemble.load_dir(str(tmp_path / "ens"))
    np.testing.assert_array_equal(again.predict_shards(feats, shards, 4), ens.predict_shards(feats, shards, 4))
    assert again.interval_z == 2.0


def test_interval_z_is_fitted_to_hold_the_stated_share():
    from embshard.costmodel.ensemble import coverage, fit_interval_z

    rng = np.random.default_rng(0)
    truth = rng.uniform(1, 10, 400)
    per = truth * np.exp(rng.normal(0, 0.05, (4, 400)) + rng.normal(0, 0.2, 400))  # members agree, all off
    z = fit_interval_z(per[:, :200], truth[:200], level=0.9)
    assert z > 2.0  # the members' spread alone is far too narrow
    assert 0.8 <= coverage(per[:, 200:], truth[200:], z) <= 0.97


def test_search_refuses_moves_inside_the_uncertainty():
    """Members that disagree about every gain: the search stops at once (guard); identical members: the ensemble
    searches exactly like one model."""
    from embshard.costmodel.ensemble import CostEnsemble
    from embshard.planners.scoring import TaskScorer
    from embshard.planners.search import Budget, SearchState, local_search

    base, feats = _model(0)
    other, _ = _model(7)
    sizes = np.ones(len(feats))
    start = np.zeros(len(feats), dtype=np.int64)  # everything on device 0: any move is a big predicted gain

    def search(model):
        state = SearchState(TaskScorer(model, feats, 4), sizes, 10**12, start)
        budget = Budget(50_000)
        return local_search(state, budget), budget

    single, b1 = search(base)
    same, b2 = search(CostEnsemble([base, base]))
    np.testing.assert_array_equal(single.assignment, same.assignment)
    assert b2.guard_stops == 0

    # A member that predicts the opposite trend makes the gains uncertain: moves inside the spread are refused.
    class Contrary:
        def __init__(self, m):
            self.m = m
            self.width = m.width
            self.config = m.config

        def encode(self, f):
            return self.m.encode(f)

        def heads_from_sums(self, sums, d):
            h = self.m.heads_from_sums(sums, d)
            return h * torch.exp(-sums[..., -4:-3] * 0.9)  # more tables -> much cheaper: disagrees on gains

    noisy = CostEnsemble([base, base])
    noisy.members[1] = Contrary(base)  # type: ignore[assignment]
    guarded, b3 = search(noisy)
    assert b3.guard_stops >= 1 and b3.used < b1.used
    # the guard stops on the first contested move: the piled-up start is left (nearly) as it was
    assert np.bincount(guarded.assignment, minlength=4)[0] > np.bincount(single.assignment, minlength=4)[0]


def test_ranking_agreement_counts_only_pairs_the_ruler_tells_apart():
    from embshard.ingest.synthetic import generate_tables
    from embshard.jobs.evaluate import judged_costs, ranking_agreement
    from embshard.placement import Placement
    from embshard.ruler import Entry
    from embshard.tableset import TableSet

    model, _ = _model(0)
    ts = TableSet.from_frame(generate_tables(6, seed=2, bins_batch_size=512))
    spread = Placement.from_assignment(ts, np.arange(6) % 3, 3, 2**40, planner="a")
    piled = Placement.from_assignment(ts, np.zeros(6, dtype=np.int64), 3, 2**40, planner="b")
    twin = Placement.from_assignment(ts, np.arange(6) % 3, 3, 2**40, planner="a")
    entries = [Entry("a", spread, ""), Entry("b", piled, ""), Entry("a#2", twin, "#2")]
    from embshard.planners.scoring import placement_costs

    a_dearer = placement_costs(model, spread).max() > placement_costs(model, piled).max()
    low, high = [1.0, 1.02, 0.98, 1.01, 0.99], [3.0, 3.1, 2.9, 3.05, 2.95]
    agree = np.array([high if a_dearer else low, low if a_dearer else high, [1.0] * 5])
    pred = judged_costs(model, entries)
    assert sorted(pred) == [0, 1]  # the A/A twin is not judged
    assert ranking_agreement(pred, agree) == (1, 1)
    same = np.array([[1.0, 1.2, 0.8, 1.1, 0.9], [1.0, 0.8, 1.2, 0.9, 1.1], [1.0] * 5])
    assert ranking_agreement(pred, same) == (0, 0)  # inside the noise: no pair
    assert ranking_agreement(pred, agree[[1, 0, 2]]) == (1, 0)


def test_placement_accuracy_is_per_placement_mape_and_within_task_spearman():
    from embshard.jobs.evaluate import placement_accuracy

    # Task 1 ranked right, task 2 ranked backwards: the mean within-task Spearman is 0, not the ~1 a pooled
    # Spearman would show because the second task's placements are ten times dearer.
    t1 = [(1.1, 1.0), (2.2, 2.0), (3.3, 3.0)]
    t2 = [(33.0, 10.0), (22.0, 20.0), (11.0, 30.0)]
    acc = placement_accuracy([t1, t2, [(5.0, 4.0)]])
    assert acc["spearman_tasks"] == 2 and acc["within_task_spearman"] == pytest.approx(0.0)
    assert acc["placements"] == 7
    mape = np.mean([10, 10, 10, 230, 10, 63.333333, 25])
    assert acc["placement_mape"] == pytest.approx(mape, rel=1e-6)
    assert np.isnan(placement_accuracy([])["placement_mape"])


@pytest.fixture(scope="module")
def saved_ensemble(tmp_path_factory):
    from embshard.costmodel.ensemble import CostEnsemble
    from embshard.ingest.synthetic import generate_tables

    root = tmp_path_factory.mktemp("predict")
    df = generate_tables(24, seed=3, bins_batch_size=512)
    schemas.write(df, root / "tables.parquet", "tables")
    CostEnsemble([_model(s)[0] for s in range(3)], interval_z=1.5).save(str(root / "model"))
    ids = list(df["table_id"])
    return root, ids


def _predict(*args):
    return subprocess.run([sys.executable, "-m", "embshard", "predict", *args], capture_output=True, text=True)


def test_predict_writes_costs_with_intervals(saved_ensemble):
    root, ids = saved_ensemble
    shards = pd.DataFrame({"sample_id": ["s1", "s2"], "table_ids": [" ".join(ids[:3]), ids[5]],
                           "num_devices": [4, 8]})
    shards.to_csv(root / "shards.csv", index=False)
    out = root / "pred.parquet"
    res = _predict("--tables", str(root / "tables.parquet"), "--shards", str(root / "shards.csv"),
                   "--model", str(root / "model"), "--out", str(out))
    assert res.returncode == 0, res.stderr
    df = pd.read_parquet(out)
    assert list(df["sample_id"]) == ["s1", "s2"] and list(df["num_tables"]) == [3, 1]
    for h in ("fwd_compute", "bwd_compute", "comm", "total"):
        assert (df[f"{h}_ms_low"] <= df[f"{h}_ms"] + 1e-9).all() and (df[f"{h}_ms"] <= df[f"{h}_ms_high"] + 1e-9).all()
    assert (df["working_set_bytes"] > 0).all() and "s1" in res.stdout


def _predict_here(capsys, *args) -> subprocess.CompletedProcess:
    """`embshard predict` in this process, for what the job says on stderr (its error line is printed there;
    its warnings are log lines, which pytest keeps from stderr, so those tests use the real command)."""
    from embshard.cli import main

    capsys.readouterr()
    try:
        rc = main(["predict", *args])
    except SystemExit as exc:  # argparse
        rc = exc.code
    out = capsys.readouterr()
    return subprocess.CompletedProcess(["embshard", "predict", *args], rc, out.out, out.err)


def test_predict_bad_input_is_one_line_exit_2_and_writes_nothing(saved_ensemble, capsys):
    root, ids = saved_ensemble
    pd.DataFrame({"sample_id": ["s1"], "table_ids": ["no-such-table"], "num_devices": [4]}).to_csv(
        root / "bad.csv", index=False)
    out = root / "never.parquet"
    res = _predict_here(capsys, "--tables", str(root / "tables.parquet"), "--shards", str(root / "bad.csv"),
                   "--model", str(root / "model"), "--out", str(out))
    assert res.returncode == 2 and "table_ids" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert not out.exists()
    res = _predict_here(capsys, "--tables", str(root / "tables.parquet"), "--shards", str(root / "bad.csv"),
                   "--model", str(root / "no-model"), "--out", str(out))
    assert res.returncode == 2 and not out.exists()


def test_predict_warns_in_one_line_when_the_model_is_for_other_hardware(saved_ensemble, tmp_path):
    """A model measured on an H100 asked about this CPU machine (or --hardware naming other hardware) warns once;
    naming the model's own hardware (a short name is enough) does not."""
    from embshard.costmodel.ensemble import CostEnsemble

    root, ids = saved_ensemble
    members = [_model(s)[0] for s in range(2)]
    for m in members:
        m.config.hardware = "cuda:NVIDIA H100 80GB HBM3"
    CostEnsemble(members, interval_z=1.5).save(str(tmp_path / "gpu-model"))
    pd.DataFrame({"sample_id": ["s1"], "table_ids": [" ".join(ids[:2])], "num_devices": [4]}).to_csv(
        tmp_path / "shards.csv", index=False)
    base = ["--tables", str(root / "tables.parquet"), "--shards", str(tmp_path / "shards.csv"),
            "--model", str(tmp_path / "gpu-model")]
    res = _predict(*base, "--out", str(tmp_path / "a.csv"))
    assert res.returncode == 0, res.stderr
    warnings = [ln for ln in res.stderr.splitlines() if "measured on cuda:NVIDIA H100" in ln]
    if torch.cuda.is_available() and "H100" in torch.cuda.get_device_name():
        assert not warnings
    else:
        assert len(warnings) == 1 and "this machine" in warnings[0], res.stderr
    res = _predict(*base, "--hardware", "cuda:NVIDIA H100", "--out", str(tmp_path / "b.csv"))
    assert res.returncode == 0 and "measured on" not in res.stderr, res.stderr
    res = _predict(*base, "--hardware", "cuda:NVIDIA L4", "--out", str(tmp_path / "c.csv"))
    assert res.returncode == 0 and "--hardware is cuda:NVIDIA L4" in res.stderr, res.stderr


def test_hardware_names_match_by_prefix_and_case():
    from embshard.hardware import mismatch_warning, same_hardware

    assert same_hardware("cuda:NVIDIA H100 80GB HBM3", "cuda:nvidia h100")
    assert not same_hardware("cuda:NVIDIA H100 80GB HBM3", "cuda:NVIDIA H200")
    assert not same_hardware("", "cpu:x")
    assert mismatch_warning("", "cpu:x", asked=False) is None  # a model that does not say: nothing to warn about
    line = mismatch_warning("cpu:AMD EPYC", "cuda:NVIDIA H200", asked=True)
    assert line is not None and "\n" not in line and "fix:" in line and "--refine" not in line
    # a model that chose the plan: its cuts are the other hardware's too, and refining on the target is a fix
    line = mismatch_warning("cpu:AMD EPYC", "cuda:NVIDIA H200", asked=True, planning=True)
    assert line is not None and "\n" not in line and "cuts" in line and "--refine K" in line


def test_predict_costs_a_split_piece_as_the_piece_not_its_whole_table(saved_ensemble, tmp_path):
    """A shards file's column slices and row ranges are predicted from their piece features (a quarter of the
    rows carries a quarter of the lookups), not as the whole table."""
    from embshard.jobs import predict

    root, ids = saved_ensemble
    rows = int(pd.read_parquet(root / "tables.parquet").set_index("table_id").loc[ids[0], "rows"])
    shards = pd.DataFrame({"sample_id": ["whole", "row", "col"], "table_ids": [[ids[0]]] * 3,
                           "num_devices": [4, 4, 4], "origin": ["user"] * 3,
                           "col_sizes": [[-1], [-1], [4]], "row_offsets": [[-1], [0], [-1]],
                           "row_sizes": [[-1], [rows // 4], [-1]]})
    schemas.write(shards, tmp_path / "shards.parquet", "shards")
    df = predict.run(str(root / "tables.parquet"), str(tmp_path / "shards.parquet"), str(tmp_path / "p.parquet"),
                     model_uri=str(root / "model")).set_index("sample_id")
    whole = df.loc["whole", "working_set_bytes"]
    assert df.loc["row", "working_set_bytes"] < whole and df.loc["col", "working_set_bytes"] < whole
    assert df.loc["row", "total_ms"] != df.loc["whole", "total_ms"] != df.loc["col", "total_ms"]


def test_predict_reads_a_table_spec_as_the_ingest_stage_does(saved_ensemble, tmp_path):
    """`embshard predict --tables my_tables.csv`: a spec is read as `embshard ingest --source spec` reads it, so the
    predictions are those of the ingested tables.parquet."""
    from embshard.cli import main
    from embshard.jobs import predict

    root, _ = saved_ensemble
    spec_csv = tmp_path / "my_tables.csv"
    spec_csv.write_text("name,num_embeddings,embedding_dim,pooling_factor\nu0,5000,16,2.0\nu1,200000,64,4.0\n")
    assert main(["ingest", "--source", "spec", "--input", str(spec_csv), "--out", str(tmp_path / "in"),
                 "--no-progress"]) == 0
    pd.DataFrame({"sample_id": ["both"], "table_ids": ["u0 u1"], "num_devices": [4]}).to_csv(
        tmp_path / "shards.csv", index=False)
    got = {name: predict.run(str(tables), str(tmp_path / "shards.csv"), str(tmp_path / f"{name}.parquet"),
                             model_uri=str(root / "model"))
           for name, tables in (("spec", spec_csv), ("parquet", tmp_path / "in" / "tables.parquet"))}
    pd.testing.assert_frame_equal(got["spec"], got["parquet"])
    assert got["spec"]["total_ms"].iloc[0] > 0
