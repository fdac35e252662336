"""The kubernetes runner's stage pods, rendered without a cluster and validated against the Kubernetes schema.

Each stage gets a real KubernetesPodOperator built from `embshard.k8s.pod_operator_kwargs`; its pod comes
from `build_pod_request_obj(dry_run=True)` (no API server) and must validate strictly. The chart's
stage-pods ConfigMap must equal POD_DEFAULTS: one source of truth for the DAG and the chart.
"""
from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
import yaml

from embshard import k8s
from embshard.errors import EmbshardError

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="dev extra: kubernetes-validate")
pytest.importorskip("airflow.providers.cncf.kubernetes", reason="airflow extra")
helm = pytest.importorskip("helm_python", reason="dev extra: helm-python-sdk")

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "embshard"
KUBE_VERSION = "1.33.0"
GPU = "nvidia.com/gpu"
GPU_STAGES = {"sample_shards", "benchmark", "measure_policy_plans", "evaluate_and_promote"}

# What the DAG passes: the image's entrypoint is `embshard`, so arguments start with the command.
ARGS = {
    "ingest": ["ingest", "--source", "synthetic", "--out", "file:///data/embshard/run-1"],
    "sample_shards": ["stage", "sample_shards", "--root", "file:///data/embshard/run-1"],
    "benchmark": ["bench", "--tables", "file:///data/embshard/run-1/tables.parquet", "--chunk", "0"],
    "train_cost_model": ["train-cost", "--costs", "file:///data/embshard/run-1/costs"],
    "train_policy": ["train-policy", "--tables", "file:///data/embshard/run-1/tables.parquet"],
    "measure_policy_plans": ["stage", "measure_policy_plans", "--root", "file:///data/embshard/run-1", "--round", "2"],
    "evaluate_and_promote": ["evaluate", "--tasks", "file:///data/embshard/run-1/tasks.parquet"],
    "export_placements": ["export", "--out", "file:///data/embshard/run-1/placements"],
}


def pod_manifest(stage: str, config: dict | None = None) -> dict:
    """The pod the KubernetesPodOperator would create for `stage`, as a plain manifest."""
    from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
    from airflow.sdk import DAG
    from kubernetes.client import ApiClient

    with DAG(f"embshard_pods_{stage}", schedule=None, start_date=dt.datetime(2026, 1, 1)):
        op = KubernetesPodOperator(task_id=stage, **k8s.pod_operator_kwargs(stage, ARGS[stage], config))
    return ApiClient().sanitize_for_serialization(op.build_pod_request_obj(dry_run=True))


def chart_stage_pods(values: dict | None = None, namespace: str = "embshard") -> dict:
    """The stage-pods YAML the chart renders into its ConfigMap (release "embshard")."""
    with helm.Chart.load(CHART) as chart:
        out = chart.render(values or {}, name="embshard", namespace=namespace, is_install=True)
    (cm,) = [d for d in yaml.safe_load_all(out["embshard/templates/stage-pods-configmap.yaml"]) if d]
    return yaml.safe_load(cm["data"]["stage-pods.yaml"])


@pytest.fixture(autouse=True)
def _no_config_env(monkeypatch):
    monkeypatch.delenv(k8s.CONFIG_ENV, raising=False)


@pytest.mark.parametrize("stage", k8s.STAGES)
def test_stage_pod_is_a_valid_kubernetes_pod(stage):
    pod = pod_manifest(stage)
    kubernetes_validate.validate(pod, desired_version=KUBE_VERSION, strict=True)
    (container,) = pod["spec"]["containers"]
    assert container["image"] == k8s.POD_DEFAULTS["image"]
    assert container["command"] == ["embshard"] and container["args"] == ARGS[stage]
    assert pod["metadata"]["namespace"] == "embshard"
    assert pod["spec"]["serviceAccountName"] == "embshard-stage"
    assert pod["metadata"]["labels"]["embshard.io/stage"] == stage.replace("_", "-")
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    env = {e["name"]: e for e in container["env"]}
    assert env["MLFLOW_TRACKING_URI"]["value"] == "http://embshard-mlflow.embshard.svc.cluster.local:5000"
    assert env["EMBSHARD_DATA_ROOT"]["value"] == "file:///data/embshard"
    assert container["envFrom"] == [{"secretRef": {"name": "embshard-stage-credentials", "optional": True}}]
    # The shared volume the stages exchange Parquet through, and the scratch folder of a read-only root.
    assert container["volumeMounts"] == [{"name": "scratch", "mountPath": "/tmp"},
                                         {"name": "embshard-data", "mountPath": "/data"}]
    assert pod["spec"]["volumes"] == [{"name": "scratch", "emptyDir": {}},
                                      {"name": "embshard-data",
                                       "persistentVolumeClaim": {"claimName": "embshard-data"}}]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    for name, value in k8s.SCRATCH_ENV.items():  # every home, cache and config on the scratch folder
        assert env[name]["value"] == value and (value == "1" or value.startswith("/tmp")), name


