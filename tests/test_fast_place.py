"""`embshard place` is fast to get: what it loads, not how long it takes (benchmarks/place_wall_time.py times it).

A heuristic loads no model and imports neither torch nor MLflow; the infeasible-memory error comes before any model
load (no MLflow store needed); --cost-model still gives predicted costs; the learned planner and the cost model load
from a local sqlite store without MLflow, with the alias resolved on every call.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from embshard import registry, schemas

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAVY = ("torch", "mlflow", "torchrec", "airflow", "fbgemm_gpu")

# Runs the CLI in a fresh interpreter and reports its exit code and the heavy modules it imported.
_PROBE = f"""
import json, sys
from embshard.cli import main
rc = main(sys.argv[2:])
json.dump({{"rc": rc, "modules": sorted(m for m in {HEAVY!r} if m in sys.modules)}}, open(sys.argv[1], "w"))
"""


def run_cli(tmp_path, argv: list[str], store: str | None) -> tuple[dict, subprocess.CompletedProcess]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(REPO, "components"), REPO])}
    env.pop("MLFLOW_REGISTRY_URI", None)
    env["MLFLOW_TRACKING_URI"] = store or f"sqlite:///{tmp_path}/no-store-here/mlflow.db"
    report = tmp_path / f"probe-{len(os.listdir(tmp_path))}.json"
    proc = subprocess.run([sys.executable, "-c", _PROBE, str(report), *argv], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, check=False)
    assert report.exists(), proc.stderr[-2000:]
    return json.loads(report.read_text()), proc


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A local sqlite store with tiny untrained models: embshard-cost v1, v2 (champion: v1) and embshard-policy
    v1 (champion) bundling cost v1."""
    import mlflow

    from embshard.costmodel.ensemble import CostEnsemble
    from embshard.costmodel.model import CostModel, CostModelConfig
    from embshard.costmodel.pyfunc import CostModelPyfunc
    from embshard.features import FeatureScaler, feature_matrix
    from embshard.ingest.synthetic import generate_tables
    from embshard.planners.registered import PolicyPythonModel
    from embshard.policy.core import PolicyNet
    from embshard.policy.model import policy_artifacts

    root = tmp_path_factory.mktemp("fast-store")
    df = generate_tables(30, seed=5, bins_batch_size=1024)
    tables = str(root / "tables.parquet")
    schemas.write(df, tables, "tables")
    uri = f"sqlite:///{root}/mlflow.db"
    old = os.environ.get("MLFLOW_TRACKING_URI")
    os.environ["MLFLOW_TRACKING_URI"] = uri
    try:
        registry.use(root, experiment="fast-place")
        feats = feature_matrix(df)
        models = [CostEnsemble([CostModel.create(CostModelConfig(), FeatureScaler.fit(feats))]) for _ in range(2)]
        for k, m in enumerate(models):
            v = registry.log_and_register(CostModelPyfunc(), m.save(str(root / f"cost{k}")), registry.COST_MODEL, {})
        registry.set_alias(registry.COST_MODEL, registry.CHAMPION, 1)
        arts = policy_artifacts(PolicyNet(hidden=16), models[0], str(root / "bundle"))
        v = registry.log_and_register(PolicyPythonModel(), arts, registry.POLICY_MODEL, {})
        registry.set_alias(registry.POLICY_MODEL, registry.CHAMPION, v.version)
    finally:
        mlflow.set_tracking_uri(None)
        if old is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = old
    return {"uri": uri, "tables": tables, "feats": feats, "models": models, "root": str(root)}


def _place(tables, out, planner, *extra, memory_gb="64"):
    return ["place", "--tables", tables, "--devices", "4", "--memory-gb", memory_gb, "--planner", planner,
            "--out", str(out), *extra]


def test_help_imports_nothing_heavy(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.path.join(REPO, "components")}
    code = "import sys\nfrom embshard.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n" \
           "print(sorted(m for m in ('torch', 'mlflow', 'pandas', 'airflow') if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert proc.stdout.strip().splitlines()[-1] == "[]"
    assert "place" in proc.stdout and "train-cost" in proc.stdout


