"""The Airflow DAG `embshard_pipeline`: it imports cleanly under both runners, has the same tasks either way,
its schedule and Params are what the design says, and the kubernetes runner's pods (rendered without a cluster,
templates filled in as Airflow would) are valid Kubernetes pods that run `embshard stage ...` on the run's root.
"""
from __future__ import annotations

import copy
import json
import types
from pathlib import Path

import pytest

from embshard import k8s, stages

pytest.importorskip("airflow.providers.cncf.kubernetes", reason="airflow extra")
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="dev extra: kubernetes-validate")

DAG_FILE = Path(__file__).resolve().parents[1] / "dags" / "embshard_pipeline.py"
DAG_ID = "embshard_pipeline"
KUBE_VERSION = "1.33.0"
GPU = "nvidia.com/gpu"
# The DAG's line of tasks, the outer loop unrolled (round r: measure, refit, retrain), with the stage each runs.
LOOP = [(f"{step}_r{r}", stage, r) for r in range(2, stages.MAX_POLICY_ROUNDS + 1) for step, stage in (
    ("measure_policy_plans", "measure_policy_plans"), ("refit_cost_model", "train_cost_model"),
    ("train_policy", "train_policy"))]
STAGE_OF = {"ingest": ("ingest", None), "sample_shards": ("sample_shards", None), "benchmark": ("benchmark", None),
            "train_cost_model": ("train_cost_model", 1), "train_policy": ("train_policy", 1),
            **{t: (s, r) for t, s, r in LOOP},
            "evaluate_and_promote": ("evaluate_and_promote", None), "export_placements": ("export_placements", None)}
CHAIN = list(STAGE_OF)
MEASURING_STAGES = ("sample_shards", "benchmark", "measure_policy_plans", "evaluate_and_promote")
RUN_ID = "scheduled__2026-01-05T03:00:00+00:00"


def load_bag(monkeypatch, runner: str):
    """A fresh DagBag of the DAG file: the module is executed again, so it sees EMBSHARD_RUNNER now."""
    from airflow.dag_processing.dagbag import DagBag

    monkeypatch.setenv("EMBSHARD_RUNNER", runner)
    monkeypatch.delenv(k8s.CONFIG_ENV, raising=False)
    return DagBag(dag_folder=str(DAG_FILE), safe_mode=False)


@pytest.fixture(params=["local", "kubernetes"])
def dag_by_runner(request, monkeypatch):
    bag = load_bag(monkeypatch, request.param)
    assert bag.import_errors == {}
    return request.param, bag.dags[DAG_ID]


@pytest.fixture(scope="module")
def k8s_dag():
    with pytest.MonkeyPatch.context() as mp:
        bag = load_bag(mp, "kubernetes")
    assert bag.import_errors == {}
    return bag.dags[DAG_ID]


def test_dagbag_imports_without_errors(monkeypatch):
    for runner in ("local", "kubernetes"):
        bag = load_bag(monkeypatch, runner)
        assert bag.import_errors == {}, runner
        assert bag.dag_ids == [DAG_ID]


def test_each_runner_builds_its_own_kind_of_task(dag_by_runner):
    from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator

    runner, dag = dag_by_runner
    for task in dag.tasks:
        cls = getattr(task, "operator_class", type(task))  # the mapped benchmark task names its class
        if task.task_id == "check_params":  # seconds of light Python on the worker in both runners, no pod
            assert not issubclass(cls, KubernetesPodOperator)
            continue
        assert issubclass(cls, KubernetesPodOperator) == (runner == "kubernetes"), task.task_id
    bench = dag.get_task("benchmark")
    assert bench.is_mapped
    # A local task that fails ends the MLflow runs its stage left open (killed hard); a pod's retry does that.
    for task in dag.tasks:
        callbacks = (task.partial_kwargs if task.is_mapped else vars(task)).get("on_failure_callback")
        names = [getattr(c, "__name__", "") for c in (callbacks if isinstance(callbacks, list) else [callbacks])]
        assert ("end_mlflow_runs" in names) == (runner == "local"), (task.task_id, callbacks)
    # On one machine the chunks measure one at a time (side by side they share its cores); pods each have theirs.
    assert bench.partial_kwargs.get("max_active_tis_per_dagrun") == (1 if runner == "local" else None)