@pytest.mark.parametrize("stage", k8s.STAGES)
def test_only_measuring_stages_get_a_gpu_and_the_gpu_nodes(stage):
    pod = pod_manifest(stage)
    resources = pod["spec"]["containers"][0]["resources"]
    if stage in GPU_STAGES:
        assert resources["requests"][GPU] == resources["limits"][GPU] == "1"
        assert not pod["spec"].get("nodeSelector")  # the GPU request keeps it on GPU nodes
        assert pod["spec"]["tolerations"] == [{"key": GPU, "operator": "Exists", "effect": "NoSchedule"}]
    else:
        assert GPU not in resources.get("requests", {}) and GPU not in resources.get("limits", {})
        assert not pod["spec"].get("nodeSelector") and not pod["spec"].get("tolerations")
    assert resources["requests"]["memory"] and resources["limits"]["memory"]


def test_pods_with_several_gpus_get_a_shared_memory_for_nccl(tmp_path):
    """NCCL among a pod's GPUs (the all-to-all measured) moves data through /dev/shm, 64 MiB by the container
    runtime's default: a memory-backed one of gpu.shmSize on measuring pods with 2+ GPUs, none elsewhere."""
    path = tmp_path / "pods.yaml"
    path.write_text("gpu:\n  count: 4\n  shmSize: 4Gi\n")
    config = k8s.load_pod_config(path)
    for stage in k8s.STAGES:
        pod = pod_manifest(stage, config)
        kubernetes_validate.validate(pod, desired_version=KUBE_VERSION, strict=True)
        shm = [v for v in pod["spec"]["volumes"] if v["name"] == "dshm"]
        mounts = [m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]]
        if stage in GPU_STAGES:
            assert shm == [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "4Gi"}}], stage
            assert "/dev/shm" in mounts
        else:
            assert not shm and "/dev/shm" not in mounts, stage
    assert not [v for v in pod_manifest("benchmark")["spec"]["volumes"] if v["name"] == "dshm"]  # one GPU: none
    assert chart_stage_pods({"stagePods": {"gpu": {"count": 2}}})["gpu"]["shmSize"] == "2Gi"


def test_extra_volumes_reach_every_stage_pod_as_the_chart_gives_them():
    """DLRM traces are read from a local path (ingest, and the benchmark replays them): with bucket storage no pod
    had a volume to read them from. A volume of the chart's values is mounted in every stage pod."""
    values = {"stagePods": {
        "storage": {"type": "bucket", "dataRoot": "s3://embshard/runs"},
        "extraVolumes": [{"name": "traces", "persistentVolumeClaim": {"claimName": "dlrm-traces", "readOnly": True}}],
        "extraVolumeMounts": [{"name": "traces", "mountPath": "/traces", "readOnly": True}]}}
    config = k8s._check(k8s._merge(k8s.POD_DEFAULTS, chart_stage_pods(values)), "stage-pods.yaml")
    for stage in k8s.STAGES:
        pod = pod_manifest(stage, config)
        kubernetes_validate.validate(pod, desired_version=KUBE_VERSION, strict=True)
        assert {"name": "traces", "persistentVolumeClaim": {"claimName": "dlrm-traces", "readOnly": True}} \
            in pod["spec"]["volumes"], stage
        assert {"name": "traces", "mountPath": "/traces", "readOnly": True} \
            in pod["spec"]["containers"][0]["volumeMounts"], stage