def test_heuristic_loads_no_model_and_needs_no_store(store, tmp_path):
    out = tmp_path / "o"
    got, proc = run_cli(tmp_path, _place(store["tables"], out, "lookup_greedy"), None)
    assert got["rc"] == 0, proc.stderr[-2000:]
    assert got["modules"] == [], f"a heuristic imported {got['modules']}"
    assert "predicted costs: none" in proc.stdout and "--cost-model" in proc.stdout
    assert schemas.read(out / "placements.parquet", "placements")["predicted_cost_ms"].isna().all()
    assert not (tmp_path / "no-store-here").exists(), "a heuristic created an MLflow store"


def test_infeasible_memory_is_reported_before_any_model_load(store, tmp_path):
    """The learned planner (the default) with tables larger than all devices together and no MLflow store at all:
    the one-line memory error, with neither torch nor MLflow imported."""
    out = tmp_path / "o"
    got, proc = run_cli(tmp_path, ["place", "--tables", store["tables"], "--devices", "2", "--memory-gb", "0.01",
                                   "--out", str(out)], None)
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert got["rc"] == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("embshard place: error:") and "field 'memory_gb'" in lines[0]
    assert "GiB missing" in lines[0] and "tables.parquet" in lines[0]
    assert got["modules"] == [] and not out.exists()


def test_a_spec_that_cannot_fit_is_refused_before_its_tables_are_read(tmp_path, monkeypatch, capsys):
    """A spec's access features take ~26 ms a table to sample (5,000 tables: minutes): tables that cannot fit all
    devices are refused from the spec's sizes, before any sampling."""
    from embshard.cli import main
    from embshard.ingest import spec

    path = tmp_path / "big.csv"
    path.write_text("name,num_embeddings,embedding_dim,pooling_factor\n" + "".join(
        f"t{i},1000000,64,5\n" for i in range(50)) + "huge,100000000000000,512,1\n")

    def no_sampling(*args, **kwargs):
        raise AssertionError("the spec's features were sampled before the memory check")

    monkeypatch.setattr(spec, "tables_from_spec", no_sampling)
    out = tmp_path / "o"
    assert main(["place", "--tables", str(path), "--devices", "8", "--memory-gb", "16", "--planner", "size_greedy",
                 "--out", str(out)]) == 2
    assert not out.exists()
    err = capsys.readouterr().err  # the table that alone needs most of it is named, with its rows
    assert "table huge alone needs" in err and "100,000,000,000,000 rows" in err, err


def test_cost_model_given_gives_predicted_costs_without_mlflow(store, tmp_path):
    out = tmp_path / "o"
    got, proc = run_cli(tmp_path, _place(store["tables"], out, "lookup_greedy", "--cost-model",
                                         registry.COST_CHAMPION_URI), store["uri"])
    assert got["rc"] == 0, proc.stderr[-2000:]
    assert "predicted costs: none" not in proc.stdout and "predicted step cost" in proc.stdout
    assert "mlflow" not in got["modules"], "a local store's model loaded through MLflow"
    assert schemas.read(out / "placements.parquet", "placements")["predicted_cost_ms"].notna().all()


def test_learned_loads_from_a_local_store_without_mlflow(store, tmp_path):
    out = tmp_path / "o"
    got, proc = run_cli(tmp_path, _place(store["tables"], out, "learned", "--search-evaluations", "50"),
                        store["uri"])
    assert got["rc"] == 0, proc.stderr[-2000:]
    assert "mlflow" not in got["modules"] and "torch" in got["modules"]
    df = schemas.read(out / "placements.parquet", "placements")
    assert set(df["planner"]) == {"learned"} and df["predicted_cost_ms"].notna().all()
    # A cost model where the policy goes: the same one-line error as through MLflow.
    got, proc = run_cli(tmp_path, _place(store["tables"], tmp_path / "o2", "learned", "--model",
                                         registry.COST_CHAMPION_URI), store["uri"])
    assert got["rc"] == 2 and "cost model" in proc.stderr and "embshard-policy" in proc.stderr, proc.stderr


