"""Runs refused before they start, and time limits (issue 26, items 1 and 4).

- embshard.params checks every parameter at once: unknown keys, types, ranges, the rules between fields, the
  input file; each problem named with its field and fix. The DAG's first task (check_params) applies it, and so
  does `embshard pipeline` before it starts Airflow.
- Every task's execution_timeout is sized when it starts from the run's params (measured stage times x work x
  timeout_scale); the run has a dagrun_timeout. A stuck stage is timed out by Airflow's own task runner.

The two DAG runs here are real dag.test() runs in a fresh interpreter (Airflow reads its config at import), run in
the background from the session's start (tests/background.py).
The REST path (a bad conf triggered through the API fails in check_params) is in tests/test_airflow_real.py.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import background
import pytest

from embshard import params
from embshard.errors import EmbshardError

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("conf, field, words", [
    ({"nosuch": 1}, "nosuch", "unknown parameter"),
    ({"num_tables": -5}, "num_tables", "minimum of 8"),
    # 2 tables had passed, then failed in train_cost_model after the benchmark ("only 1 training ... shards")
    ({"num_tables": 2, "tables_per_task": "1"}, "num_tables", "minimum of 8"),
    ({"devices": -3}, "devices", "minimum of 1"),
    ({"devices": 2.5}, "devices", "not of type 'integer'"),
    ({"tables_per_task": "abc"}, "tables_per_task", "does not match"),
    ({"tables_per_task": "60-20"}, "tables_per_task", "runs backwards"),
    ({"tables_per_task": "0-5"}, "tables_per_task", "does not match"),
    ({"num_tables": 10, "tables_per_task": "20-60"}, "tables_per_task", "the 5 tables of the test pool"),
    ({"num_tables": 240, "tables_per_task": "100-200"}, "tables_per_task", "from the 120 tables of the test pool"),
    ({"eval_planners": ["dim_greedy", "nosuchplanner"]}, "eval_planners", "'nosuchplanner' is not one of"),
    ({"eval_planners": "dim_greedy,nosuchplanner"}, "eval_planners", "'nosuchplanner' is not one of"),
    ({"eval_planners": []}, "eval_planners", "should be non-empty"),
    ({"eval_planners": ["dim_greedy", "dim_greedy"]}, "eval_planners", "non-unique"),
    ({"source": "spec"}, "input", "needs an input file"),
    ({"source": "dlrm", "input": "/no/such/trace.pt.gz"}, "input", "no file"),
    ({"input": "/tmp/x.csv"}, "input", "reads no file"),
    ({"memory_gb": 0}, "memory_gb", "less than or equal to the minimum of 0"),
    ({"memory_gb": float("nan")}, "memory_gb", "not a finite number"),
    ({"promotion_margin": 1.5}, "promotion_margin", "greater than the maximum"),
    ({"device": "tpu"}, "device", "is not one of"),
    ({"export_tasks": "everything"}, "export_tasks", "is not one of"),
    ({"seed": -1}, "seed", "minimum of 0"),
    ({"policy_rounds": 4}, "policy_rounds", "maximum of 3"),
    ({"timeout_scale": 0}, "timeout_scale", "minimum of 0.001"),
    ({"bench_shards": 10, "bench_chunks": 1024}, "bench_chunks", "1024 chunks for 10 shards"),
    ({"recalibrate_comm": "yes"}, "recalibrate_comm", "not of type 'boolean'"),
    # TorchRec names a rank's GPU by its index on its host, and torch's indices stop at 127.
    ({"devices": 256}, "devices_per_host", "256 devices on one host"),
    ({"devices": 12, "devices_per_host": 8}, "devices_per_host", "do not split into hosts of 8"),
    ({"devices_per_host": 0}, "devices_per_host", "minimum of 1"),
    # what a DLRM trace lacks: its own source only, and values ingest's --dim / --data-type would take
    ({"source": "dlrm", "input": "s3://b/t.pt", "dim": 6}, "dim", "6 is not a multiple of 4"),
    ({"source": "dlrm", "input": "s3://b/t.pt", "dim": "0"}, "dim", "0 is not a multiple of 4"),
    ({"source": "dlrm", "input": "s3://b/t.pt", "dim": "big"}, "dim", "'big' is neither a whole number nor 'mixed'"),
    ({"source": "dlrm", "input": "s3://b/t.pt", "dim": 70_000}, "dim", "from 4 to 65,536"),
    ({"source": "dlrm", "input": "s3://b/t.pt", "data_type": "fp8"}, "data_type", "is not one of"),
    ({"source": "dlrm", "input": "s3://b/t.pt", "rows_file": "/no/such/rows.txt"}, "rows_file", "no file"),
    ({"dim": 64}, "dim", "only a dlrm trace needs dims, data type and hash sizes given; source synthetic"),
    ({"data_type": "fp16"}, "data_type", "only a dlrm trace needs"),
    ({"rows_file": "/no/such/rows.txt"}, "rows_file", "only a dlrm trace needs"),
])
def test_each_bad_value_is_named_with_its_fix(conf, field, words):
    found = params.problems(conf)
    assert [f for f, _, _ in found] == [field], found
    (_, what, fix), = found
    assert words in what and fix


def test_fp16_weights_of_a_synthetic_run_point_to_fp16_fraction():
    """`ingest --source synthetic --data-type fp16` exists; the pipeline's way is fp16_fraction, and its fix says so."""
    (field, _, fix), = params.problems({"data_type": "fp16"})
    assert field == "data_type" and "fp16_fraction (1: every table)" in fix
    spec = {f: fix for f, _, fix in params.problems({"source": "spec", "input": "x.csv", "data_type": "fp16"})}
    assert "data_type" in spec and "fp16_fraction" not in spec["data_type"]  # a spec lists its types