def test_a_pod_with_the_xcom_sidecar_is_valid():
    """The DAG's sample_shards task pushes its chunk list as an XCom: the operator adds a sidecar container."""
    from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
    from airflow.sdk import DAG
    from kubernetes.client import ApiClient

    with DAG("embshard_pods_xcom", schedule=None, start_date=dt.datetime(2026, 1, 1)):
        op = KubernetesPodOperator(task_id="sample_shards", **{
            **k8s.pod_operator_kwargs("sample_shards", ARGS["sample_shards"]), "do_xcom_push": True})
    pod = ApiClient().sanitize_for_serialization(op.build_pod_request_obj(dry_run=True))
    kubernetes_validate.validate(pod, desired_version=KUBE_VERSION, strict=True)
    assert [c["name"] for c in pod["spec"]["containers"]] == ["base", "airflow-xcom-sidecar"]
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True  # the sidecar runs as uid 10001 too
    # and is hardened as the stage container (Pod Security `restricted` refused it bare)
    base, sidecar = pod["spec"]["containers"]
    assert sidecar["securityContext"] == base["securityContext"]
    assert sidecar["securityContext"]["allowPrivilegeEscalation"] is False
    assert sidecar["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def test_pod_validation_is_not_vacuous():
    pod = pod_manifest("benchmark")
    pod["spec"]["containers"][0]["resources"]["limits"]["cpu"] = {"cores": 8}  # not a quantity
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, desired_version=KUBE_VERSION, strict=True)


def test_chart_configmap_is_pod_defaults():
    """One source of truth: the chart's default stage-pod settings equal POD_DEFAULTS exactly."""
    assert chart_stage_pods() == k8s.POD_DEFAULTS


def test_chart_configmap_drives_the_pods(tmp_path, monkeypatch):
    """Settings changed in the chart's values reach the DAG's pods through the mounted ConfigMap."""
    values = {"stagePods": {
        "image": "registry.example.com/embshard-cuda:0.1.0",
        "gpu": {"count": 2, "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200"},
                "tolerations": [{"key": GPU, "operator": "Exists", "effect": "NoSchedule"},
                                {"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"}]},
        "storage": {"type": "bucket", "dataRoot": "s3://embshard/runs",
                    "s3Endpoint": "http://embshard-minio.ml.svc.cluster.local:9000"},
        "secretEnv": [{"name": "MLFLOW_TRACKING_TOKEN", "secretName": "mlflow-auth", "key": "token"}],
    }}
    path = tmp_path / "stage-pods.yaml"
    path.write_text(yaml.safe_dump(chart_stage_pods(values, namespace="ml")))
    monkeypatch.setenv(k8s.CONFIG_ENV, str(path))
    config = k8s.load_pod_config()
    assert k8s.data_root(config) == "s3://embshard/runs"

    pod = pod_manifest("benchmark", config)
    kubernetes_validate.validate(pod, desired_version=KUBE_VERSION, strict=True)
    spec, (container,) = pod["spec"], pod["spec"]["containers"]
    assert pod["metadata"]["namespace"] == "ml"
    assert container["image"] == "registry.example.com/embshard-cuda:0.1.0"
    assert container["resources"]["limits"][GPU] == "2"
    assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    assert len(spec["tolerations"]) == 2
    # bucket: no data volume, only the scratch folder (and, with 2 GPUs, NCCL's shared memory)
    assert [v["name"] for v in spec["volumes"]] == ["scratch", "dshm"]
    assert container["volumeMounts"] == [{"name": "scratch", "mountPath": "/tmp"},
                                         {"name": "dshm", "mountPath": "/dev/shm"}]
    env = {e["name"]: e for e in container["env"]}
    assert env["EMBSHARD_DATA_ROOT"]["value"] == "s3://embshard/runs"
    assert env["AWS_ENDPOINT_URL"]["value"] == "http://embshard-minio.ml.svc.cluster.local:9000"
    assert env["MLFLOW_TRACKING_URI"]["value"] == "http://embshard-mlflow.ml.svc.cluster.local:5000"
    assert env["MLFLOW_TRACKING_TOKEN"] == {"name": "MLFLOW_TRACKING_TOKEN", "valueFrom": {
        "secretKeyRef": {"name": "mlflow-auth", "key": "token", "optional": False}}}

    # A CPU stage stays off the GPU nodes under the same settings.
    ingest = pod_manifest("ingest", config)
    assert GPU not in ingest["spec"]["containers"][0]["resources"]["limits"]
    assert not ingest["spec"].get("nodeSelector")