def test_fast_load_resolves_the_alias_every_call_and_matches_mlflow(store, monkeypatch):
    import mlflow

    from embshard.costmodel import load

    monkeypatch.setenv("MLFLOW_TRACKING_URI", store["uri"])
    mlflow.set_tracking_uri(store["uri"])
    try:
        shards = [np.array([0, 1, 2]), np.array([3]), np.arange(4, 12)]
        want = [m.predict_shards(store["feats"], shards, 4) for m in store["models"]]
        assert not np.array_equal(want[0], want[1])  # two versions the test can tell apart
        first = registry.local_artifacts(registry.COST_CHAMPION_URI)
        assert first is not None and all(os.path.isfile(p) for p in first.values())
        assert np.array_equal(load(registry.COST_CHAMPION_URI).predict_shards(store["feats"], shards, 4), want[0])
        # MLflow's own load of the same version gives the same model.
        wrapper = registry.load_python_model(registry.COST_CHAMPION_URI)
        assert np.array_equal(wrapper.model.predict_shards(store["feats"], shards, 4), want[0])
        registry.set_alias(registry.COST_MODEL, registry.CHAMPION, 2)  # the champion moves: seen at once
        try:
            assert registry.local_artifacts(registry.COST_CHAMPION_URI) != first
            assert np.array_equal(load(registry.COST_CHAMPION_URI).predict_shards(store["feats"], shards, 4),
                                  want[1])
            assert np.array_equal(load(f"models:/{registry.COST_MODEL}/1").predict_shards(store["feats"], shards, 4),
                                  want[0])
        finally:
            registry.set_alias(registry.COST_MODEL, registry.CHAMPION, 1)
        # Not plainly in the store: MLflow's path decides (and words the error).
        assert registry.local_artifacts(f"models:/{registry.COST_MODEL}@nope") is None
        assert registry.local_artifacts("runs:/abc/model") is None
    finally:
        mlflow.set_tracking_uri(None)


def test_a_device_filled_above_95_percent_is_warned_about():
    """--memory-gb counts embedding weights only: a plan filling a device to 99.9% of it runs out of memory in
    training, so `place` says so in one line (and says nothing for a plan with room)."""
    from embshard.ingest.synthetic import generate_tables
    from embshard.placement import Placement, Shard
    from embshard.planners.base import full_warning
    from embshard.tableset import TableSet

    ts = TableSet.from_frame(generate_tables(4, seed=0, bins_batch_size=256))
    sizes = ts.size_bytes
    shards = [Shard(i, i % 2) for i in range(4)]
    fullest = max(int(sizes[0] + sizes[2]), int(sizes[1] + sizes[3]))
    warned = [full_warning(Placement(ts, 2, int(fullest / m), shards, task_id="t")) for m in (0.99, 0.80)]
    assert warned[1] is None and "above 95%" in warned[0] and "--memory-gb" in warned[0]


def test_tables_of_a_type_the_cost_model_never_measured_are_warned_about():
    """The cost model's features carry a table's bytes, not its type: a model measured on FP32 tables prices an
    FP16 table as an FP32 one of half the bytes (measured 9-44% above that on this CPU). `place` names such tables
    in one line; nothing for the types it saw, or for a model that did not record them (older)."""
    from dataclasses import replace
    from types import SimpleNamespace

    import numpy as np

    from embshard.ingest.synthetic import generate_tables
    from embshard.planners.scoring import unseen_types_warning
    from embshard.tableset import TableSet

    ts = TableSet.from_frame(generate_tables(5, seed=0, bins_batch_size=256))
    ts = replace(ts, bytes_per_element=np.array([4, 2, 4, 2, 4]))
    lines = [unseen_types_warning(SimpleNamespace(config=SimpleNamespace(element_bytes_seen=seen)), ts)
             for seen in ([4], [2, 4], [])]
    warned = [line for line in lines if line]
    assert len(warned) == 1 and lines[0] is not None, warned
    assert warned[0].startswith(f"2 table(s) of 2 bytes per element ({ts.table_ids[1]}, {ts.table_ids[3]})")
    assert "saw 4 bytes per element" in warned[0]
    assert "16-34% below" in warned[0] and "benchmarks.model_ab" in warned[0]  # how far off, and what to do