def test_every_problem_at_once_in_one_line():
    conf = {"nosuch": 1, "num_tables": -5, "tables_per_task": "abc", "eval_planners": ["nosuchplanner"]}
    with pytest.raises(EmbshardError) as exc:
        params.check(conf)
    text = str(exc.value)
    assert "\n" not in text and text.startswith("field 'nosuch,num_tables,tables_per_task,eval_planners'")
    for f in ("nosuch:", "num_tables:", "tables_per_task:", "eval_planners:"):
        assert f in text
    assert text.count("(fix: ") == 4


def test_defaults_pass_and_existing_files_and_uris_are_accepted(tmp_path):
    assert params.check({}) == params.DEFAULT_PARAMS
    spec = tmp_path / "t.csv"
    spec.write_text("name,num_embeddings,embedding_dim,pooling_factor\n" + "".join(f"t{i},10,4,1\n" for i in range(8)))
    small = {"source": "spec", "tables_per_task": "1-2"}
    assert params.check({**small, "input": str(spec)})["input"] == str(spec)
    assert params.check({**small, "input": f"file://{spec}"})
    assert params.check({"source": "dlrm", "input": "s3://bucket/trace.pt.gz"})  # checked by ingest, not here
    # a comma string (embshard pipeline --param, older confs) is the same list
    assert params.check({"eval_planners": "dim_greedy, size_greedy"})["eval_planners"] == ["dim_greedy",
                                                                                             "size_greedy"]


def test_eval_planner_choices_are_planners():
    from embshard.planners import available_planners

    assert set(params.EVAL_PLANNER_CHOICES) <= set(available_planners())


def test_the_form_enforces_types_and_choices_only():
    """Ranges and patterns stay out of the form: Airflow's form clamped -5 to the minimum silently and answered a
    broken pattern with a toast naming nothing; check_params names them instead."""
    for key in params.SPECS:
        schema = params.form_schema(key)
        assert not {"minimum", "maximum", "exclusiveMinimum", "pattern", "minItems"} & set(schema), key
    assert params.form_schema("eval_planners")["items"]["enum"] == list(params.EVAL_PLANNER_CHOICES)
    assert params.form_schema("device") == {"enum": ["auto", "cpu", "cuda"]}