def test_unknown_runner_is_an_import_error(monkeypatch):
    bag = load_bag(monkeypatch, "ssh")
    assert DAG_ID not in bag.dags
    (error,) = bag.import_errors.values()
    assert "EMBSHARD_RUNNER='ssh'" in error


def test_same_tasks_and_dependencies_in_both_runners(monkeypatch):
    shapes = {}
    for runner in ("local", "kubernetes"):
        dag = load_bag(monkeypatch, runner).dags[DAG_ID]
        shapes[runner] = {t.task_id: sorted(t.downstream_task_ids) for t in dag.tasks}
    assert shapes["local"] == shapes["kubernetes"]
    tasks = ["check_params", *CHAIN]
    assert shapes["local"] == {a: ([b] if b else []) for a, b in zip(tasks, tasks[1:] + [None])}


def test_every_task_has_a_time_limit_sized_from_the_run_params(dag_by_runner):
    """execution_timeout on every task (a static one for the UI, re-sized at start from the run's params by its
    pre_execute hook) and a dagrun_timeout: a hung stage cannot hold the one-run-at-a-time queue."""
    from embshard import params

    runner, dag = dag_by_runner
    assert dag.dagrun_timeout.total_seconds() == params.run_timeout_h() * 3600
    for task in dag.tasks:
        timeout = task.partial_kwargs["execution_timeout"] if task.is_mapped else task.execution_timeout
        assert timeout is not None and timeout.total_seconds() > 0, task.task_id
        stage = STAGE_OF.get(task.task_id, ("check_params",))[0]
        hook = task.partial_kwargs["pre_execute"] if task.is_mapped else task._pre_execute_hook
        is_pod = runner == "kubernetes" and task.task_id != "check_params"
        op = (types.SimpleNamespace(execution_timeout=None, active_deadline_seconds=None) if is_pod
              else types.SimpleNamespace(execution_timeout=None))
        hook({"task": op, "params": {**params.DEFAULT_PARAMS, "timeout_scale": 3.0, "policy_rounds": 3}})
        # a pod's limit also covers its scheduling and image pull (KubernetesPodOperator waits for them in the task)
        startup = k8s.startup_allowance_s(k8s.load_pod_config()) if is_pod else 0
        assert op.execution_timeout.total_seconds() == pytest.approx(
            params.stage_timeout_s(stage, {"timeout_scale": 3.0}) + startup), task.task_id
        if is_pod:  # the allowance is both of the waits
            kw = task.partial_kwargs if task.is_mapped else vars(task)
            assert startup == kw["schedule_timeout_seconds"] + kw["startup_timeout_seconds"], task.task_id
            # the pod itself stops at the same limit, should the worker that waits for it be killed
            assert op.active_deadline_seconds == int(op.execution_timeout.total_seconds()), task.task_id


@pytest.mark.parametrize("bad", [{"bench_chunks": 0}, {"tables_per_task": "abc", "num_tables": -5},
                                 {"timeout_scale": -1}, {"policy_rounds": "two"}])
def test_params_the_form_lets_through_still_reach_check_params(dag_by_runner, bad):
    """A REST conf of the right JSON types but refused values: each task's time limit is sized before it runs, and
    that sizing had raised ZeroDivisionError / a bare ValueError / an instant timeout before check_params could name
    the field. Now the default limit, and check_params' one-line error."""
    from embshard import params
    from embshard.errors import EmbshardError

    _, dag = dag_by_runner
    op = types.SimpleNamespace(execution_timeout=None)
    dag.get_task("check_params")._pre_execute_hook({"task": op, "params": {**params.DEFAULT_PARAMS, **bad}})
    assert op.execution_timeout.total_seconds() == params.stage_timeout_s("check_params", params.DEFAULT_PARAMS)
    with pytest.raises(EmbshardError, match=next(iter(bad))):
        stages.check_params("", {**params.DEFAULT_PARAMS, **bad}, check_files=False)