def test_evaluate_warns_when_it_measures_another_batch_than_the_models(caplog):
    """A user's evaluation at --batch-size 512 read the learned plan 1.03x the best greedy (0.70x at the model's
    2048) without a word: the planner plans for the batch its cost model was measured at."""
    import logging
    from types import SimpleNamespace

    from embshard.bench.runner import MeasureSettings
    from embshard.evaluation import warn_batch_mismatch

    planners = {"learned": SimpleNamespace(cost_model=SimpleNamespace(config=SimpleNamespace(batch_size=2048))),
                "lookup_greedy": SimpleNamespace(),
                "old": SimpleNamespace(cost_model=SimpleNamespace(config=SimpleNamespace(batch_size=None)))}
    with caplog.at_level(logging.WARNING, logger="embshard.evaluation"):
        assert warn_batch_mismatch(planners, MeasureSettings(batch_size=512, device="cpu")) == 512
        assert warn_batch_mismatch(planners, MeasureSettings(device="cpu")) == 2048  # the CPU's default: no word
        planners["learned"].cost_model.config.batch_size = 65536  # a GPU's model, measured here at the CPU's default
        warn_batch_mismatch(planners, MeasureSettings(device="cpu"))
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2 and warned[0].startswith("learned plans with a cost model measured at batch 2048; this "
                                                     "evaluation measures batch 512"), warned
    assert "(fix: leave out --batch-size, or give --batch-size 2048)" in warned[0]
    assert "(fix: give --batch-size 65536)" in warned[1]  # nothing was given to leave out


def test_table_ids_torchrec_cannot_take_are_warned_about_when_ingesting_and_placing(tmp_path, caplog):
    """A '.' in a table id plans fine but fails at export ('cannot name TorchRec tables'): ingest and place say so
    first."""
    import logging

    from embshard.cli import main
    from embshard.jobs.place import place

    spec = tmp_path / "dot.csv"
    spec.write_text("name,num_embeddings,embedding_dim,pooling_factor\nuser.age,100,16,1.0\nb,100,16,1.0\n")
    with caplog.at_level(logging.WARNING, logger="embshard.jobs"):
        place(str(spec), str(tmp_path / "o"), devices=2, memory_bytes=1 << 30, planner="size_greedy")
        assert main(["ingest", "--source", "spec", "--input", str(spec), "--out", str(tmp_path / "t"),
                     "--no-progress"]) == 0
        from embshard.jobs import ingest  # what the pipeline's ingest stage calls

        ingest.run("spec", str(tmp_path / "t2"), input=str(spec), progress=False)
    said = [r for r in caplog.records if r.name == "embshard.jobs.ingest" and "user.age" in r.getMessage()]
    assert len(said) == 2  # the CLI's ingest and the stage's
    warned = [(r.name, r.getMessage()) for r in caplog.records]
    for job in ("embshard.jobs.place", "embshard.jobs.ingest"):
        assert any(n == job and "user.age" in w and "cannot be exported to TorchRec" in w for n, w in warned), warned
    assert (tmp_path / "o" / "plan.json").exists() and (tmp_path / "t" / "tables.parquet").exists()
    # recorded in the plan too, for whoever reads only the plan (the export, a training job)
    plan = json.loads((tmp_path / "o" / "plan.json").read_text())
    assert any("user.age" in w and "cannot be exported to TorchRec" in w for w in plan["meta"]["warnings"])