def test_time_limits_follow_the_work_and_the_scale():
    base = params.stage_timeout_s("benchmark", {"device": "cpu"})
    assert base >= params.FLOOR_S["benchmark"]
    assert params.stage_timeout_s("benchmark", {"device": "cpu", "bench_shards": 100_000}) > 10 * base
    assert params.stage_timeout_s("benchmark", {"device": "cpu", "timeout_scale": 2}) == pytest.approx(2 * base)
    # at least SAFETY times the measured default run, for every stage
    measured = {"ingest": 9.3, "sample_shards": 6.6, "benchmark": 155.6 / 3, "train_cost_model": 20.4,
                "train_policy": 18.0, "measure_policy_plans": 8.4, "evaluate_and_promote": 114.8,
                "export_placements": 6.5}
    for stage, seconds in measured.items():
        assert params.stage_timeout_s(stage, {"device": "cpu"}) >= params.SAFETY * seconds, stage


def test_run_timeout_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("EMBSHARD_RUN_TIMEOUT_H", "6")
    assert params.run_timeout_h() == 6
    monkeypatch.setenv("EMBSHARD_RUN_TIMEOUT_H", "-1")
    with pytest.raises(EmbshardError, match="EMBSHARD_RUN_TIMEOUT_H"):
        params.run_timeout_h()


# --- real DAG runs ---------------------------------------------------------------------------------------------
RUNNER = textwrap.dedent("""
    import json, sys, time
    from embshard import pipeline, stages
    env = pipeline.setup_environment(sys.argv[1])
    from airflow import settings
    from airflow.utils.db import initdb
    settings.DAGS_FOLDER = env["AIRFLOW__CORE__DAGS_FOLDER"]
    if sys.argv[3] == "stuck":
        def stuck(root, params):
            time.sleep(120)  # a hung stage
        stages.STAGES["ingest"] = stuck
    initdb()
    dag = pipeline.load_dag()
    dag_run = dag.test(run_conf=json.loads(sys.argv[2]))
    states = {ti.task_id: str(ti.state) for ti in dag_run.get_task_instances()}
    print("RESULT " + json.dumps({"state": str(dag_run.state), "tasks": states,
                                  "data": stages.run_root(env["EMBSHARD_DATA_ROOT"], dag_run.run_id)}))
""")


def _dag_test(conf: dict, mode: str) -> tuple[dict, str]:
    tmp_path = Path(tempfile.mkdtemp(prefix=f"embshard-dag-guard-{mode}-"))
    env = {k: v for k, v in background.ENV.items() if not k.startswith(("AIRFLOW", "MLFLOW", "EMBSHARD_"))}
    env.update(AIRFLOW__CORE__LOAD_EXAMPLES="False", EMBSHARD_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", RUNNER, str(tmp_path), json.dumps(conf), mode], env=env,
                          capture_output=True, text=True, timeout=600, cwd=str(REPO))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "logs").glob("*.log")) \
        if (tmp_path / "logs").exists() else ""
    return json.loads(lines[0][len("RESULT "):]), proc.stdout + proc.stderr + logs


@background.job("bad_conf_run", order=1)
def _bad_conf_run() -> tuple[dict, str]:
    return _dag_test({"nosuch": 1, "tables_per_task": "60-20", "source": "spec"}, "normal")


@background.job("stuck_run", order=2)
def _stuck_run() -> tuple[dict, str]:
    # 0.01: ingest's limit 9 s (its 900 s floor), check_params' 1.2 s (its 120 s floor; at 0.002 its 0.24 s had
    # timed out the check itself on a busy machine)
    return _dag_test({"timeout_scale": 0.01}, "stuck")