def test_outer_loop_rounds_beyond_the_param_are_skipped_and_evaluation_still_runs(dag_by_runner):
    """Every step of the outer loop is a task; a round beyond `policy_rounds` is skipped (local: the stage raises
    StageSkipped; pods: its exit code), and evaluation runs after skipped rounds but not after failed ones."""
    runner, dag = dag_by_runner
    assert dag.get_task("evaluate_and_promote").trigger_rule == "none_failed"
    with pytest.raises(stages.StageSkipped):
        stages.train_policy("/nonexistent", {"policy_rounds": 1}, round_index=2)
    if runner == "kubernetes":
        for task_id, _, _ in LOOP:
            assert stages.SKIP_EXIT_CODE in dag.get_task(task_id).skip_on_exit_code
        # export without a champion yet exits 99 too: skipped, as in the local runner (it had failed the run)
        assert stages.SKIP_EXIT_CODE in dag.get_task("export_placements").skip_on_exit_code
    # Skipped when the task starts, before a pod is made (a skipped round's pod took a GPU node to exit 99).
    from airflow.sdk.exceptions import AirflowSkipException

    from embshard import params

    for task_id, _, r in LOOP:
        hook = dag.get_task(task_id)._pre_execute_hook
        op = types.SimpleNamespace(execution_timeout=None)
        with pytest.raises(AirflowSkipException, match=f"round {r} of 1"):
            hook({"task": op, "params": {**params.DEFAULT_PARAMS, "policy_rounds": 1}})
        hook({"task": op, "params": {**params.DEFAULT_PARAMS, "policy_rounds": 3}})
        assert op.execution_timeout is not None


def test_schedule_is_weekly_or_new_tables(k8s_dag):
    import datetime

    from airflow.serialization.decoders import decode_timetable
    from airflow.serialization.encoders import encode_timetable
    from airflow.timetables.base import TimeRestriction

    schedule = k8s_dag.timetable
    assert schedule.timetable.expression == "0 3 * * 1"  # Mondays 03:00 UTC
    # Unpausing does not start a run at once: the first scheduled run is the next Monday 03:00, in the future,
    # even right after a Monday's tick (a run for that tick would block manual runs for the whole pipeline).
    core = decode_timetable(encode_timetable(schedule.timetable))  # the scheduler's view of it
    first = core.next_dagrun_info(last_automated_data_interval=None,
                                                restriction=TimeRestriction(None, None, catchup=False))
    now = datetime.datetime.now(datetime.UTC)
    assert now < first.run_after <= now + datetime.timedelta(days=7)
    assert first.run_after.weekday() == 0 and first.run_after.hour == 3
    assert [a.name for a in schedule.asset_condition.objects] == ["embshard_tables"]
    assert k8s_dag.catchup is False and k8s_dag.max_active_runs == 1


def test_params_are_the_stage_defaults_and_documented(k8s_dag):
    assert k8s_dag.params.validate() == stages.DEFAULT_PARAMS
    assert stages.merged(k8s_dag.params.validate()) == stages.DEFAULT_PARAMS
    for key in stages.DEFAULT_PARAMS:
        assert k8s_dag.params.get_param(key).description, key  # the trigger form shows it


def test_params_accept_a_small_valid_run(k8s_dag):
    params = copy.deepcopy(k8s_dag.params)
    params.update({"num_tasks": 2, "tables_per_task": "6-10", "devices": 2, "memory_gb": 256,
                   "bench_shards": 16, "bench_chunks": 2, "bench_batch_size": 256, "policy_iterations": 10,
                   "eval_tasks": 1, "eval_planners": ["dim_greedy", "size_lookup_greedy"], "source": "spec",
                   "input": "s3://bucket/tables.csv", "export_tasks": "all", "promotion_margin": 0})
    values = params.validate()
    assert values["devices"] == 2 and values["tables_per_task"] == "6-10"
    assert stages.merged(values)["source"] == "spec"


