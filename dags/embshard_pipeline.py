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

import os
from datetime import timedelta
from pathlib import Path

from airflow.sdk import DAG, Asset, AssetOrTimeSchedule, CronTriggerTimetable, Param, task

from embshard import stages

RUNNER = os.environ.get("EMBSHARD_RUNNER", "local")
# Local runner: one data root and one MLflow store for every stage, wherever Airflow was started from.
LOCAL_HOME = Path(__file__).resolve().parents[1] / "runs" / "local"
DATA_ROOT = os.environ.get("EMBSHARD_DATA_ROOT") or str(LOCAL_HOME / "data")
MLFLOW_URI = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{LOCAL_HOME / 'mlflow.db'}"
SCHEDULE_CRON = os.environ.get("EMBSHARD_SCHEDULE", "0 3 * * 1")  # Mondays 03:00 UTC
TABLES_ASSET = Asset(name="embshard_tables", uri=os.environ.get("EMBSHARD_TABLES_ASSET_URI",
                                                                "file:///embshard/tables"))
D = stages.DEFAULT_PARAMS

PARAMS = {
    "source": Param(D["source"], enum=["synthetic", "spec", "dlrm"],
                    description="Where the tables come from: the synthetic generator, a table-spec file "
                                "(CSV/Parquet/YAML, TorchRec names) or a DLRM trace (.pt/.pt.gz)."),
    # Optional (null allowed): the synthetic source needs no file, and the UI form must submit with the defaults.
    "input": Param(D["input"], type=["null", "string"],
                   description="Spec or trace file for source spec/dlrm (a path or URI); empty for synthetic."),
    "num_tables": Param(D["num_tables"], type="integer", minimum=2, maximum=100_000,
                        description="Synthetic source: how many tables to generate."),
    "seed": Param(D["seed"], type="integer", minimum=0, description="Seed of every random choice of the run."),
    "num_tasks": Param(D["num_tasks"], type="integer", minimum=1, maximum=10_000,
                       description="Tasks sampled per split (train pool / unseen test pool)."),
    "tables_per_task": Param(D["tables_per_task"], type="string", pattern=r"^\d+(-\d+)?$",
                             description="Tables per task: a number or a range like 20-60."),
    "devices": Param(D["devices"], type="integer", minimum=1, maximum=4096, description="Devices per task."),
    "memory_gb": Param(D["memory_gb"], type="number", exclusiveMinimum=0, maximum=100_000,
                       description="Memory per device in GiB (a hard constraint)."),
    "bench_shards": Param(D["bench_shards"], type="integer", minimum=10, maximum=1_000_000,
                          description="Benchmark budget: shards to measure (2/3 train pool, 1/3 test pool; half "
                                      "random, half devices of greedy plans and their search neighbours), besides "
                                      "every table alone."),
    "bench_chunks": Param(D["bench_chunks"], type="integer", minimum=1, maximum=1024,
                          description="Benchmark chunks: mapped tasks (pods) that measure in parallel."),
    "device": Param(D["device"], enum=["auto", "cpu", "cuda"],
                    description="Where the measuring stages (sample_shards' all-to-all calibration, benchmark, "
                                "measure_policy_plans, evaluate_and_promote) measure: auto = the pod's GPU when "
                                "it has one, else the CPU; cuda fails at once where no GPU is visible. A pod with "
                                "several GPUs measures the all-to-all with NCCL among them; one GPU uses the "
                                "NVLink formula. The models are tagged with the hardware measured."),
    "bench_batch_size": Param(D["bench_batch_size"], type="integer", minimum=0,
                              description="Benchmark batch size (0 = the device's default: 2,048 on the CPU, "
                                          "65,536 on a GPU)."),
    "recalibrate_comm": Param(D["recalibrate_comm"], type="boolean",
                              description="Calibrate the all-to-all formula again (otherwise the one stored for "
                                          "this hardware is reused, so that runs and models agree)."),
    "cost_members": Param(D["cost_members"], type="integer", minimum=1, maximum=32,
                          description="Cost-model ensemble members: the mean is the prediction, their "
                                      "disagreement the uncertainty the search respects."),
    "policy_iterations": Param(D["policy_iterations"], type="integer", minimum=1, maximum=1_000_000,
                               description="REINFORCE updates of the policy."),
    "policy_rounds": Param(D["policy_rounds"], type="integer", minimum=1, maximum=stages.MAX_POLICY_ROUNDS,
                           description="Outer rounds: measure the policy's plans, refit the cost model, retrain "
                                       "(the tasks of rounds beyond this are skipped)."),
    "eval_tasks": Param(D["eval_tasks"], type="integer", minimum=1, description="Held-out tasks measured."),
    "eval_rounds": Param(D["eval_rounds"], type="integer", minimum=1, maximum=100,
                         description="Measuring rounds of the evaluation (each measures every distinct device shard "
                                     "once, in a fresh random order); intervals need 5 or more."),
    "eval_planners": Param(D["eval_planners"], type="string", pattern=r"^[a-z_@/0-9]+(,[a-z_@/0-9]+)*$",
                           description="Baselines measured beside the candidate and the champion."),
    "promotion_margin": Param(D["promotion_margin"], type="number", minimum=0, maximum=0.9,
                              description="The candidate must beat the champion by this fraction to be promoted."),
    "export_tasks": Param(D["export_tasks"], enum=["test", "train", "all"],
                          description="Which tasks get exported placements."),
}