@pytest.fixture()
def bad_conf_run():
    return background.result("bad_conf_run")


@pytest.fixture()
def stuck_run():
    return background.result("stuck_run")


@pytest.mark.slow
def test_bad_conf_fails_in_check_params_before_any_work(bad_conf_run):
    result, out = bad_conf_run
    assert result["state"] == "failed"
    assert result["tasks"]["check_params"] == "failed"
    assert result["tasks"]["ingest"] == "upstream_failed"
    assert not Path(result["data"]).exists()  # nothing written for the run
    for words in ("nosuch: unknown parameter", "tables_per_task: the range 60-20 runs backwards",
                  "input: source spec needs an input file"):
        assert words in out


@pytest.mark.slow
def test_a_stuck_stage_is_timed_out(stuck_run):
    """ingest hangs; with timeout_scale 0.01 its limit is 9 s (900 s floor): Airflow's task runner ends it."""
    result, out = stuck_run
    assert result["tasks"]["check_params"] == "success"
    assert result["tasks"]["ingest"] == "failed" and result["state"] == "failed"
    # said with the limit and the param that sizes it, and not retried: Airflow's own text was "Timeout, PID: N"
    assert re.search(r"the stage ran past its time limit of [0-9,]+ s \(sized from the run's params x "
                     r"timeout_scale\); not retried", out) and "larger timeout_scale" in out, out[-3000:]


def test_a_timed_out_stage_is_said_to_be_over_its_limit_with_the_param_that_sizes_it():
    """Airflow's own text was all the console said: 'ingest FAILED after 0.9 s: Timeout, PID: 6778'."""
    from airflow.sdk.exceptions import AirflowTaskTimeout

    from embshard import stages

    reason = stages.failure_reason(AirflowTaskTimeout("Timeout, PID: 6778"))
    assert "over its time limit" in reason and "timeout_scale" in reason
    assert stages.failure_reason(ValueError("first\nsecond")) == "first"
    assert stages.failure_reason(KeyError()) == "KeyError"
    # a full disk under MLflow's sqlite store: the cause, not SQLAlchemy's note on autoflush
    autoflush = ("(raised as a result of Query-invoked autoflush; consider using a session.no_autoflush block if "
                 "this flush is occurring prematurely)\n(sqlite3.OperationalError) database or disk is full\n"
                 "(Background on this error at: https://sqlalche.me/e/20/e3q8)")
    assert stages.failure_reason(RuntimeError(autoflush)) == "(sqlite3.OperationalError) database or disk is full"


def test_devices_per_host_gives_the_runs_tasks_their_hosts(tmp_path):
    """The ingest stage writes the param into tasks.parquet, where planning and export read each task's hosts."""
    from embshard import schemas, stages

    conf = {"num_tables": 40, "tables_per_task": "5-10", "num_tasks": 2, "devices": 8, "devices_per_host": 4}
    out = stages.ingest(str(tmp_path), params.check(conf))
    tasks = schemas.read(out["tasks"], "tasks")
    assert set(tasks["devices_per_host"]) == {4} and set(tasks["num_devices"]) == {8}


def test_a_spec_with_too_few_tables_for_the_tasks_is_caught_before_ingest():
    """The default tasks (20-60 tables) cannot be drawn from the Criteo-like spec's 26 tables (13 per pool): said
    by check_params, not by ingest after Airflow has started."""
    import os

    import embshard.ingest

    spec = os.path.join(os.path.dirname(embshard.ingest.__file__), "examples", "criteo_26.csv")
    found = params.problems({"source": "spec", "input": spec})
    assert [f for f, _, _ in found] == ["tables_per_task"]
    assert "the spec's 26 tables" in found[0][1] and "at most 13" in found[0][2]
    assert params.problems({"source": "spec", "input": spec, "tables_per_task": "5-13"}) == []


