"""The `device` pipeline param reaches every stage that measures or calibrates (issue: the GPU pods measured the
CPU whatever hardware they ran on), and device=cuda where no GPU is visible is a one-line error before any work.

The jobs below the stages are replaced by recorders: these tests are about what each stage passes down, so they
fail if any measuring stage drops the device (or the all-to-all ranks that go with it). The measuring itself is
covered by tests/test_bench*.py (and on a GPU host by tests/test_bench_cuda.py, which also runs the stage path).
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from embshard import stages
from embshard.errors import EmbshardError

torch = pytest.importorskip("torch")


@pytest.fixture()
def fake_gpu_host(monkeypatch):
    """As if this process saw 4 GPUs: `auto` resolves to cuda and the all-to-all is measured among the 4."""
    from embshard.bench import backends

    monkeypatch.setattr(backends, "resolve_device", lambda d="auto": "cuda" if d in ("auto", "cuda") else d)
    monkeypatch.setattr(backends, "gpu_count", lambda d: 4 if d.startswith("cuda") else 0)
    monkeypatch.setattr(backends, "hardware", lambda d: "cuda:NVIDIA H100 80GB HBM3" if d != "cpu" else "cpu:x")


@pytest.fixture()
def recorders(monkeypatch):
    """Replace the jobs the measuring stages call; each call's keyword arguments are recorded by stage."""
    from embshard.bench import comm
    from embshard.bench.runner import MeasureSettings
    from embshard.jobs import bench, measure_plans, promote, shards

    calls: dict[str, dict] = {}

    def settings_of(kw: dict) -> dict:
        st = kw.get("settings")
        assert isinstance(st, MeasureSettings)
        return {"device": st.device, "comm_ranks": st.comm_ranks, "calibration_dir": st.calibration_dir}

    monkeypatch.setattr(comm, "adopt_calibration",
                        lambda root, hardware, **kw: calls.__setitem__("sample_shards", {"hardware": hardware, **kw}))
    monkeypatch.setattr(shards, "run", lambda *a, **kw: "shards.parquet")
    monkeypatch.setattr(bench, "run", lambda *a, **kw: calls.setdefault("benchmark", settings_of(kw)) and ["part"])
    monkeypatch.setattr(measure_plans, "run",
                        lambda *a, **kw: calls.__setitem__("measure_policy_plans", settings_of(kw)) or "costs")
    monkeypatch.setattr(promote, "evaluate_and_promote",
                        lambda *a, **kw: calls.__setitem__("evaluate_and_promote", settings_of(kw)) or {"ok": 1})
    return calls


def _run_measuring_stages(root: str, params: dict) -> None:
    # sample_shards checks that ingest wrote them, the gate reads them before it starts (the faked jobs do not)
    from embshard import schemas
    from embshard.ingest.synthetic import generate_tables
    from embshard.jobs.tasks import sample_tasks

    df = generate_tables(8, seed=3, bins_batch_size=256)
    schemas.write(df, stages.path(root, "tables"), "tables")
    schemas.write(sample_tasks(df, 2, "3-4", [2], 64.0, 0, where="test"), stages.path(root, "tasks"), "tasks")
    stages._state(root, "shards", {"shards": "shards.parquet", "chunks": [0]})
    stages._state(root, "policy", {"policy_dir": "p", "cost_model_uri": "c", "version": "1"})
    stages.run("sample_shards", root, params)
    stages.run("benchmark", root, params, chunk=0)
    stages.run("measure_policy_plans", root, {**params, "policy_rounds": 2}, round_index=2)
    stages.run("evaluate_and_promote", root, params)


MEASURING = ("sample_shards", "benchmark", "measure_policy_plans", "evaluate_and_promote")


@pytest.mark.parametrize("device", ["auto", "cuda"])
def test_every_measuring_stage_measures_on_the_gpu_of_a_gpu_pod(tmp_path, fake_gpu_host, recorders, device):
    _run_measuring_stages(str(tmp_path), {"device": device})
    assert set(recorders) == set(MEASURING)
    for stage in MEASURING:
        assert recorders[stage]["device"] == "cuda", stage
    # the calibration is of the GPU's hardware, and the all-to-all is measured among the pod's 4 GPUs
    assert recorders["sample_shards"]["hardware"].startswith("cuda:")
    for stage in ("benchmark", "measure_policy_plans", "evaluate_and_promote"):
        assert recorders[stage]["comm_ranks"] == 4, stage
    assert recorders["measure_policy_plans"]["calibration_dir"] == str(tmp_path)