def test_partial_override_keeps_the_rest(tmp_path):
    path = tmp_path / "pods.yaml"
    path.write_text("image: my/embshard-cpu:1\nstages:\n  train_policy:\n    gpu: true\n"
                    "gpu:\n  nodeSelector:\n    nvidia.com/gpu.product: NVIDIA-H200\n    team: null\n")
    config = k8s.load_pod_config(path)
    assert config["gpu"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}  # null drops, as in Helm
    assert config["image"] == "my/embshard-cpu:1"
    assert config["stages"]["train_policy"]["gpu"] is True
    assert config["stages"]["train_policy"]["resources"] == k8s.POD_DEFAULTS["stages"]["train_policy"]["resources"]
    assert config["gpu"]["tolerations"] == k8s.POD_DEFAULTS["gpu"]["tolerations"]
    assert k8s.POD_DEFAULTS["stages"]["train_policy"]["gpu"] is False  # defaults are not mutated


@pytest.mark.parametrize("text, match", [
    ("imagee: typo\n", "unknown pod setting"),
    ("storage:\n  type: nfs\n", "storage.type"),
    ("storage:\n  type: bucket\n  dataRoot: /data\n", "s3://"),
    ("stages:\n  bench:\n    gpu: true\n", "unknown stage"),
    ("secretEnv:\n  - name: X\n", "secretEnv"),
    ("- a\n- b\n", "mapping"),
    ("image: [unclosed\n", "not valid YAML"),
    ("extraVolumes:\n  - emptyDir: {}\n", "each with a name"),
    ("extraVolumes:\n  - {name: scratch, emptyDir: {}}\n", "volume name 'scratch' is taken"),
    ("extraVolumes:\n  - {name: t, emptyDir: {}}\nextraVolumeMounts:\n  - {name: u, mountPath: /traces}\n",
     "mount 'u' names no volume"),
    ("extraVolumes:\n  - {name: t, emptyDir: {}}\nextraVolumeMounts:\n  - {name: t, mountPath: /data}\n",
     "mount path '/data' is taken"),
    ("extraVolumes:\n  - {name: t, emptyDir: {}}\nextraVolumeMounts:\n  - {name: t, mountPath: /a}\n"
     "  - {name: t, mountPath: /a/}\n", "mount path '/a/' is taken"),
])
def test_bad_pod_settings_are_one_line_errors(tmp_path, text, match):
    path = tmp_path / "pods.yaml"
    path.write_text(text)
    with pytest.raises(EmbshardError, match=match) as info:
        k8s.load_pod_config(path)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_missing_config_file_says_how_to_fix(tmp_path, monkeypatch):
    monkeypatch.setenv(k8s.CONFIG_ENV, str(tmp_path / "absent.yaml"))
    with pytest.raises(EmbshardError, match="EMBSHARD_K8S_CONFIG"):
        k8s.load_pod_config()


def test_unknown_stage_is_refused():
    with pytest.raises(EmbshardError, match="unknown stage"):
        k8s.pod_operator_kwargs("bench", ["bench"])