def test_a_clusters_check_params_leaves_the_input_file_to_the_ingest_pod():
    """The Airflow worker does not mount the data volume the stage pods read: a path there is not 'missing'."""
    from embshard import stages

    conf = {"source": "spec", "input": "/data/embshard/specs/t.csv"}
    with pytest.raises(EmbshardError, match="no file"):
        stages.check_params("", conf)
    assert stages.check_params("", conf, check_files=False)["source"] == "spec"


def test_the_ingest_pod_refuses_a_population_too_small_to_learn_from(tmp_path):
    """Where check_params cannot read the spec (a cluster's worker), the ingest stage counts its tables: 4 tables
    would fail in train_cost_model, after the benchmark."""
    from embshard import stages

    spec = tmp_path / "t.csv"
    spec.write_text("name,num_embeddings,embedding_dim,pooling_factor\n" + "".join(f"t{i},10,4,1\n" for i in range(4)))
    conf = {"source": "spec", "input": str(spec), "tables_per_task": "1", "num_tasks": 1}
    with pytest.raises(EmbshardError, match="4 tables: a run learns from at least 8") as err:
        stages.ingest(str(tmp_path / "root"), conf)
    assert err.value.field == "input" and str(spec) in str(err.value)


def test_pipeline_params_from_the_command_line_take_their_types_from_the_form():
    """--param devices_per_host=8 (an optional integer) is the integer 8, empty is null; a key that is not a
    param is named as unknown."""
    from embshard.pipeline import _parse_params

    assert _parse_params(["devices_per_host=8", "input=/x.csv"]) == {"devices_per_host": 8, "input": "/x.csv"}
    assert _parse_params(["devices_per_host="]) == {"devices_per_host": None}
    # null is the default
    assert _parse_params(["num_tables=null", "eval_planners=NULL"]) == {"num_tables": None, "eval_planners": None}
    with pytest.raises(EmbshardError, match="unknown parameter 'nosuch'"):
        _parse_params(["nosuch=1"])
    with pytest.raises(EmbshardError, match="has no '='"):
        _parse_params(["devices"])
    with pytest.raises(EmbshardError, match="devices_per_host='x' is not a whole number .*its default is None"):
        _parse_params(["devices_per_host=x"])