def _closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_tracking_server_that_does_not_answer_fails_in_one_line_at_once(store, tmp_path, monkeypatch):
    """MLflow's client retries a refused connection for about 8 minutes, then blamed the model ("train and
    register it first"); the server is now asked for EMBSHARD_MLFLOW_WAIT_S (10 s), and the error says it is down."""
    out = tmp_path / "o"
    monkeypatch.setenv(registry.WAIT_ENV, "0")  # one try (by default it is asked again for 10 s)
    got, proc = run_cli(tmp_path, _place(store["tables"], out, "learned"), f"http://127.0.0.1:{_closed_port()}")
    assert got["rc"] == 75  # a store that did not answer: try again (a cluster's stage pod is retried), not bad input
    err = proc.stderr.strip().splitlines()[-1]
    assert "tracking server does not answer" in err and "start the server" in err, proc.stderr[-2000:]
    assert not out.exists()


def test_a_store_mlflow_cannot_use_is_one_line_naming_it_and_an_empty_file_is_left_empty(store, tmp_path):
    """A damaged or truncated mlflow.db, a folder, a scheme MLflow has no store for and a bare path had each been a
    100-180-line traceback (SQLAlchemy's or MLflow's), exit 1 (the folder after 100 s of retries); an empty file got
    MLflow's whole schema written into it by commands that only read."""
    damaged = tmp_path / "damaged.db"
    damaged.write_bytes(b"garbage, not sqlite\n" * 50)
    truncated = tmp_path / "truncated.db"
    truncated.write_bytes(Path(store["uri"][len("sqlite:///"):]).read_bytes()[:50_000])
    cases = [(f"sqlite:///{damaged}", "the MLflow store is damaged (file is not a database)"),
             (f"sqlite:///{truncated}", "the MLflow store is damaged (database disk image is malformed)"),
             (f"sqlite:///{tmp_path}", "the MLflow store is a folder, not a sqlite file"),  # MLflow retried 100 s
             ("foo://bar", "not a store URI MLflow takes"),
             (str(tmp_path / "x.db"), "a path or file:// URI is MLflow's retired file store")]
    for uri, words in cases:
        got, proc = run_cli(tmp_path, ["champion"], uri)
        err = proc.stderr.strip().splitlines()
        assert got["rc"] == 2 and len(err) == 1, (uri, proc.stderr[-1500:])
        assert words in err[0] and "field 'MLFLOW_TRACKING_URI'" in err[0] and uri in err[0], err
    empty = tmp_path / "empty.db"
    empty.touch()
    got, proc = run_cli(tmp_path, _place(store["tables"], tmp_path / "o", "learned"), f"sqlite:///{empty}")
    assert got["rc"] == 2 and "is an empty file" in proc.stderr and empty.stat().st_size == 0


def test_a_disk_that_fails_a_write_is_one_line_and_publishes_nothing(store, tmp_path, monkeypatch, capsys):
    """No space left (or a file system gone read-only) mid-write had been a 25-51-line traceback, exit 1."""
    import errno

    from embshard import placement_report
    from embshard.cli import main

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "o" / "devices.png"))

    monkeypatch.setattr(placement_report, "plot_device_costs", full)
    rc = main(_place(store["tables"], tmp_path / "o", "lookup_greedy"))
    err = [line for line in capsys.readouterr().err.strip().splitlines() if ": error:" in line or "Traceback" in line]
    assert rc == 74 and len(err) == 1 and "no space left on device" in err[0] and "free space" in err[0], err
    assert not (tmp_path / "o" / "plan.json").exists()  # the staged outputs were not published


def test_a_store_locked_by_another_writer_is_one_line_to_try_again(store, monkeypatch):
    """Another process holding a write transaction on the sqlite file had ended `place --planner learned` and
    `champion --set` in a 79-112-line SQLAlchemy traceback, exit 1; it is a store to try again (exit 75)."""
    import sqlite3

    monkeypatch.setenv("MLFLOW_TRACKING_URI", store["uri"])
    try:
        try:
            raise sqlite3.OperationalError("database is locked")
        except sqlite3.OperationalError as inner:
            raise RuntimeError("(sqlite3.OperationalError) database is locked") from inner
    except RuntimeError as exc:
        err = registry.store_error(exc)
    assert err is not None and err.exit_code == 75 and "locked by another process" in str(err)
    assert store["uri"] in str(err)