def test_a_data_root_off_the_mounted_volume_is_refused(tmp_path):
    """mountPath /mnt/shared with the default data root file:///data/embshard was accepted: every pod wrote to its
    own disk, and the next stage failed with "missing stage output"."""
    from embshard.errors import EmbshardError

    path = tmp_path / "pods.yaml"
    path.write_text("storage:\n  mountPath: /mnt/shared\n")
    with pytest.raises(EmbshardError, match="is not on the volume mounted at /mnt/shared") as err:
        k8s.load_pod_config(path)
    assert err.value.field == "storage.dataRoot" and "file:///mnt/shared/embshard" in str(err.value)
    path.write_text("storage:\n  mountPath: /mnt/shared\n  dataRoot: file:///mnt/shared/embshard\n")
    assert k8s.data_root(k8s.load_pod_config(path)) == "file:///mnt/shared/embshard"
    path.write_text("storage:\n  mountPath: /data\n  dataRoot: file:///database/x\n")  # a prefix is not a parent
    with pytest.raises(EmbshardError, match="not on the volume"):
        k8s.load_pod_config(path)
    path.write_text("storage:\n  mountPath: ''\n")
    with pytest.raises(EmbshardError, match="mount path"):
        k8s.load_pod_config(path)
    path.write_text("storage:\n  mountPath: /tmp/\n  dataRoot: file:///tmp/embshard\n")  # the scratch emptyDir
    with pytest.raises(EmbshardError, match="scratch") as err:
        k8s.load_pod_config(path)
    assert err.value.field == "storage.mountPath"
    path.write_text("maxBenchmarkPods: -1\n")
    with pytest.raises(EmbshardError, match="maxBenchmarkPods"):
        k8s.load_pod_config(path)


def test_a_stage_may_run_its_own_image_and_cpu_stages_see_no_gpu(tmp_path):
    """The CPU image could be built but not given to the CPU stages; and the CUDA image's
    NVIDIA_VISIBLE_DEVICES=all let a pod that requested no GPU see every GPU of a node whose default runtime is
    NVIDIA's."""
    path = tmp_path / "pods.yaml"
    path.write_text("stages:\n  ingest:\n    image: registry.example.com/embshard-cpu:0.1.0\n")
    config = k8s.load_pod_config(path)
    ingest, bench = pod_manifest("ingest", config), pod_manifest("benchmark", config)
    kubernetes_validate.validate(ingest, desired_version=KUBE_VERSION, strict=True)
    assert ingest["spec"]["containers"][0]["image"] == "registry.example.com/embshard-cpu:0.1.0"
    assert bench["spec"]["containers"][0]["image"] == k8s.POD_DEFAULTS["image"]
    env_of = {stage: {e["name"]: e.get("value") for e in pod_manifest(stage)["spec"]["containers"][0]["env"]}
              for stage in k8s.STAGES}
    for stage, env in env_of.items():
        assert ("NVIDIA_VISIBLE_DEVICES" in env) == (stage not in GPU_STAGES), stage
        if stage not in GPU_STAGES:
            assert env["NVIDIA_VISIBLE_DEVICES"] == "void"
    with helm.Chart.load(CHART) as chart:  # the chart's schema takes the per-stage image too
        chart.render({"stagePods": {"stages": {"ingest": {"gpu": False, "resources": {},
                                                          "image": "my/embshard-cpu:1"}}}},
                     name="embshard", namespace="embshard", is_install=True)


def test_measuring_pods_have_cores_of_their_own():
    """Measuring pods were Burstable (4 CPUs requested, 8 allowed): they timed their neighbours' load too.
    Requests equal limits, in whole CPUs (Guaranteed QoS)."""
    for stage in GPU_STAGES:
        (container,) = pod_manifest(stage)["spec"]["containers"]  # (sample_shards' XCom sidecar: cluster.md)
        res = container["resources"]
        assert res["requests"] == res["limits"], stage
        assert float(res["requests"]["cpu"]).is_integer(), stage


@pytest.mark.parametrize("text, field", [
    ("env:\n  AWS_SECRET_ACCESS_KEY: hunter2\n", "env"),
    ("env:\n  WANDB_API_KEY: abc\n", "env"),
    ("mlflowTrackingUri: https://admin:hunter2@mlflow.example.com\n", "mlflowTrackingUri"),
])
def test_credentials_in_the_pod_settings_file_are_refused(tmp_path, text, field):
    """Only the chart's schema refused credentials in env (by name; WANDB_API_KEY passed it), and a tracking URI
    with user:password went into the ConfigMap and every pod's environment."""
    from embshard.errors import EmbshardError

    path = tmp_path / "pods.yaml"
    path.write_text(text)
    with pytest.raises(EmbshardError, match="credential") as err:
        k8s.load_pod_config(path)
    assert err.value.field == field
    path.write_text("env:\n  LOG_LEVEL: info\nmlflowTrackingUri: https://mlflow.example.com:5000/x@y\n")
    assert k8s.load_pod_config(path)["env"]["LOG_LEVEL"] == "info"  # plain settings and an '@' in the path pass