def test_a_dlrm_runs_dims_type_and_hash_sizes_pass_the_form(k8s_dag):
    """A trace carries no dims or hash sizes: the form takes them (dim a text field, a number from REST)."""
    for dim in ("64", 64, "mixed"):
        params = copy.deepcopy(k8s_dag.params)
        params.update({"source": "dlrm", "input": "s3://bucket/trace.pt", "dim": dim, "data_type": "fp16",
                       "rows_file": "s3://bucket/rows.txt", "tables_per_task": "2-4"})
        values = params.validate()
        assert stages.merged(values)["dim"] == dim and values["rows_file"] == "s3://bucket/rows.txt"
    assert k8s_dag.params.get_param("dim").schema["type"][0] == "string"  # the form's field: its first type


@pytest.mark.parametrize("key, value, by_form", [
    ("devices", -1, False),
    ("devices", 0, False),
    ("devices", 2.5, True),
    ("source", "csv", True),
    ("tables_per_task", "20..60", False),
    ("tables_per_task", "-5", False),
    ("tables_per_task", "a-b", False),
    ("num_tables", "many", True),
    ("num_tables", 1, False),
    ("memory_gb", 0, False),
    ("memory_gb", -8.0, False),
    ("bench_shards", 5, False),
    ("bench_chunks", 0, False),
    ("promotion_margin", 1.5, False),
    ("eval_planners", ["Dim Greedy"], True),
    ("eval_planners", ["dim_greedy", "nosuchplanner"], True),
    ("export_tasks", "everything", True),
    ("device", "tpu", True),
    ("seed", -1, False),
    ("dim", 2.5, True),
    ("data_type", "fp8", True),
    ("rows_file", 5, True),
])
def test_params_reject_bad_values(k8s_dag, key, value, by_form):
    """Every bad value is refused before any work: types and choices by the form / REST (Airflow's own check,
    naming the param), and everything by check_params (the run's first task), with the field and its fix."""
    from airflow.sdk.exceptions import ParamValidationError

    from embshard import params as run_params

    assert [f for f, _, _ in run_params.problems({key: value})] == [key]
    if not by_form:  # a range or pattern: the form lets it through to check_params, which names it
        copy.deepcopy(k8s_dag.params)[key] = value
        return
    params = copy.deepcopy(k8s_dag.params)
    with pytest.raises(ParamValidationError, match=key):
        params[key] = value
    # validate() (what a run does with its params) refuses the value too, naming the param.
    params = copy.deepcopy(k8s_dag.params)
    params.get_param(key).value = value
    with pytest.raises(ParamValidationError, match=f"param {key}"):
        params.validate()


# --- the kubernetes runner's pods -----------------------------------------------------------------------------

class _MappedTI:
    """What Airflow's task runner gives a mapped task's rendering: its map index, and sample_shards' XCom (the
    chunk indices) to resolve the mapped arguments from."""

    def __init__(self, dag, task_id: str, chunk: int):
        self.dag_id, self.task_id, self.try_number, self.map_index = dag.dag_id, task_id, 1, chunk
        self._upstream_map_indexes: dict = {}

    def xcom_pull(self, *args, **kwargs):  # noqa: ARG002 (any task ids and keys: sample_shards is the one)
        return list(range(stages.DEFAULT_PARAMS["bench_chunks"]))