def test_device_cpu_on_a_gpu_pod_measures_the_cpu(tmp_path, fake_gpu_host, recorders):
    _run_measuring_stages(str(tmp_path), {"device": "cpu"})
    for stage in MEASURING:
        assert recorders[stage]["device"] == "cpu", stage
    assert recorders["benchmark"]["comm_ranks"] is None  # the calibrated formula on the CPU
    assert recorders["sample_shards"]["hardware"] == "cpu:x"


def test_auto_without_a_gpu_is_the_cpu(tmp_path, recorders):
    if torch.cuda.is_available():
        pytest.skip("this host has a GPU: auto resolves to it")
    _run_measuring_stages(str(tmp_path), {})
    for stage in MEASURING:
        assert recorders[stage]["device"] == "cpu", stage


@pytest.mark.parametrize("stage", MEASURING)
def test_device_cuda_without_a_gpu_is_one_line_before_any_work(tmp_path, recorders, stage):
    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    stages._state(str(tmp_path), "shards", {"shards": "shards.parquet", "chunks": [0]})
    stages._state(str(tmp_path), "policy", {"policy_dir": "p", "cost_model_uri": "c", "version": "1"})
    with pytest.raises(EmbshardError, match="CUDA is not available") as exc:
        stages.run(stage, str(tmp_path), {"device": "cuda", "policy_rounds": 2},
                   round_index=2 if stage == "measure_policy_plans" else None)
    assert exc.value.field == "device" and "\n" not in str(exc.value)
    assert recorders == {}  # nothing measured, nothing calibrated


@pytest.mark.parametrize("stage", MEASURING)
def test_auto_in_a_pod_given_gpus_it_cannot_see_is_one_line_before_any_work(tmp_path, recorders, stage,
                                                                             monkeypatch):
    """A GPU pod whose torch sees no GPU (a node driver older than the image's CUDA build needs) had measured the
    CPU under device=auto, silently; the kubernetes runner says how many GPUs it gave (k8s.GPUS_GIVEN_ENV)."""
    from embshard import k8s

    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    stages._state(str(tmp_path), "shards", {"shards": "shards.parquet", "chunks": [0]})
    stages._state(str(tmp_path), "policy", {"policy_dir": "p", "cost_model_uri": "c", "version": "1"})
    monkeypatch.setenv(k8s.GPUS_GIVEN_ENV, "2")
    with pytest.raises(EmbshardError, match="this pod was given 2 GPU\\(s\\) but torch sees none") as exc:
        stages.run(stage, str(tmp_path), {"device": "auto", "policy_rounds": 2},
                   round_index=2 if stage == "measure_policy_plans" else None)
    assert exc.value.field == "device" and "CUDA_TAG=cu128" in exc.value.fix and "\n" not in str(exc.value)
    assert recorders == {}  # nothing measured, nothing calibrated
    # device=cpu is a choice: measured on the CPU as asked
    _run_measuring_stages(str(tmp_path / "cpu"), {"device": "cpu"})
    assert all(recorders[s]["device"] == "cpu" for s in MEASURING)