def test_the_xcom_sidecar_runs_on_a_read_only_root_too():
    """It only sleeps; the stage writes the XCom on the operator's own emptyDir (/airflow/xcom)."""
    from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
    from airflow.sdk import DAG
    from kubernetes.client import ApiClient

    with DAG("embshard_pods_xcom_ro", schedule=None, start_date=dt.datetime(2026, 1, 1)):
        op = KubernetesPodOperator(task_id="sample_shards", **{
            **k8s.pod_operator_kwargs("sample_shards", ARGS["sample_shards"]), "do_xcom_push": True})
    pod = ApiClient().sanitize_for_serialization(op.build_pod_request_obj(dry_run=True))
    base, sidecar = pod["spec"]["containers"]
    assert base["securityContext"]["readOnlyRootFilesystem"] is sidecar["securityContext"]["readOnlyRootFilesystem"]
    assert {"name": "xcom", "mountPath": "/airflow/xcom"} in base["volumeMounts"]


def test_the_scratch_env_can_be_overridden(tmp_path):
    path = tmp_path / "pods.yaml"
    path.write_text("env:\n  TRITON_CACHE_DIR: /data/triton\n")  # e.g. keep compiled kernels across runs
    env = {e.name: e.value for e in k8s.pod_operator_kwargs("benchmark", ["bench"], k8s.load_pod_config(path))
           ["env_vars"]}
    assert env["TRITON_CACHE_DIR"] == "/data/triton" and env["HOME"] == "/tmp"


def test_stages_wait_longer_than_a_command_for_an_mlflow_server_that_does_not_answer(tmp_path):
    """A stage pod must not fail (and be retried, or fail a run) for an MLflow pod restarting (a command gives up after
    10 s); the setting can be overridden like any other."""
    from embshard import registry

    assert k8s.MLFLOW_WAIT_ENV == registry.WAIT_ENV and k8s.MLFLOW_WAIT_S > 10 * registry.DEFAULT_WAIT_S
    env = {e.name: e.value for e in k8s.pod_operator_kwargs("evaluate_and_promote", ["x"])["env_vars"]}
    assert env[registry.WAIT_ENV] == str(k8s.MLFLOW_WAIT_S)
    path = tmp_path / "pods.yaml"
    path.write_text(f"env:\n  {registry.WAIT_ENV}: '30'\n")
    env = {e.name: e.value for e in k8s.pod_operator_kwargs("export_placements", ["x"], k8s.load_pod_config(path))
           ["env_vars"]}
    assert env[registry.WAIT_ENV] == "30"


def _read_only_root_works() -> bool:
    import shutil
    import subprocess

    return bool(shutil.which("unshare")) and subprocess.run(
        ["unshare", "-rm", "sh", "-c", "mount -o remount,bind,ro / && mount -t tmpfs tmpfs /tmp"],
        capture_output=True).returncode == 0