def test_load_planner_takes_the_planners_settings_and_a_path_is_not_called_a_model_to_register(store, monkeypatch):
    import embshard
    from embshard.errors import ModelNotFoundError

    monkeypatch.setenv("MLFLOW_TRACKING_URI", store["uri"])
    planner = embshard.load_planner(registry.POLICY_CHAMPION_URI, time_budget_s=5.0, search_evaluations=123)
    assert planner.time_budget_s == 5.0 and planner.search_evaluations == 123
    with pytest.raises(ModelNotFoundError, match="models:/NAME@ALIAS") as exc:
        embshard.load_planner("/no/such/model")
    assert "train and register" not in str(exc.value)


def test_a_python_plan_gets_the_predicted_costs_place_writes(store, tmp_path, monkeypatch):
    """From Python, `planner.predicted_costs(placement)` gives each device's predicted ms (a plan alone carries
    none, and write_plan_json wrote null costs): the same numbers `embshard place` writes into plan.json."""
    import json

    import embshard
    from embshard.export import write_plan_json
    from embshard.tableset import TableSet

    monkeypatch.setenv("MLFLOW_TRACKING_URI", store["uri"])
    planner = embshard.load_planner(registry.POLICY_CHAMPION_URI)
    placement = planner.plan(TableSet.read(store["tables"]), num_devices=4, memory_bytes_per_device=2**36,
                             task_id="task")
    costs = planner.predicted_costs(placement)
    assert costs.shape == (4,) and (costs > 0).all()
    written = write_plan_json(placement, tmp_path / "plan.json", device_costs=costs,
                              balanced_estimate=planner.balanced_estimate(placement))
    assert written["cost"]["device_costs_ms"] == pytest.approx(costs.tolist())
    out = tmp_path / "placed"
    got, proc = run_cli(tmp_path, ["place", "--tables", store["tables"], "--devices", "4", "--memory-gb", "64",
                                   "--planner", "learned", "--out", str(out)], store["uri"])
    assert got["rc"] == 0, proc.stderr[-2000:]
    placed = json.loads(next(out.rglob("plan.json")).read_text())
    assert placed["cost"]["device_costs_ms"] == pytest.approx(costs.tolist(), rel=1e-5)
    # the README's snippet writes the same balanced estimate and gap as `place` (it had written null for both)
    for key in ("balanced_estimate_ms", "gap"):  # None in both where the model's own predictions withhold it
        assert (written["cost"][key] is None) == (placed["cost"][key] is None)
        if placed["cost"][key] is not None:
            assert written["cost"][key] == pytest.approx(placed["cost"][key], rel=1e-5)


def test_the_command_ignores_a_signal_while_the_interpreter_exits():
    """A Ctrl-C just after `place` printed "wrote ..." (in the half second the interpreter takes to exit) ended with
    exit 130, as if the command had been interrupted; its output was complete. The `embshard` command ignores
    SIGINT and SIGTERM once its work is done; `main` itself, which tests and other code call in-process, does not."""
    probe = ("import signal, sys\n"
             "from embshard.cli import console_main, main\n"
             "main(['champion'])\n"  # the store is missing: a one-line error, returned, not raised
             "assert signal.getsignal(signal.SIGINT) is not signal.SIG_IGN\n"
             "rc = console_main()\n"
             "print(rc, signal.getsignal(signal.SIGINT) is signal.SIG_IGN, "
             "signal.getsignal(signal.SIGTERM) is signal.SIG_IGN)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(REPO, "components"), REPO]),
           "MLFLOW_TRACKING_URI": "sqlite:////nonexistent/embshard/mlflow.db"}
    proc = subprocess.run([sys.executable, "-c", probe, "champion"], env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.stdout.split() == ["2", "True", "True"], proc.stderr[-2000:]