def render_pod(dag, task_id: str, params: dict | None = None, run_id: str = RUN_ID, chunk: int = 1) -> dict:
    """Templates filled in as Airflow does at run time (run_id, validated params), then the pod, offline. A mapped
    task (benchmark) is rendered the way Airflow renders it, through MappedOperator.render_template_fields, which
    resolves its arguments from sample_shards' XCom and, unlike a task's own values, renders none of them (a test
    that rendered the unmapped operator had passed pods whose arguments were Jinja text)."""
    from kubernetes.client import ApiClient

    values = copy.deepcopy(dag.params)
    values.update(params or {})
    task = dag.get_task(task_id)
    if task.is_mapped:
        # a copy: the unmapped operator renders its partial's values in place (env_vars' objects), which a run's
        # process parses afresh but the module's DAG would keep for the next test
        task = copy.deepcopy(task)
        ti = _MappedTI(dag, task_id, chunk)
        context = {"run_id": run_id, "params": values.validate(), "dag": dag, "ti": ti, "task_instance": ti,
                   "expanded_ti_count": stages.DEFAULT_PARAMS["bench_chunks"],
                   # the trigger's conf: a mapped task's rendering takes its params from the run again
                   "dag_run": types.SimpleNamespace(conf=dict(params or {}), run_id=run_id)}
        task.render_template_fields(context, dag.get_template_env())
        op = context["task"]  # the unmapped operator Airflow runs
    else:
        op = copy.deepcopy(task)
        ti = types.SimpleNamespace(task_id=task_id, try_number=1)
        op.render_template_fields({"run_id": run_id, "params": values.validate(), "dag": dag, "ti": ti},
                                  dag.get_template_env())
    return ApiClient().sanitize_for_serialization(op.build_pod_request_obj(dry_run=True))


def kubelet_args(container: dict) -> list[str]:
    """The container's arguments as Kubernetes runs them: in each environment variable's value (in order) and then
    in each argument, $(NAME) of a variable defined before it is replaced by its value and $$ by $ (an unknown
    name stays as it is)."""
    import re

    env: dict[str, str] = {}

    def expand(text: str) -> str:
        return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                      lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)

    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = expand(e["value"])
    return [expand(a) for a in container.get("args", [])]


@pytest.mark.parametrize("task_id", CHAIN)
def test_stage_pods_are_valid_and_run_the_stage_on_the_run_root(k8s_dag, task_id):
    from embshard.cli import build_parser

    pod = render_pod(k8s_dag, task_id)
    kubernetes_validate.validate(pod, desired_version=KUBE_VERSION, strict=True)
    container = pod["spec"]["containers"][0]
    assert container["image"] == k8s.POD_DEFAULTS["image"] and container["command"] == ["embshard"]
    root = stages.run_root(k8s.data_root(), RUN_ID)
    assert root == "file:///data/embshard/scheduled__2026-01-05T03-00-00-00-00"
    stage, round_index = STAGE_OF[task_id]
    assert kubelet_args(container)[:4] == ["stage", stage, "--root", root]
    # The arguments are a valid `embshard stage` command line whose params the stages accept.
    args = build_parser().parse_args(kubelet_args(container))
    assert (args.command, args.name, args.root, args.round_index) == ("stage", stage, root, round_index)
    assert stages.merged(json.loads(args.params)) == stages.DEFAULT_PARAMS
    assert args.chunk == (1 if task_id == "benchmark" else 0)
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["EMBSHARD_STAGE"] == stage
    # a pod given GPUs says how many, so that device=auto refuses to measure the CPU when torch sees none
    assert env.get(k8s.GPUS_GIVEN_ENV) == ("1" if stage in MEASURING_STAGES else None)
    # Lineage for the MLflow tags of whatever the pod logs.
    assert (env["EMBSHARD_AIRFLOW_DAG_ID"], env["EMBSHARD_AIRFLOW_RUN_ID"], env["EMBSHARD_AIRFLOW_TASK_ID"]) == \
        (DAG_ID, RUN_ID, task_id)


@pytest.mark.parametrize("task_id", CHAIN)
def test_measuring_pods_get_a_gpu_on_gpu_nodes(k8s_dag, task_id):
    pod = render_pod(k8s_dag, task_id)
    resources = pod["spec"]["containers"][0]["resources"]
    if STAGE_OF[task_id][0] in MEASURING_STAGES:
        assert resources["requests"][GPU] == resources["limits"][GPU] == "1"
        assert not pod["spec"].get("nodeSelector")  # the GPU request keeps it on GPU nodes
        assert pod["spec"]["tolerations"] == [{"key": GPU, "operator": "Exists", "effect": "NoSchedule"}]
    else:
        assert GPU not in resources["requests"] and GPU not in resources["limits"]
        assert not pod["spec"].get("nodeSelector") and not pod["spec"].get("tolerations")