@pytest.mark.skipif(not _read_only_root_works(), reason="needs unprivileged user and mount namespaces")
def test_stage_commands_run_on_a_read_only_root(tmp_path):
    """A read-only root as the pod has it, without a container: a private mount namespace remounts / read-only,
    a fresh tmpfs stands for the /tmp emptyDir and the data folder is bound at /mnt. With the pod's scratch
    environment, ingest and place (pandas, pyarrow, matplotlib) and MLflow logging (torch imported) succeed, and
    matplotlib keeps its cache where MPLCONFIGDIR says, not in a new temp folder per process."""
    import os
    import subprocess
    import sys

    pod_env = {e.name: e.value for e in k8s.pod_operator_kwargs("train_cost_model", ["train-cost"])["env_vars"]}
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
           "PYTHONPATH": str(Path(k8s.__file__).resolve().parents[1]),
           **{name: pod_env[name] for name in k8s.SCRATCH_ENV}}
    # A checkout (and its venv) under /tmp, as a fresh clone may be, would vanish under the tmpfs standing for the
    # emptyDir: those folders are bound back over it, read-only like the rest of the image.
    keep = sorted({"/tmp/" + p.relative_to("/tmp").parts[0] for p in (Path(sys.prefix).resolve(),
                                                                       Path(k8s.__file__).resolve())
                   if p.is_relative_to("/tmp")})
    script = """set -e
mount --bind "$DATA" /mnt
i=0; for k in $KEEP; do mkdir -p /mnt/.keep$i && mount --bind "$k" /mnt/.keep$i; i=$((i+1)); done
mount -t tmpfs tmpfs /tmp
i=0; for k in $KEEP; do
  mkdir -p "$k" && mount --bind /mnt/.keep$i "$k" && mount -o remount,bind,ro "$k"; i=$((i+1))
done
mount -o remount,bind,ro / && cd /
if touch /probe 2>/dev/null; then echo "the root is writable" >&2; exit 9; fi
embshard ingest --source synthetic --num-tables 6 --out file:///mnt/run --no-progress
embshard place --tables /mnt/run/tables.parquet --devices 2 --memory-gb 16 --planner size_greedy --out /mnt/plan
python -c '
import mlflow, torch
mlflow.set_tracking_uri("sqlite:////mnt/mlflow.db")
experiment = mlflow.create_experiment("ro", artifact_location="file:///mnt/artifacts")
with mlflow.start_run(experiment_id=experiment):
    mlflow.log_metric("m", float(torch.ones(2).sum()))
    mlflow.log_artifact("/mnt/plan/devices.png")
'
ls -A "$MPLCONFIGDIR" > /mnt/mplconfig.txt
"""
    data = tmp_path / "data"
    data.mkdir()
    env["DATA"], env["KEEP"] = str(data), " ".join(keep)
    proc = subprocess.run(["unshare", "-rmpf", "--mount-proc", "sh", "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (data / "plan" / "devices.png").exists() and os.listdir(data / "artifacts")
    assert (data / "mplconfig.txt").read_text().strip()  # the font cache, in MPLCONFIGDIR


def test_priority_classes_reach_the_pods(tmp_path):
    """stagePods.priorityClassName for every stage pod; gpu.priorityClassName for the measuring (GPU) ones."""
    assert "priorityClassName" not in pod_manifest("ingest")["spec"]  # none by default: the cluster's default
    values = {"stagePods": {"priorityClassName": "embshard-batch", "gpu": {"priorityClassName": "embshard-measure"}}}
    path = tmp_path / "stage-pods.yaml"
    path.write_text(yaml.safe_dump(chart_stage_pods(values)))
    config = k8s.load_pod_config(path)
    for stage in k8s.STAGES:
        pod = pod_manifest(stage, config)
        kubernetes_validate.validate(pod, desired_version=KUBE_VERSION, strict=True)
        want = "embshard-measure" if stage in GPU_STAGES else "embshard-batch"
        assert pod["spec"]["priorityClassName"] == want, stage
    path.write_text("gpu:\n  priorityClassName: embshard-measure\n")  # GPU pods only
    config = k8s.load_pod_config(path)
    assert pod_manifest("benchmark", config)["spec"]["priorityClassName"] == "embshard-measure"
    assert "priorityClassName" not in pod_manifest("train_policy", config)["spec"]


@pytest.mark.parametrize("text, field", [
    ("priorityClassName: High_Priority\n", "priorityClassName"),
    ("gpu:\n  priorityClassName: -measure\n", "gpu.priorityClassName"),
    ("priorityClassName: 3\n", "priorityClassName"),
])
def test_a_bad_priority_class_is_a_one_line_error(tmp_path, text, field):
    path = tmp_path / "pods.yaml"
    path.write_text(text)
    with pytest.raises(EmbshardError, match="PriorityClass") as err:
        k8s.load_pod_config(path)
    assert err.value.field == field and "\n" not in str(err.value)


DIGEST = "sha256:" + "0123456789abcdef" * 4


def test_images_may_be_pinned_by_digest(tmp_path):
    """An image by digest (optionally with its tag) reaches the pods verbatim; a digest never moves, as tags do."""
    values = {"stagePods": {"image": f"registry.example.com/ml/embshard-cuda@{DIGEST}",
                            "stages": {"ingest": {"gpu": False, "resources": {},
                                                  "image": f"registry.example.com/ml/embshard-cpu:0.1.0@{DIGEST}"}}}}
    path = tmp_path / "stage-pods.yaml"
    path.write_text(yaml.safe_dump(chart_stage_pods(values)))
    config = k8s.load_pod_config(path)
    bench, ingest = pod_manifest("benchmark", config), pod_manifest("ingest", config)
    for pod in (bench, ingest):
        kubernetes_validate.validate(pod, desired_version=KUBE_VERSION, strict=True)
    assert bench["spec"]["containers"][0]["image"] == f"registry.example.com/ml/embshard-cuda@{DIGEST}"
    assert ingest["spec"]["containers"][0]["image"] == f"registry.example.com/ml/embshard-cpu:0.1.0@{DIGEST}"


def test_the_chart_schema_checks_images_as_k8s_does():
    import json

    schema = json.loads((CHART / "values.schema.json").read_text())
    image = schema["definitions"]["image"]
    assert image["pattern"] == f"^{k8s.IMAGE_NAME.pattern}(?:@.*)?$"
    # the digest on its own, so that a bad one is named as such ("does not match pattern '@sha256:...'")
    assert image["if"] == {"pattern": "@"} and image["then"] == {"pattern": f"^[^@]*@{k8s.DIGEST.pattern}$"}
    # one '@' only: 'name@latest@sha256:...' passed a pattern anchored at the end alone (a pod in InvalidImageName)
    import re

    assert not re.search(image["then"]["pattern"], f"ghcr.io/embshard/embshard-cuda@latest@{DIGEST}")
    for ref in (k8s.POD_DEFAULTS["image"], "postgres:17.6-bookworm", "localhost:5000/embshard:1",
                "quay.io/minio/minio:RELEASE.2025-09-07T16-13-09Z", f"ghcr.io/mlflow/mlflow:v3.17.2-full@{DIGEST}"):
        k8s._check_image(ref, "test", "image")


BAD_IMAGES = [
    (f"ghcr.io/embshard/embshard-cuda@{DIGEST[:-1]}", "digest"),  # 63 hex digits
    (f"ghcr.io/embshard/embshard-cuda@{DIGEST.upper()}", "digest"),
    ("ghcr.io/embshard/embshard-cuda@md5:0123456789abcdef0123456789abcdef", "digest"),
    ("ghcr.io/embshard/embshard-cuda@", "digest"),
    (f"ghcr.io/embshard/embshard-cuda@latest@{DIGEST}", "digest"),
    ("ghcr.io/embshard/embshard-cuda:", "not an image reference"),
    ("ghcr.io/embshard/Embshard-cuda:0.1.0", "not an image reference"),
    ("ghcr.io/embshard/embshard cuda:0.1.0", "not an image reference"),
]


@pytest.mark.parametrize("image, match", BAD_IMAGES)
def test_a_malformed_image_is_a_one_line_error(tmp_path, image, match):
    path = tmp_path / "pods.yaml"
    for text, field in ((yaml.safe_dump({"image": image}), "image"),
                        (yaml.safe_dump({"stages": {"ingest": {"image": image}}}), "stages.ingest.image")):
        path.write_text(text)
        with pytest.raises(EmbshardError, match=match) as err:
            k8s.load_pod_config(path)
        assert err.value.field == field and "\n" not in str(err.value) and "@sha256:" in err.value.fix
    with helm.Chart.load(CHART) as chart:  # the chart refuses it before anything is installed
        for values in ({"stagePods": {"image": image}}, {"mlflow": {"image": image}}):
            with pytest.raises(helm.HelmValuesError, match="image") as err:
                chart.validate_schema(values)
            if match == "digest":
                assert "@sha256:[a-f0-9]{64}$" in str(err.value)