DEFAULT_ARGS = {"owner": "embshard", "retries": 0}

# Shown on each task's page in the Airflow UI.
TASK_DOCS = {
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
    params=PARAMS,
    default_args=DEFAULT_ARGS,
    tags=["embshard"],
    doc_md=__doc__,
) as dag:
    if RUNNER == "local":
        from airflow.sdk.exceptions import AirflowSkipException

        def run_stage(name: str, params, run_id, ti, chunk: int | None = None, round_index: int | None = None):
            try:
                return stages.run_in_task(name, DATA_ROOT, MLFLOW_URI, dict(params), run_id=run_id,
                                          dag_id=dag.dag_id, task_id=ti.task_id, try_number=ti.try_number,
                                          chunk=chunk, round_index=round_index)
            except stages.StageSkipped as exc:
                raise AirflowSkipException(str(exc)) from None

        def stage_task(task_id: str, stage: str, doc: str, round_index: int | None = None, **task_kw):
            @task(task_id=task_id, doc_md=TASK_DOCS[doc], **task_kw)
            def _run(params=None, run_id=None, ti=None) -> dict:
                return run_stage(stage, params, run_id, ti, round_index=round_index)
            return _run()

        @task(task_id="sample_shards", doc_md=TASK_DOCS["sample_shards"])
        def sample_shards(params=None, run_id=None, ti=None) -> list[int]:
            return run_stage("sample_shards", params, run_id, ti)["chunks"]

        @task(task_id="benchmark", retries=2, retry_delay=timedelta(seconds=5), doc_md=TASK_DOCS["benchmark"])
        def benchmark(chunk: int, params=None, run_id=None, ti=None) -> dict:
            return run_stage("benchmark", params, run_id, ti, chunk=chunk)

        chunks = sample_shards()
        stage_task("ingest", "ingest", "ingest") >> chunks
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

        from embshard import k8s

        pod_config = k8s.load_pod_config()
        root = stages.RUN_ROOT_TEMPLATE.format(data_root=k8s.data_root(pod_config))

        def stage_args(stage: str, round_index: int | None = None) -> list[str]:
            extra = ["--round", str(round_index)] if round_index is not None else []
            return ["stage", stage, "--root", root, "--params", stages.PARAMS_TEMPLATE, *extra]

        def pod(task_id: str, stage: str, doc: str, round_index: int | None = None, **kw):
            return KubernetesPodOperator(task_id=task_id, doc_md=TASK_DOCS[doc], **{
                **k8s.pod_operator_kwargs(stage, stage_args(stage, round_index), pod_config), **kw})

        ingest = pod("ingest", "ingest", "ingest")
        # (names apart from the local branch's @task functions: different types, the same task ids)
        sample_shards_pod = pod("sample_shards", "sample_shards", "sample_shards", do_xcom_push=True)
        benchmark_pods = KubernetesPodOperator.partial(
            task_id="benchmark", retries=2, retry_delay=timedelta(seconds=30), doc_md=TASK_DOCS["benchmark"],
            **{k: v for k, v in k8s.pod_operator_kwargs("benchmark", [], pod_config).items() if k != "arguments"},
        ).expand(arguments=sample_shards_pod.output.map(
            lambda chunk: [*stage_args("benchmark"), "--chunk", str(chunk)]))
        last = ingest >> sample_shards_pod >> benchmark_pods \
            >> pod("train_cost_model", "train_cost_model", "train_cost_model", 1)
        last = last >> pod("train_policy", "train_policy", "train_policy", 1)
        for task_id, stage, r, doc in OUTER_LOOP:
            last = last >> pod(task_id, stage, doc, r, skip_on_exit_code=stages.SKIP_EXIT_CODE)
        last >> pod("evaluate_and_promote", "evaluate_and_promote", "evaluate_and_promote",
                    trigger_rule=AFTER_LOOP) \
            >> pod("export_placements", "export_placements", "export_placements")
    else:
        raise ValueError(f"EMBSHARD_RUNNER={RUNNER!r}: use 'local' or 'kubernetes'")


if __name__ == "__main__":
    dag.test()