def test_every_param_is_in_the_contracts_table():
    """docs/contracts.md's param table had fallen behind params.SPECS (device, eval_rounds, timeout_scale)."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "contracts.md").read_text()
    rows = set(re.findall(r"^\| `([a-z0-9_]+)` \| ", text, flags=re.M))
    assert set(params.SPECS) <= rows, sorted(set(params.SPECS) - rows)


def test_param_mistakes_a_researcher_made_are_refused_up_front():
    """Found by running the pipeline as a researcher: a synthetic-only size with a spec source was ignored
    silently, fewer updates than rounds trained none in a round, a misspelt key got no suggestion."""
    from embshard import params
    from embshard.errors import EmbshardError

    spec = {"source": "spec", "input": "components/embshard/ingest/examples/criteo_26.csv", "tables_per_task": "5-10"}
    with pytest.raises(EmbshardError, match="num_tables: only the synthetic source generates tables"):
        params.check({**spec, "num_tables": 500})
    assert params.check(spec)["source"] == "spec"  # the default num_tables is no mistake
    with pytest.raises(EmbshardError, match="policy_iterations: 1 updates for 2 rounds"):
        params.check({"policy_iterations": 1, "policy_rounds": 2})
    with pytest.raises(EmbshardError, match="did you mean 'num_tables'"):
        params.check({"num_table": 5})


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is here: cuda is a valid device")
def test_cuda_asked_on_a_machine_without_it_fails_before_any_stage(tmp_path, capsys):
    """`embshard pipeline --param device=cuda` on a CPU host ran ingest first and failed in sample_shards."""
    from embshard import stages
    from embshard.cli import main
    from embshard.errors import EmbshardError

    assert main(["pipeline", "--quick", "--param", "device=cuda", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "CUDA is not available" in err[0] and "field 'device'" in err[0], err
    assert not (tmp_path / "run").exists()
    with pytest.raises(EmbshardError, match="CUDA is not available"):  # the DAG's first task under `embshard ui`
        stages.check_params("", {"device": "cuda"})
    assert stages.check_params("", {"device": "cuda"}, check_files=False)["device"] == "cuda"  # a cluster worker


def test_the_pipeline_summary_gives_commands_that_work_from_any_folder(tmp_path):
    """It printed `make mlflow-ui RUN_DIR=runs/x`, which works only from the repository with a relative out."""
    from embshard.pipeline import summary_text

    out = "runs/somewhere"
    store = f"sqlite:///{os.path.join(os.path.abspath(out), 'mlflow.db')}"
    text = summary_text({"env": {"MLFLOW_TRACKING_URI": store}, "root": str(tmp_path / "root"), "state": "success",
                         "seconds": 1.0, "run_id": "manual__x", "out": out})
    assert "make " not in text
    assert f"{os.path.dirname(sys.executable)}/mlflow ui --backend-store-uri '{store}'" in text
    assert f"ui --out {os.path.abspath(out)}" in text


# --- a DLRM trace's dims, data type and hash sizes (a user's runs on a trace got mixed dims, fp32, rows = max id + 1)
def _trace(path, tables: int, batch: int = 32) -> str:
    """A tiny zip-format DLRM trace: every sample looks up one id, table t's ids are 0..t+2 (t < 30)."""
    import torch

    lengths = torch.ones(tables, batch, dtype=torch.int64)
    indices = torch.cat([torch.arange(batch) % (t + 3) for t in range(tables)])
    torch.save((indices, torch.arange(tables * batch + 1), lengths), path)
    return str(path)


def test_a_dlrm_runs_dims_type_and_hash_sizes_reach_its_tables(tmp_path):
    import numpy as np

    from embshard import schemas, stages
    from embshard.ingest import dlrm
    from embshard.pipeline import _parse_params

    trace = _trace(tmp_path / "t.pt", 8)  # the smallest population a run takes (params.MIN_TABLES)
    rows = tmp_path / "rows.txt"
    rows.write_text(" ".join(str(100 + t) for t in range(8)))
    conf = {"source": "dlrm", "input": trace, "num_tasks": 1, "tables_per_task": "2", "devices": 2,
            **_parse_params(["dim=64", "data_type=fp16", f"rows_file=file://{rows}"])}  # as `--param` gives them
    assert conf["dim"] == "64" and params.check(conf)["rows_file"] == f"file://{rows}"
    stages.ingest(str(tmp_path / "root"), conf)
    df = schemas.read(str(tmp_path / "root" / "tables.parquet"), "tables")
    assert (df["dim"] == 64).all() and (df["bytes_per_element"] == 2).all()
    assert df["rows"].tolist() == list(range(100, 108))
    assert "dim=64;dtype=fp16;rows=file:" in df["source"].iloc[0]
    # the defaults are the ones ingest had: mixed dims, fp32, rows = the largest id + 1
    stages.ingest(str(tmp_path / "plain"), {**conf, "dim": None, "data_type": None, "rows_file": None})
    df = schemas.read(str(tmp_path / "plain" / "tables.parquet"), "tables")
    assert (df["bytes_per_element"] == 4).all() and df["rows"].tolist() == [t + 3 for t in range(8)]
    assert "dim=mixed" in df["source"].iloc[0]
    # params refuse what ingest's choose_dims refuses, and take what it takes; the data types are ingest's
    assert tuple(dlrm.DATA_TYPES) == params.DATA_TYPES
    for dim in ("mixed", " Mixed", 4, "64", 65_536, 0, 6, "6", "x", 65_540, -4):
        try:
            dlrm.choose_dims(dim, 1, 0)
            ok = True
        except EmbshardError:
            ok = False
        assert (params._dim_problem(dim) is None) == ok, dim
    assert np.array_equal(dlrm.choose_dims(" Mixed", 3, 1), dlrm.choose_dims("mixed", 3, 1))
    assert params._dim_problem(64.0) is None and params._dim_problem(64.5) is not None  # REST's 64.0 is 64
    # a default written another way is no value given to another source
    assert params.problems({"source": "synthetic", "rows_file": "", "dim": " Mixed", "tables_per_task": "2"}) == []
    # a trace is read from a local or mounted path: file:// is taken off, an s3:// URI is one line, not a traceback
    via_uri = dlrm.tables_from_trace(f"file://{trace}", dlrm.TraceOptions(dim=8), progress=False)
    assert len(via_uri) == 8 and (via_uri["trace_file"] == os.path.abspath(trace)).all()  # what bench replays
    with pytest.raises(EmbshardError, match="is a s3:// URI, but this file is read from a local path only"):
        dlrm.tables_from_trace("s3://bucket/t.pt", dlrm.TraceOptions(dim=8), progress=False)


