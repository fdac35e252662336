"""embshard_pipeline: learn to place embedding tables, then export the champion's placements.

    ingest -> sample_shards -> benchmark (mapped over chunks) -> train_cost_model -> train_policy
      -> outer loop, round r = 2..3: measure_policy_plans_r<r> -> refit_cost_model_r<r> -> train_policy_r<r>
         (rounds beyond the `policy_rounds` param are skipped)
      -> evaluate_and_promote -> export_placements

This file only wires stages (embshard.stages). Runner, chosen at parse time by EMBSHARD_RUNNER:
  local (default)  each stage runs in-process in its Airflow task;
  kubernetes       each stage is a pod from the project image (KubernetesPodOperator, settings from embshard.k8s);
                   benchmark pods request a GPU and carry the GPU node selector and tolerations.
The task ids are the same either way. Each run works under its own root: EMBSHARD_DATA_ROOT/<run id>; every
stage of the local runner uses the one MLflow store MLFLOW_TRACKING_URI (both default to the repository's
runs/local, where `make run`, `make ui` and `make mlflow-ui` look).
Triggers: weekly retraining (EMBSHARD_SCHEDULE: a cron expression, or "none"), the `embshard_tables` asset (new
tables), and manual runs with the Param form. Unpausing does not start a run at once: the first scheduled run is
the next Monday 03:00 UTC. Runs queue one at a time (max_active_runs=1).
"""
from __future__ import annotations

import logging
import os
from datetime import timedelta
from pathlib import Path

from airflow.sdk import DAG, Asset, AssetOrTimeSchedule, CronTriggerTimetable, Param, task

from embshard import params, stages

log = logging.getLogger("embshard.dag")

RUNNER = os.environ.get("EMBSHARD_RUNNER", "local")
# Local runner: one data root and one MLflow store for every stage, wherever Airflow was started from.
LOCAL_HOME = Path(__file__).resolve().parents[1] / "runs" / "local"
DATA_ROOT = os.environ.get("EMBSHARD_DATA_ROOT") or str(LOCAL_HOME / "data")
MLFLOW_URI = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{LOCAL_HOME / 'mlflow.db'}"
SCHEDULE_CRON = os.environ.get("EMBSHARD_SCHEDULE", "0 3 * * 1")  # Mondays 03:00 UTC
TABLES_ASSET = Asset(name="embshard_tables", uri=os.environ.get("EMBSHARD_TABLES_ASSET_URI",
                                                                "file:///embshard/tables"))
# The trigger form: one field per embshard.params spec, with its types and choices; ranges, patterns and the rules
# between fields are checked by the first task, check_params, which names every bad field and its fix.
# The defaults are a team's own where EMBSHARD_PARAMS_FILE names their file (params.run_defaults): scheduled and
# asset-triggered runs have no conf, so these are what they ingest and train on.
RUN_DEFAULTS = params.run_defaults()
PARAMS = {key: Param(RUN_DEFAULTS[key], description=spec.description, **params.form_schema(key))
          for key, spec in params.SPECS.items()}


TIME_LIMIT_FIX = "if the stage was not hung, trigger the run again with a larger timeout_scale param"


def time_limit_text(task) -> str:
    """What a task that ran past its execution_timeout is told (Airflow's own text is "Timeout, PID: N")."""
    limit = getattr(task, "execution_timeout", None)
    seconds = f" of {limit.total_seconds():,.0f} s" if limit is not None else ""
    return (f"the stage ran past its time limit{seconds} (sized from the run's params x timeout_scale); not "
            f"retried ({TIME_LIMIT_FIX})")


def end_mlflow_runs(context) -> None:
    """A failed local task's MLflow runs that its stage could not end are marked KILLED (best effort: Airflow's
    supervisor fails a SIGKILLed task without running callbacks, seen with 3.3.2; then the next stage that logs,
    a retry or the next run's, ends them: registry.start_run). A task that ran past its time limit before its
    stage began (the limit is checked from the task's start) is told so here, in its log."""
    run = context["dag_run"]
    if type(context.get("exception")).__name__ == "AirflowTaskTimeout":
        log.error("%s: %s", context["ti"].task_id, time_limit_text(context["ti"].task))
    stages.end_failed_task_runs(MLFLOW_URI, DATA_ROOT, run.dag_id, run.run_id, context["ti"].task_id)