@pytest.mark.parametrize("device", ["cuda", "cpu", "auto"])
def test_measuring_pods_carry_the_device_param(k8s_dag, device):
    """The `device` param of a run reaches every measuring stage's pod (in its --params), and those pods are the
    ones with a GPU; the stage reads it from there (tests/test_stages_device.py)."""
    for task_id in CHAIN:
        pod = render_pod(k8s_dag, task_id, params={"device": device})
        args = kubelet_args(pod["spec"]["containers"][0])
        assert json.loads(args[args.index("--params") + 1])["device"] == device
        if STAGE_OF[task_id][0] in MEASURING_STAGES:
            assert pod["spec"]["containers"][0]["resources"]["limits"][GPU] == "1"


def test_device_param_is_a_choice(k8s_dag):
    from airflow.sdk.exceptions import ParamValidationError

    assert k8s_dag.params.get_param("device").schema["enum"] == ["auto", "cpu", "cuda"]
    params = copy.deepcopy(k8s_dag.params)
    with pytest.raises(ParamValidationError, match="device"):
        params["device"] = "tpu"


def test_sample_shards_pod_pushes_the_chunks_for_the_benchmark_map(k8s_dag):
    pod = render_pod(k8s_dag, "sample_shards")
    assert [c["name"] for c in pod["spec"]["containers"]] == ["base", "airflow-xcom-sidecar"]
    # One benchmark pod per chunk that sample_shards' XCom lists, each told its own chunk.
    chunks = list(range(stages.DEFAULT_PARAMS["bench_chunks"]))
    args = [kubelet_args(render_pod(k8s_dag, "benchmark", chunk=c)["spec"]["containers"][0]) for c in chunks]
    assert [a[-2:] for a in args] == [["--chunk", str(c)] for c in chunks]
    assert len({tuple(a[:-1]) for a in args}) == 1
    assert k8s_dag.get_task("benchmark").partial_kwargs["retries"] == 2


@pytest.mark.parametrize("run_id", [RUN_ID, "manual__2026-11-22T00:33:52.069730+00:00",
                                    "asset_triggered__2026-02-01T10:00:00+00:00"])
def test_pod_run_root_is_the_local_runner_run_root(k8s_dag, run_id):
    """Both runners put a run's data at the same place: the Jinja template == stages.run_root."""
    pod = render_pod(k8s_dag, "train_policy", run_id=run_id)
    root = kubelet_args(pod["spec"]["containers"][0])[3]
    assert root == stages.run_root(k8s.data_root(), run_id)
    assert ":" not in root.split("://", 1)[1] and "+" not in root


@pytest.mark.parametrize("task_id", ["evaluate_and_promote", "benchmark"])
def test_params_from_the_trigger_form_reach_the_pods_intact(k8s_dag, task_id):
    """Quotes, HTML-ish characters, non-ASCII and what Kubernetes expands in arguments ($(NAME), $$) in a string
    param survive the JSON template, in a pod's own arguments and in a mapped pod's (through its environment)."""
    conf = {"source": "spec", "input": "s3://bucket/it's \"my\" <spec> & ünïcode $(HOME) $$x $.csv", "devices": 8,
            "memory_gb": 80.5, "eval_planners": ["dim_greedy", "size_greedy"]}
    pod = render_pod(k8s_dag, task_id, params=conf)
    kubernetes_validate.validate(pod, desired_version=KUBE_VERSION, strict=True)
    args = kubelet_args(pod["spec"]["containers"][0])
    params = json.loads(args[args.index("--params") + 1])
    assert params == {**stages.DEFAULT_PARAMS, **conf}
    assert stages.merged(params) == params