def test_a_file_that_is_no_trace_is_refused_by_check_params(tmp_path):
    """A CSV given as a DLRM trace, or a truncated .pt, had passed check_params and failed in ingest once the run
    had started."""
    csv = tmp_path / "tables.csv"
    csv.write_text("name,num_embeddings,embedding_dim,pooling_factor\na,10,4,1\n")
    trace = _trace(tmp_path / "t.pt", 24)
    cut = tmp_path / "cut.pt"
    cut.write_bytes((tmp_path / "t.pt").read_bytes()[:300])
    for path, words in ((csv, "is not a torch.save file"), (cut, "is a damaged torch.save file")):
        found = params.problems({"source": "dlrm", "input": str(path), "tables_per_task": "2"})
        assert [f for f, _, _ in found] == ["input"] and words in found[0][1], found
        assert "a table spec is source spec" in found[0][2]
    assert params.problems({"source": "dlrm", "input": trace, "tables_per_task": "2"}) == []


def test_a_trace_too_small_for_the_tasks_is_refused_before_any_work(tmp_path, capsys):
    """On a 24-table trace the run failed in ingest, 30-37 s in; now check_params reads the trace's table count
    (its tensors' shapes, memory-mapped) and refuses at once, as it does for a spec's tables."""
    from embshard.cli import main

    trace = _trace(tmp_path / "t.pt", 24)
    found = params.problems({"source": "dlrm", "input": trace})  # tables_per_task 20-60 from 12 per pool
    assert found == [("tables_per_task", "tasks of up to 60 tables from the 12 tables of the test pool (the "
                      "trace's 24 tables, split into train and test pools)", "lower tables_per_task to at most 12, "
                      "e.g. 6-12")]
    assert params.check({"source": "dlrm", "input": trace, "tables_per_task": "6-12"})["input"] == trace
    # not where this process does not see the files (a cluster's worker), nor for a compressed trace
    assert params.problems({"source": "dlrm", "input": trace}, check_files=False) == []
    gz = tmp_path / "t.pt.gz"
    gz.write_bytes(__import__("gzip").compress((tmp_path / "t.pt").read_bytes()))
    assert params.problems({"source": "dlrm", "input": str(gz)}) == []
    # a hash-size file of another trace is refused here too, not after the trace was read
    rows = tmp_path / "rows.txt"
    rows.write_text("10 10 10")
    found = params.problems({"source": "dlrm", "input": trace, "tables_per_task": "6-12", "rows_file": str(rows)})
    assert found == [("rows_file", "has 3 hash sizes for 24 tables", "list one hash size per table of the trace")]
    # `embshard pipeline --quick` (tasks of 10-20 tables) on it: one line, before Airflow starts
    assert main(["pipeline", "--quick", "--out", str(tmp_path / "run"), "--param", "source=dlrm",
                 "--param", f"input={trace}", "--param", "dim=64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tables_per_task: tasks of up to 20 tables from the 12 tables" in err[0], err
    assert not (tmp_path / "run").exists()


def test_scheduled_runs_take_their_defaults_from_the_teams_params_file(tmp_path, monkeypatch):
    """A scheduled or asset-triggered run has no conf: it had retrained on the synthetic default whatever a team's
    tables were. EMBSHARD_PARAMS_FILE (JSON or YAML) makes the DAG's defaults the team's; a bad file is one error
    naming it (the DAG does not import), as a bad run's params are."""
    from airflow.dag_processing.dagbag import DagBag

    spec = tmp_path / "tables.csv"  # not read here: the process that parses the DAG may not see the data
    good = tmp_path / "params.yaml"
    good.write_text(f"source: spec\ninput: {spec}\ndevices: 8\nmemory_gb: 80\neval_planners: [dim_greedy]\n")
    monkeypatch.setenv(params.PARAMS_FILE_ENV, str(good))
    defaults = params.run_defaults()
    assert (defaults["source"], defaults["input"], defaults["devices"], defaults["memory_gb"]) == \
        ("spec", str(spec), 8, 80)
    assert defaults["num_tasks"] == params.DEFAULT_PARAMS["num_tasks"]  # the rest as they were
    bag = DagBag(dag_folder=str(REPO / "dags" / "embshard_pipeline.py"), safe_mode=False)
    assert bag.import_errors == {}
    dag_params = bag.dags["embshard_pipeline"].params
    assert (dag_params["source"], dag_params["input"], dag_params["devices"]) == ("spec", str(spec), 8)
    for text, words in (("devices: 0\n", ["devices", "minimum of 1"]), ("- a\n- b\n", ["holds a list"]),
                        ("source: [unclosed\n", ["not JSON or YAML"]), ("nosuch: 1\n", ["nosuch"])):
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        monkeypatch.setenv(params.PARAMS_FILE_ENV, str(bad))
        with pytest.raises(EmbshardError) as err:
            params.run_defaults()
        assert str(bad) in str(err.value) and all(w in str(err.value) for w in words), str(err.value)
    monkeypatch.setenv(params.PARAMS_FILE_ENV, str(tmp_path / "missing.yaml"))
    with pytest.raises(EmbshardError, match="missing.yaml: field 'EMBSHARD_PARAMS_FILE': cannot be read"):
        params.run_defaults()
    bag = DagBag(dag_folder=str(REPO / "dags" / "embshard_pipeline.py"), safe_mode=False)
    assert "missing.yaml" in str(bag.import_errors)


def test_an_asset_triggered_run_says_what_it_ingests_and_that_an_events_extra_is_not_read():
    from types import SimpleNamespace

    from embshard import stages

    p = params.check({"source": "spec", "input": "/data/tables.csv"}, check_files=False)
    from airflow.sdk import Asset

    asset = Asset(name="embshard_tables", uri="file:///embshard/tables")
    event = SimpleNamespace(asset=asset, source_dag_id="land_tables", source_run_id="r1",
                            extra={"input": "/data/tables-2026-12-08.csv", "rows": 5})
    lines = stages.trigger_note({asset: [event]}, p)
    assert lines[0] == ("this run was started by an update of asset file:///embshard/tables by land_tables (run "
                        "r1); it ingests the tables its params name: source=spec, input=/data/tables.csv")
    assert "names params (input) that a run does not read" in lines[1] and params.PARAMS_FILE_ENV in lines[1]
    assert stages.trigger_note(None, p) == [] and stages.trigger_note({}, p) == []
    assert len(stages.trigger_note({asset: [SimpleNamespace(asset=asset, extra={})]}, p)) == 1