# A stage pod is tried again after an eviction, a preemption or a lost node (StagePod); a local task is not.
POD_RETRIES, POD_RETRY_DELAY = 2, timedelta(seconds=60)
DEFAULT_ARGS = {"owner": "embshard", "retries": 0,
                **({"on_failure_callback": end_mlflow_runs} if RUNNER == "local" else {})}


def time_limit(stage: str, startup_s: int = 0, round_index: int | None = None):
    """Each task's execution_timeout, sized when the task starts from this run's params (embshard.params:
    measured stage times x the work asked x timeout_scale): a hung stage fails instead of holding the queue.
    `startup_s`: a pod's allowance to be scheduled and pull its image, which KubernetesPodOperator waits for inside
    the task, on top of the stage's run time. `round_index`: an outer-loop round's task is skipped at start when
    the run has fewer rounds (before any pod is made: a skipped round's pod held a GPU node to exit 99)."""
    def set_limit(context) -> None:
        from airflow.sdk.exceptions import AirflowSkipException

        try:
            why = stages.round_skipped(dict(context["params"]), round_index)
            seconds = params.stage_timeout_s(stage, context["params"])
        except (ArithmeticError, TypeError, ValueError):
            # Params the trigger form's types let through but check_params refuses (bench_chunks 0, a text
            # size): the default limit, and check_params then names every bad field (this had raised
            # ZeroDivisionError before it ran).
            why, seconds = None, params.stage_timeout_s(stage, params.DEFAULT_PARAMS)
        if why:
            raise AirflowSkipException(why)
        if not seconds > 0:  # a negative timeout_scale: check_params refuses it (the task had timed out at once)
            seconds = params.stage_timeout_s(stage, params.DEFAULT_PARAMS)
        context["task"].execution_timeout = timedelta(seconds=seconds + startup_s)
        if hasattr(context["task"], "active_deadline_seconds"):
            # a pod outlives a worker killed mid-task: Kubernetes stops it at the task's own limit (no GPU held)
            context["task"].active_deadline_seconds = int(seconds + startup_s)
    return {"pre_execute": set_limit,
            "execution_timeout": timedelta(seconds=params.stage_timeout_s(stage, params.DEFAULT_PARAMS) + startup_s)}