def test_benchmark_pods_of_a_run_can_be_capped(monkeypatch, tmp_path):
    """Nothing limited how many benchmark chunk pods (each holding GPUs) one run starts at once."""
    from airflow.dag_processing.dagbag import DagBag

    assert load_bag(monkeypatch, "kubernetes").dags[DAG_ID].get_task("benchmark").partial_kwargs.get(
        "max_active_tis_per_dagrun") is None  # 0 by default: every chunk at once
    path = tmp_path / "pods.yaml"
    path.write_text("maxBenchmarkPods: 2\n")
    monkeypatch.setenv(k8s.CONFIG_ENV, str(path))
    bag = DagBag(dag_folder=str(DAG_FILE), safe_mode=False)
    assert bag.import_errors == {}
    assert bag.dags[DAG_ID].get_task("benchmark").partial_kwargs["max_active_tis_per_dagrun"] == 2
    assert bag.dags[DAG_ID].get_task("export_placements").retries == 2  # as every stage pod (StagePod)


def _ended_pod(exit_code: int | None):
    """A stage pod as the API returns it once it ended: its container terminated with `exit_code`, or (None)
    evicted before the container ended."""
    from kubernetes.client import models as km

    statuses = None if exit_code is None else [km.V1ContainerStatus(
        name="base", image="embshard", image_id="", ready=False, restart_count=0,
        state=km.V1ContainerState(terminated=km.V1ContainerStateTerminated(exit_code=exit_code)))]
    return km.V1Pod(metadata=km.V1ObjectMeta(name="embshard-x", namespace="embshard"),
                    spec=km.V1PodSpec(containers=[km.V1Container(name="base")]),
                    status=km.V1PodStatus(phase="Failed", reason=None if statuses else "Evicted",
                                          container_statuses=statuses))


class _OfflineApi:
    """The Kubernetes API the pod operator asks while it cleans up (there is no cluster here): the ended pod read
    back, no events, every write accepted."""

    def __init__(self, pod):
        self.pod = pod

    def read_pod(self, pod):  # noqa: ARG002
        return self.pod

    def read_pod_events(self, pod):  # noqa: ARG002
        return types.SimpleNamespace(items=[])

    def __getattr__(self, name):
        return lambda *args, **kw: None


def _cleanup(task, exit_code):
    pod = _ended_pod(exit_code)
    task.__dict__["pod_manager"] = task.__dict__["client"] = _OfflineApi(pod)  # the cached properties
    task.cleanup(pod, pod)


def test_a_stage_pod_is_retried_after_an_eviction_but_not_after_saying_what_is_wrong(monkeypatch):
    """Every stage pod but benchmark and export ran without retries: a spot reclaim or a node drain failed the
    whole run and paged someone to clear the task. Now each is retried, unless the stage exited 2 (its input or
    settings: the same again), which fails at once; a skipped round (exit 99) is still skipped."""
    from airflow.sdk.exceptions import AirflowException, AirflowFailException, AirflowSkipException
    from airflow.serialization.serialized_objects import DagSerialization

    dag = load_bag(monkeypatch, "kubernetes").dags[DAG_ID]  # its own tasks: the API stand-in stays on them
    pods = [t for t in dag.tasks if t.task_id != "check_params"]
    assert {t.task_id: (t.partial_kwargs["retries"] if t.is_mapped else t.retries) for t in pods} == {
        t.task_id: 2 for t in pods}
    # as the scheduler reads them: the DAG file's operator class survives serialization, retries too
    seen = DagSerialization.from_dict(DagSerialization.to_dict(dag))
    assert {seen.get_task(t.task_id).task_type for t in pods} == {"StagePod"}
    assert seen.get_task("train_policy").retries == 2
    task = dag.get_task("train_policy")
    with pytest.raises(AirflowFailException, match="exit code 2"):
        _cleanup(task, 2)
    for code in (137, 1, 75, None):  # OOM-killed, a crash, a store that did not answer, evicted: tried again
        with pytest.raises(AirflowException) as caught:
            _cleanup(task, code)
        assert not isinstance(caught.value, AirflowFailException), code
    with pytest.raises(AirflowSkipException):
        _cleanup(dag.get_task("train_policy_r3"), stages.SKIP_EXIT_CODE)