def test_stage_command_with_cuda_and_no_gpu_exits_2_with_one_line(tmp_path):
    """What a pod scheduled without a GPU prints: one line, exit 2 (never a CPU measurement in disguise)."""
    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    proc = subprocess.run([sys.executable, "-m", "embshard.cli", "stage", "sample_shards", "--root", str(tmp_path),
                           "--params", '{"device": "cuda"}'], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "device" in lines[0] and "CUDA is not available" in lines[0], proc.stderr
    assert not list(tmp_path.iterdir())


def test_stage_inputs_and_state_are_checked_in_one_line_before_any_work(tmp_path, recorders, capsys):
    """sample_shards without ingest's files fails before it calibrates (it used to calibrate for ~15 s and write
    the shared calibration first); a corrupt state file, or params that are not an object, are one line."""
    from embshard import cli

    with pytest.raises(EmbshardError, match="tables.parquet: missing stage output .*run the ingest stage"):
        stages.run("sample_shards", str(tmp_path), {"device": "cpu"})
    assert recorders == {}
    state = tmp_path / "state"
    state.mkdir()
    for text in ('{"shards": ', "{}", "[1]"):
        (state / "shards.json").write_text(text)
        with pytest.raises(EmbshardError, match=r"shards.json: corrupt stage output \(not an object with shards\)"):
            stages.run("benchmark", str(tmp_path), {"device": "cpu"}, chunk=0)
    assert cli.main(["stage", "ingest", "--root", str(tmp_path / "r"), "--params", "[1]"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "field 'params': a JSON list, not an object" in err
    assert not (tmp_path / "r").exists()


def test_unknown_device_is_refused():
    from embshard.bench.backends import resolve_device

    with pytest.raises(EmbshardError, match="unknown device") as exc:
        resolve_device("tpu")
    assert exc.value.field == "device"


@pytest.fixture()
def loop_recorders(monkeypatch):
    """The jobs of the outer loop replaced by recorders of what each step passes down."""
    from embshard.jobs import bench, measure_plans, train_cost, train_policy

    calls: list[tuple] = []

    def train_round(tables, tasks, out, **kw):
        calls.append(("train", {k: kw[k] for k in ("cost_model_uri", "iterations", "round_index", "init_policy",
                                                   "seed", "register", "reward", "rollouts_per_task",
                                                   "curriculum")}))
        return {"policy_dir": f"{out}/round-{kw['round_index']}", "cost_model_uri": kw["cost_model_uri"],
                "final_val_ratio": 1.0, "version": str(kw["round_index"]), "model_uri": "models:/p/1"}

    def plans(tables, tasks, policy_dir, cost_model_uri, out, **kw):
        calls.append(("plans", policy_dir, cost_model_uri, out, kw["num_tasks"], kw["round_index"],
                      kw["settings"].calibration_dir))
        return f"{out}/shards.parquet"

    def measure(tables, shards, out, settings=None, **kw):
        calls.append(("bench", shards, out, settings.calibration_dir, settings.seed))
        return []

    def refit(costs, tables, out, **kw):
        calls.append(("refit", list(costs), out, kw["seed"], kw["members"], kw["calibration_dir"]))
        return {"model_uri": f"models:/embshard-cost/{len(calls)}", "model_version": str(len(calls))}

    monkeypatch.setattr(train_policy, "train_round", train_round)
    monkeypatch.setattr(measure_plans, "run", plans)
    monkeypatch.setattr(bench, "run", measure)
    monkeypatch.setattr(train_cost, "run", refit)
    return calls


def test_the_train_policy_command_runs_the_dags_outer_loop(tmp_path, loop_recorders):
    """`embshard train-policy --rounds 2` and the DAG's round tasks make the same calls: the same seeds,
    iterations, measured tasks, the run's calibration (the folder above --costs) and the ensemble size."""
    from embshard import outer_loop

    root = str(tmp_path)
    tables, tasks = stages.path(root, "tables"), stages.path(root, "tasks")
    params = {"policy_rounds": 2, "policy_iterations": 10, "seed": 3, "device": "cpu"}
    stages._state(root, "cost_model", {"model_uri": "models:/embshard-cost/1"})
    for step, r in (("train_policy", 1), ("measure_policy_plans", 2), ("train_cost_model", 2),
                    ("train_policy", 2)):
        stages.run(step, root, params, round_index=r)
    dag = list(loop_recorders)
    loop_recorders.clear()
    outer_loop.run(tables, tasks, stages.path(root, "policy"), cost_model_uri="models:/embshard-cost/1",
                   iterations=10, rounds=2, costs=stages.path(root, "costs"), seed=3, progress=False,
                   curriculum=outer_loop.DEFAULT_CURRICULUM)  # the CLI's default, as the DAG's
    cli = list(loop_recorders)
    # One difference by design: the CLI writes its refits under its own OUT (OUT/cost_model/round-<r>).
    dag_refit = next(c for c in dag if c[0] == "refit")
    cli_refit = next(c for c in cli if c[0] == "refit")
    assert dag_refit[2] == f"{root}/cost_model/round-2" and cli_refit[2] == f"{root}/policy/cost_model/round-2"
    assert cli == [c if c[0] != "refit" else cli_refit for c in dag]
    assert cli_refit[:2] + cli_refit[3:] == dag_refit[:2] + dag_refit[3:]
    assert dag_refit[1] == [f"{root}/costs", f"{root}/policy/measured-round-2/costs"]
    assert dag_refit[3:] == (4, 3, root)  # seed + round - 1, the pipeline's 3 members, the run's calibration
    assert [c[0] for c in dag] == ["train", "plans", "bench", "refit", "train"]


def test_a_failed_ingest_leaves_nothing_in_the_run_root(tmp_path, capsys):
    """An ingest whose tasks cannot be sampled (its tables do not fit the devices) had left tables.parquet,
    state/run.json and state/code_version.json behind, without tasks.parquet: a half-written root."""
    from embshard import cli

    spec = tmp_path / "s.csv"
    spec.write_text("name,num_embeddings,embedding_dim,pooling_factor\n"
                    + "".join(f"t{k},1000000,64,2.0\n" for k in range(12)))  # 12 x 0.24 GiB
    root = tmp_path / "root"
    params = json.dumps({"source": "spec", "input": str(spec), "memory_gb": 0.25, "devices": 2,
                         "tables_per_task": "5", "num_tasks": 1})
    assert cli.main(["stage", "ingest", "--root", str(root), "--params", params]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "cannot fit" in err, err
    assert [p for p in root.rglob("*") if p.is_file()] == []