# Shown on each task's page in the Airflow UI.
TASK_DOCS = {
    "check_params": "**Check the parameters** of the run, all at once and before any work: unknown keys, types, "
                    "ranges, the rules between fields (a spec source needs its file, ranges run low-high), the "
                    "input file. A bad run fails here in seconds, naming each field and its fix.",
    "ingest": "**Ingest** the tables (synthetic generator, table-spec file or DLRM trace), compute their features, "
              "decide the train/test table pools, and sample train/test tasks. Writes `tables.parquet`, "
              "`tasks.parquet` under the run root.",
    "sample_shards": "**Sample the shards** the benchmark measures (random shards inside each table pool, single "
                     "tables, the baselines' device shards): `shards.parquet`, read by every benchmark chunk; "
                     "returns the chunks to map over.",
    "benchmark": "**Benchmark** one chunk of device shards: a fused FBGEMM table-batched-embedding op per shard "
                 "(forward and backward) plus the all-to-all. Writes `costs/part-<chunk>.parquet`; reruns resume.",
    "train_cost_model": "**Train the cost model** on the measured costs and register a new `embshard-cost` "
                        "version in MLflow (accuracy report against two reference estimators as artifacts).",
    "train_policy": "**Train the placement policy** (round 1) with REINFORCE on the cost model; the last round "
                    "registers an `embshard-policy` version.",
    "measure_policy_plans": "**Outer loop, measure**: the last round's policy plans some training tasks; their device "
                            "shards are measured into `policy/measured-round-<r>/costs`. Skipped beyond "
                            "`policy_rounds`.",
    "refit_cost_model": "**Outer loop, refit**: the cost model retrained on the benchmark's costs and every measured "
                        "round, so it learns where the policy places tables (a new `embshard-cost` version).",
    "train_policy_round": "**Outer loop, retrain**: the policy trains on from the last round's weights against the "
                          "refitted cost model; the last round registers the candidate.",
    "evaluate_and_promote": "**Evaluate and promote**: measure the candidate, the champion and the baselines on "
                            "held-out tasks; `champion` moves only if the candidate wins by the margin. Returns "
                            "the decision and the measured ratios; the plot is `evaluation/evaluation.png`.",
    "export_placements": "**Export** the champion's placements of the target tasks: `export/placements.parquet`, "
                         "`plan.json` and TorchRec plans per task.",
}
# The outer loop, unrolled: (task id, stage, round, doc) after round 1's train_cost_model -> train_policy.
OUTER_LOOP = [(task_id, stage, r, doc) for r in range(2, stages.MAX_POLICY_ROUNDS + 1) for task_id, stage, doc in (
    (f"measure_policy_plans_r{r}", "measure_policy_plans", "measure_policy_plans"),
    (f"refit_cost_model_r{r}", "train_cost_model", "refit_cost_model"),
    (f"train_policy_r{r}", "train_policy", "train_policy_round"))]
# After the loop: runs when every round ran or was skipped (none failed).
AFTER_LOOP = "none_failed"