def test_a_stage_pod_past_its_time_limit_is_deleted_and_not_retried(monkeypatch):
    """A hung or overrun stage was retried like an eviction: a GPU held for three times the limit."""
    from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
    from airflow.sdk.exceptions import AirflowException, AirflowFailException, AirflowTaskTimeout

    dag = load_bag(monkeypatch, "kubernetes").dags[DAG_ID]
    killed = []

    def times_out(self, context):  # the task runner's timeout, inside execute (no cluster here)
        raise AirflowTaskTimeout()

    def times_out_then_cleans_up(self, context):
        # as the operator does: its wait is interrupted, and its cleanup (in a finally) reports the unfinished pod
        # as a failure, the timeout only that failure's context
        try:
            raise AirflowTaskTimeout()
        finally:
            raise AirflowException("Pod embshard-x returned a failure.")

    monkeypatch.setattr(KubernetesPodOperator, "on_kill", lambda self: killed.append(self.task_id))
    for execute in (times_out, times_out_then_cleans_up):
        killed.clear()
        monkeypatch.setattr(KubernetesPodOperator, "execute", execute)
        with pytest.raises(AirflowFailException, match="ran past its time limit"):
            dag.get_task("evaluate_and_promote").execute({})
        assert killed == ["evaluate_and_promote"]  # its pod deleted, as the runner does for a timeout it sees
    monkeypatch.setattr(KubernetesPodOperator, "execute", lambda self, context: _raise(AirflowException("lost")))
    with pytest.raises(AirflowException) as caught:  # no timeout in it: retried
        dag.get_task("evaluate_and_promote").execute({})
    assert not isinstance(caught.value, AirflowFailException) and killed == ["evaluate_and_promote"]
    # Kubernetes stopped it at activeDeadlineSeconds (the same limit) first: not retried either
    pod = _ended_pod(None)
    pod.status.reason = "DeadlineExceeded"
    task = dag.get_task("train_policy")
    task.__dict__["pod_manager"] = task.__dict__["client"] = _OfflineApi(pod)
    with pytest.raises(AirflowFailException, match="past its time limit"):
        task.cleanup(pod, pod)


def _raise(exc):
    raise exc


def test_a_store_that_does_not_answer_exits_75_which_pods_retry_and_bad_input_2():
    from embshard.errors import EmbshardError, StoreUnreachableError
    from embshard.registry import RegistryUnreachableError

    assert EmbshardError("x").exit_code == k8s.BAD_INPUT_EXIT_CODE == 2
    assert StoreUnreachableError("x").exit_code == RegistryUnreachableError("x").exit_code == 75


def test_refine_on_a_cluster_needs_a_gpu_in_the_export_pod(monkeypatch, tmp_path):
    """refine_k measures in the export_placements pod, which had no GPU: with device cuda the last stage failed
    after hours, with auto the exported plans were chosen from CPU timings. check_params refuses it up front."""
    from embshard.errors import EmbshardError

    config = k8s.load_pod_config()
    with pytest.raises(EmbshardError, match="refine_k.*export_placements.gpu: true"):
        k8s.check_run_params(config, {**stages.DEFAULT_PARAMS, "refine_k": 2})
    for ok in ({"refine_k": 0}, {"refine_k": 2, "device": "cpu"}):
        k8s.check_run_params(config, {**stages.DEFAULT_PARAMS, **ok})
    path = tmp_path / "pods.yaml"
    path.write_text("stages:\n  export_placements:\n    gpu: true\n")
    k8s.check_run_params(k8s.load_pod_config(path), {**stages.DEFAULT_PARAMS, "refine_k": 2})
    # the DAG's own check_params task runs it
    with pytest.raises(EmbshardError, match="refine_k"):
        load_bag(monkeypatch, "kubernetes").dags[DAG_ID].get_task("check_params").python_callable(
            params={"refine_k": 2})