with DAG(
    dag_id="embshard_pipeline",
    description="Measure fused shard costs, learn a cost model and a placement policy, promote, export plans.",
    # Unpausing must not start a run at once (it would block manual runs): no start_date (with one, catchup=False
    # runs the latest interval), and run_immediately=0 (else a tick less than 10% of a week ago runs at once).
    schedule=(AssetOrTimeSchedule(timetable=CronTriggerTimetable(SCHEDULE_CRON, timezone="UTC",
                                                                 run_immediately=timedelta(0)),
                                  assets=[TABLES_ASSET])
              if SCHEDULE_CRON.lower() != "none" else [TABLES_ASSET]),
    catchup=False,
    max_active_runs=1,
    dagrun_timeout=timedelta(hours=params.run_timeout_h()),
    params=PARAMS,
    default_args=DEFAULT_ARGS,
    tags=["embshard"],
    doc_md=__doc__,
) as dag:
    if RUNNER == "local":
        from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException, AirflowTaskTimeout

        def run_stage(name: str, params, run_id, ti, chunk: int | None = None, round_index: int | None = None):
            try:
                return stages.run_in_task(name, DATA_ROOT, MLFLOW_URI, dict(params), run_id=run_id,
                                          dag_id=dag.dag_id, task_id=ti.task_id, try_number=ti.try_number,
                                          chunk=chunk, round_index=round_index)
            except stages.StageSkipped as exc:
                raise AirflowSkipException(str(exc)) from None
            except AirflowTaskTimeout as exc:  # as the kubernetes runner says it; a retry would time out again
                raise AirflowFailException(time_limit_text(ti.task)) from exc

        def stage_task(task_id: str, stage: str, doc: str, round_index: int | None = None, **task_kw):
            @task(task_id=task_id, doc_md=TASK_DOCS[doc], **time_limit(stage, round_index=round_index), **task_kw)
            def _run(params=None, run_id=None, ti=None) -> dict:
                return run_stage(stage, params, run_id, ti, round_index=round_index)
            return _run()

        @task(task_id="sample_shards", doc_md=TASK_DOCS["sample_shards"], **time_limit("sample_shards"))
        def sample_shards(params=None, run_id=None, ti=None) -> list[int]:
            return run_stage("sample_shards", params, run_id, ti)["chunks"]

        # One chunk at a time on one machine: chunks measured side by side compete for its cores and read slower
        # (under `make ui`'s LocalExecutor three chunks ran at once on 2 cores). A cluster's pods each have theirs.
        @task(task_id="benchmark", retries=2, retry_delay=timedelta(seconds=5), doc_md=TASK_DOCS["benchmark"],
              max_active_tis_per_dagrun=1, **time_limit("benchmark"))
        def benchmark(chunk: int, params=None, run_id=None, ti=None) -> dict:
            return run_stage("benchmark", params, run_id, ti, chunk=chunk)

        @task(task_id="check_params", doc_md=TASK_DOCS["check_params"], **time_limit("check_params"))
        def check_params(params=None, run_id=None, ti=None, triggering_asset_events=None) -> dict:
            for line in stages.trigger_note(triggering_asset_events, dict(params)):
                log.warning(line)
            return run_stage("check_params", params, run_id, ti)

        chunks = sample_shards()
        check_params() >> stage_task("ingest", "ingest", "ingest") >> chunks
        last = benchmark.expand(chunk=chunks) >> stage_task("train_cost_model", "train_cost_model",
                                                            "train_cost_model", 1)
        last = last >> stage_task("train_policy", "train_policy", "train_policy", 1)
        for task_id, stage, r, doc in OUTER_LOOP:
            last = last >> stage_task(task_id, stage, doc, r)
        last >> stage_task("evaluate_and_promote", "evaluate_and_promote", "evaluate_and_promote",
                           trigger_rule=AFTER_LOOP) \
            >> stage_task("export_placements", "export_placements", "export_placements", retries=1)

    elif RUNNER == "kubernetes":
        from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
        from airflow.sdk.exceptions import (
            AirflowException,
            AirflowFailException,
            AirflowSkipException,
            AirflowTaskTimeout,
        )

        from embshard import k8s

        class StagePod(KubernetesPodOperator):
            """A stage's pod, retried (POD_RETRIES) when it ends without a verdict of its own: evicted, preempted,
            OOM-killed, its node lost, a crash, a store that did not answer (exit 75); the stages are safe to run
            again. Failed at once when the stage exits 2 (it named a bad input or setting in its log: the same
            again) or runs past its time limit (it would again: raise timeout_scale)."""

            def execute(self, context):
                try:
                    return super().execute(context)
                except (AirflowFailException, AirflowSkipException):
                    raise
                except BaseException as exc:
                    # The runner's timeout interrupts the wait for the pod; the operator's cleanup (in a finally)
                    # then reports the unfinished pod as a failure, with the timeout only as its context.
                    if not _timed_out(exc):
                        raise
                    self.on_kill()  # the pod: deleted, as the runner does for a timeout it sees
                    raise AirflowFailException(time_limit_text(self)) from exc

            def cleanup(self, pod, remote_pod, xcom_result=None, context=None):
                try:
                    super().cleanup(pod, remote_pod, xcom_result, context)
                except AirflowSkipException:
                    raise
                except AirflowException as exc:
                    if k8s.stage_exit_code(remote_pod, self.base_container_name) == k8s.BAD_INPUT_EXIT_CODE:
                        raise AirflowFailException(f"{exc} (exit code {k8s.BAD_INPUT_EXIT_CODE}: the stage's "
                                                   "input or settings, see its log; not retried)") from exc
                    if k8s.past_deadline(remote_pod):  # activeDeadlineSeconds is the task's own time limit
                        raise AirflowFailException(f"{exc} (the pod ran past its time limit; not retried)") from exc
                    raise

        def _timed_out(exc: BaseException | None) -> bool:
            """Whether the runner's timeout is `exc` or in its chain (cause, or the exception it interrupted)."""
            seen = set()
            while exc is not None and id(exc) not in seen:
                if isinstance(exc, AirflowTaskTimeout):
                    return True
                seen.add(id(exc))
                exc = exc.__cause__ or exc.__context__
            return False

        pod_config = k8s.load_pod_config()
        root = stages.RUN_ROOT_TEMPLATE.format(data_root=k8s.data_root(pod_config))

        def stage_args(stage: str, round_index: int | None = None) -> list[str]:
            extra = ["--round", str(round_index)] if round_index is not None else []
            return ["stage", stage, "--root", root, "--params", stages.PARAMS_TEMPLATE, *extra]

        startup_s = k8s.startup_allowance_s(pod_config)

        def pod(task_id: str, stage: str, doc: str, round_index: int | None = None, **kw):
            return StagePod(task_id=task_id, doc_md=TASK_DOCS[doc], **{
                "retries": POD_RETRIES, "retry_delay": POD_RETRY_DELAY,
                **k8s.pod_operator_kwargs(stage, stage_args(stage, round_index), pod_config),
                **time_limit(stage, startup_s, round_index), **kw})

        # Checked on the Airflow worker (no pod: seconds, and embshard.params imports nothing heavy). The worker
        # does not mount the data volume the pods read: the input file is checked by the ingest pod.
        @task(task_id="check_params", doc_md=TASK_DOCS["check_params"], **time_limit("check_params"))
        def check_params_task(params=None, triggering_asset_events=None) -> dict:
            for line in stages.trigger_note(triggering_asset_events, dict(params)):
                log.warning(line)
            checked = stages.check_params("", dict(params), check_files=False)
            k8s.check_run_params(pod_config, stages.merged(dict(params)))
            return checked

        ingest = check_params_task() >> pod("ingest", "ingest", "ingest")
        # (names apart from the local branch's @task functions: different types, the same task ids)
        sample_shards_pod = pod("sample_shards", "sample_shards", "sample_shards", do_xcom_push=True)
        # One benchmark pod per chunk that sample_shards' XCom lists. Airflow renders no value a mapped task gets
        # from XCom (these arguments), so the run root and params, which are templates, reach the pods as
        # environment variables (rendered: env_vars is in partial) that Kubernetes puts into the arguments
        # (k8s.env_ref); in the arguments themselves they had reached the CLI as Jinja text, failing every chunk.
        bench_env = {k8s.RUN_ROOT_ENV: root, k8s.RUN_PARAMS_ENV: stages.PARAMS_TEMPLATE}
        bench_args = ["stage", "benchmark", "--root", k8s.env_ref(k8s.RUN_ROOT_ENV),
                      "--params", k8s.env_ref(k8s.RUN_PARAMS_ENV)]
        # At most maxBenchmarkPods chunk pods of a run at once (each holds GPUs; 0: no limit).
        benchmark_pods = StagePod.partial(
            task_id="benchmark", retries=POD_RETRIES, retry_delay=timedelta(seconds=30), doc_md=TASK_DOCS["benchmark"],
            max_active_tis_per_dagrun=int(pod_config.get("maxBenchmarkPods") or 0) or None,
            **time_limit("benchmark", startup_s),
            **{k: v for k, v in k8s.pod_operator_kwargs("benchmark", [], pod_config, argument_env=bench_env).items()
               if k != "arguments"},
        ).expand(arguments=sample_shards_pod.output.map(lambda chunk: [*bench_args, "--chunk", str(chunk)]))
        last = ingest >> sample_shards_pod >> benchmark_pods \
            >> pod("train_cost_model", "train_cost_model", "train_cost_model", 1)
        last = last >> pod("train_policy", "train_policy", "train_policy", 1)
        for task_id, stage, r, doc in OUTER_LOOP:
            last = last >> pod(task_id, stage, doc, r, skip_on_exit_code=stages.SKIP_EXIT_CODE)
        last >> pod("evaluate_and_promote", "evaluate_and_promote", "evaluate_and_promote",
                    trigger_rule=AFTER_LOOP) \
            >> pod("export_placements", "export_placements", "export_placements",
                   skip_on_exit_code=stages.SKIP_EXIT_CODE)  # no champion yet: skipped, as in the local runner
    else:
        raise ValueError(f"EMBSHARD_RUNNER={RUNNER!r}: use 'local' or 'kubernetes'")


if __name__ == "__main__":
    dag.test()
