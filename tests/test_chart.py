"""The Helm chart lints and renders offline, and every manifest it renders is a valid Kubernetes object.

Helm runs in-process through PyPI `helm-python-sdk` (Helm v4's Go SDK as a shared library, no `helm` binary,
no network); `kubernetes-validate` checks each manifest against the Kubernetes OpenAPI schema, strictly.
What needs a real cluster (images pulling, MLflow reaching Postgres/MinIO, RWX storage) is in docs/cluster.md.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

helm = pytest.importorskip("helm_python", reason="dev extra: helm-python-sdk")
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="dev extra: kubernetes-validate")

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "embshard"
KUBE_VERSION = "1.33.0"  # a version kubernetes-validate ships schemas for, inside the chart's kubeVersion
RELEASE, NAMESPACE = "embshard", "embshard"
DIGEST = "sha256:" + "0123456789abcdef" * 4

PROFILES = {
    "defaults": {},
    # Stages exchange data through a bucket (MinIO or S3) instead of a shared volume.
    "bucket": {"stagePods": {"storage": {"type": "bucket", "dataRoot": "s3://embshard/runs",
                                         "s3Endpoint": "http://embshard-minio.embshard.svc.cluster.local:9000"}}},
    # Everything external: managed Postgres (URI in a Secret), AWS S3 artifacts, no RBAC/SA creation.
    "external": {"postgres": {"enabled": False}, "minio": {"enabled": False},
                 "mlflow": {"backendStoreUriSecret": {"name": "mlflow-db", "key": "uri"},
                            "artifactsDestination": "s3://company-mlflow/embshard"},
                 "rbac": {"create": False}, "serviceAccount": {"create": False},
                 "storage": {"pvc": {"create": False}}},
    # The optional hardening: PriorityClasses for the stage and the measuring pods, images by digest.
    "hardened": {"stagePods": {"priorityClassName": "embshard-batch",
                               "image": f"ghcr.io/embshard/embshard-cuda@{DIGEST}",
                               "gpu": {"priorityClassName": "embshard-measure"}},
                 "mlflow": {"image": f"ghcr.io/mlflow/mlflow:v3.17.2-full@{DIGEST}"},
                 "postgres": {"image": f"postgres:17.6-bookworm@{DIGEST}"},
                 "minio": {"image": f"quay.io/minio/minio@{DIGEST}", "mcImage": f"quay.io/minio/mc@{DIGEST}"}},
    # No MLflow in the chart at all: stages use an existing tracking server.
    "no-mlflow": {"mlflow": {"enabled": False}, "postgres": {"enabled": False}, "minio": {"enabled": False},
                  "stagePods": {"mlflowTrackingUri": "https://mlflow.example.com",
                                "gpu": {"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200"}}}},
}


def render(values: dict | None = None, *, name: str = RELEASE, namespace: str = NAMESPACE) -> dict[str, list[dict]]:
    """Template path -> the objects it renders (NOTES.txt as a one-item list holding the text)."""
    with helm.Chart.load(CHART) as chart:
        out = chart.render(values or {}, name=name, namespace=namespace, is_install=True)
    docs = {}
    for path, text in out.items():
        if path.endswith("NOTES.txt"):
            docs[path] = [text]
        else:
            docs[path] = [d for d in yaml.safe_load_all(text) if d]
    return docs


def objects(values: dict | None = None) -> list[dict]:
    return [o for path, objs in render(values).items() if not path.endswith("NOTES.txt") for o in objs]


def by_kind(objs: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_chart_lints_clean(profile):
    report = helm.lint(CHART, PROFILES[profile], strict=True, namespace=NAMESPACE,
                       kube_version=f"v{KUBE_VERSION}")
    assert report["errors"] == []
    # severity: 1 info, 2 warning, 3 error; strict lint fails on warnings, so do we.
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_lint_reports_bad_values():
    report = helm.lint(CHART, {"stagePods": {"gpu": {"count": 0}}}, strict=True, namespace=NAMESPACE)
    assert any("minimum" in e for e in report["errors"])


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_every_rendered_manifest_is_a_valid_kubernetes_object(profile):
    objs = objects(PROFILES[profile])
    assert objs
    for obj in objs:
        # Raises ValidationError (with the offending path) on unknown fields or wrong types.
        kubernetes_validate.validate(obj, desired_version=KUBE_VERSION, strict=True)
        assert obj["metadata"].get("namespace") == NAMESPACE, obj["metadata"]["name"]


def test_validation_is_not_vacuous():
    obj = by_kind(objects(), "Deployment")["embshard-mlflow"]
    obj["spec"]["template"]["spec"]["containers"][0]["resource"] = {}  # a typo'd field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(obj, desired_version=KUBE_VERSION, strict=True)


def test_images_by_digest_reach_every_workload():
    for obj in objects(PROFILES["hardened"]):
        for c in _containers(obj):
            assert c["image"].endswith(f"@{DIGEST}"), (obj["metadata"]["name"], c["name"])


def test_default_install_has_every_piece():
    objs = objects()
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objs}
    assert kinds >= {
        ("ConfigMap", "embshard-stage-pods"), ("ServiceAccount", "embshard-stage"),
        ("Role", "embshard-pod-launcher"), ("RoleBinding", "embshard-pod-launcher"),
        ("PersistentVolumeClaim", "embshard-data"),
        ("Deployment", "embshard-mlflow"), ("Service", "embshard-mlflow"),
        ("StatefulSet", "embshard-postgres"), ("Service", "embshard-postgres"),
        ("Deployment", "embshard-minio"), ("Service", "embshard-minio"), ("Job", "embshard-minio-buckets"),
    }
    # The shared data volume is mounted by several stage pods at once, possibly on different nodes.
    assert by_kind(objs, "PersistentVolumeClaim")["embshard-data"]["spec"]["accessModes"] == ["ReadWriteMany"]
    # Airflow's service accounts may launch and watch pods and read their logs, nothing cluster-wide.
    role = by_kind(objs, "Role")["embshard-pod-launcher"]
    rules = {(r["resources"][0]): set(r["verbs"]) for r in role["rules"]}
    assert {"create", "get", "watch", "delete"} <= rules["pods"] and "get" in rules["pods/log"]
    assert "create" in rules["pods/exec"]  # the XCom sidecar of the ingest pod
    assert not any(o["kind"] in ("ClusterRole", "ClusterRoleBinding") for o in objs)
    binding = by_kind(objs, "RoleBinding")["embshard-pod-launcher"]
    assert {(s["name"], s["namespace"]) for s in binding["subjects"]} == {
        ("airflow-worker", NAMESPACE), ("airflow-scheduler", NAMESPACE)}


def test_mlflow_talks_to_postgres_and_s3_without_secrets_in_the_spec():
    objs = objects()
    mlflow = by_kind(objs, "Deployment")["embshard-mlflow"]["spec"]["template"]["spec"]["containers"][0]
    args = mlflow["args"]
    # the URI (its password expanded) reaches the server by its environment, not its argument list
    assert not any(a.startswith("--backend-store-uri") for a in args)
    assert "--serve-artifacts" in args and "--artifacts-destination=s3://mlflow/artifacts" in args
    env = {e["name"]: e for e in mlflow["env"]}
    assert env["POSTGRES_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "embshard-postgres",
                                                                     "key": "POSTGRES_PASSWORD"}
    assert env["MLFLOW_BACKEND_STORE_URI"]["value"] == (
        "postgresql://mlflow:$(POSTGRES_PASSWORD)@embshard-postgres:5432/mlflow")
    assert env["MLFLOW_S3_ENDPOINT_URL"]["value"] == "http://embshard-minio.embshard.svc.cluster.local:9000"
    # The in-cluster service name passes MLflow's Host-header guard.
    allowed = next(a for a in args if a.startswith("--allowed-hosts="))
    assert "embshard-mlflow*" in allowed.split("=", 1)[1].split(",")
    # The chart creates no Secret; every password comes from one the user created.
    assert not any(o["kind"] == "Secret" for o in objs)
    for obj in objs:
        spec = obj.get("spec", {}).get("template", {}).get("spec") or {}
        for c in spec.get("containers", []):
            for e in c.get("env", []):
                if any(w in e["name"] for w in ("PASSWORD", "SECRET", "ACCESS_KEY")):
                    assert "valueFrom" in e and "value" not in e, (obj["metadata"]["name"], e["name"])


def test_external_services_profile_renders_only_what_is_ours():
    objs = objects(PROFILES["external"])
    names = {(o["kind"], o["metadata"]["name"]) for o in objs}
    assert ("StatefulSet", "embshard-postgres") not in names and ("Deployment", "embshard-minio") not in names
    assert not any(o["kind"] in ("Role", "RoleBinding", "ServiceAccount", "PersistentVolumeClaim") for o in objs)
    mlflow = by_kind(objs, "Deployment")["embshard-mlflow"]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in mlflow["env"]}
    assert env["MLFLOW_BACKEND_STORE_URI"]["valueFrom"]["secretKeyRef"] == {"name": "mlflow-db", "key": "uri"}
    assert "MLFLOW_S3_ENDPOINT_URL" not in env  # AWS S3 itself


def test_bucket_storage_needs_no_shared_volume():
    objs = objects(PROFILES["bucket"])
    assert "embshard-data" not in by_kind(objs, "PersistentVolumeClaim")


def test_bucket_storage_on_the_bundled_minio_gets_its_endpoint():
    """As mlflow.s3Endpoint does: the stage pods' data bucket defaults to the bundled MinIO, not to AWS S3."""
    def pod_storage(values):
        config = by_kind(objects(values), "ConfigMap")["embshard-stage-pods"]
        return yaml.safe_load(config["data"]["stage-pods.yaml"])["storage"]

    bucket = {"stagePods": {"storage": {"type": "bucket", "dataRoot": "s3://embshard/runs"}}}
    assert pod_storage(bucket)["s3Endpoint"].startswith("http://embshard-minio.")
    assert pod_storage({**bucket, "minio": {"enabled": False}})["s3Endpoint"] == ""  # AWS S3
    assert pod_storage({})["s3Endpoint"] == ""  # a shared volume needs none


def test_missing_backend_store_is_a_clear_render_error():
    with pytest.raises(helm.HelmError, match="backend store"):
        render({"postgres": {"enabled": False}})
    # without the bundled MLflow the stages' URI must be given: it pointed at a service that was not there
    with pytest.raises(helm.HelmError, match="stagePods.mlflowTrackingUri"):
        render({"mlflow": {"enabled": False}})


@pytest.mark.parametrize("bad, where", [
    ({"stagePods": {"env": {"AWS_SECRET_ACCESS_KEY": "hunter2"}}}, "propertyName"),
    ({"stagePods": {"env": {"WANDB_API_KEY": "abc"}}}, "propertyName"),
    ({"stagePods": {"stages": {"bench": {"gpu": True, "resources": {}}}}}, "bench"),
    ({"stagePods": {"storage": {"type": "bucket", "dataRoot": "file:///data"}}}, "s3://"),
    ({"stagePods": {"gpu": {"count": 0}}}, "count"),
    ({"mlflow": {"password": "x"}}, "password"),
    ({"stagePods": {"priorityClassName": "High_Priority"}}, "priorityClassName"),
    ({"stagePods": {"gpu": {"priorityClassName": "measure."}}}, "priorityClassName"),
])
def test_schema_rejects_bad_values(bad, where):
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError, match=where):
        chart.validate_schema(bad)


def test_notes_tell_what_to_do_next():
    notes = render()["embshard/templates/NOTES.txt"][0]
    assert "EMBSHARD_K8S_CONFIG" in notes
    assert "kubectl -n embshard create secret generic embshard-credentials" in notes
    assert "port-forward svc/embshard-mlflow" in notes
    assert "GPU stages:   benchmark evaluate_and_promote" in notes


def test_airflow_values_wire_the_kubernetes_runner_to_this_chart():
    """The official Airflow chart is not downloadable here; check our values against what our chart renders."""
    values = yaml.safe_load((ROOT / "charts" / "airflow-values.yaml").read_text())
    assert values["executor"] in ("KubernetesExecutor", "CeleryExecutor")
    assert values["airflowVersion"] == "3.3.2" and values["images"]["airflow"]["tag"].startswith("3.3.2")
    assert values["dags"]["gitSync"]["enabled"] and values["dags"]["gitSync"]["subPath"] == "dags"
    env = {e["name"]: e["value"] for e in values["env"]}
    assert env["EMBSHARD_RUNNER"] == "kubernetes"
    assert env["PYTHONPATH"] == "/opt/airflow/dags/repo/components"

    config_map = by_kind(objects(), "ConfigMap")["embshard-stage-pods"]
    (key,) = config_map["data"]
    volume = next(v for v in values["volumes"] if v.get("configMap", {}).get("name") == "embshard-stage-pods")
    mount = next(m for m in values["volumeMounts"] if m["name"] == volume["name"])
    assert env["EMBSHARD_K8S_CONFIG"] == f"{mount['mountPath']}/{key}"
    # Data root and MLflow URI come from the mounted stage-pods file only, never from a second setting.
    assert "EMBSHARD_DATA_ROOT" not in env and "MLFLOW_TRACKING_URI" not in env


def _containers(obj: dict) -> list[dict]:
    spec = obj.get("spec", {}).get("template", {}).get("spec") or {}
    return spec.get("containers", []) + spec.get("initContainers", [])


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_a_read_only_root_always_has_a_writable_tmp(profile):
    """A container with readOnlyRootFilesystem writes its HOME, caches and temp files to an emptyDir at /tmp."""
    for obj in objects(PROFILES[profile]):
        spec = obj.get("spec", {}).get("template", {}).get("spec") or {}
        empty_dirs = {v["name"] for v in spec.get("volumes", []) if "emptyDir" in v}
        for c in _containers(obj):
            if (c.get("securityContext") or {}).get("readOnlyRootFilesystem"):
                mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
                assert mounts.get("/tmp") in empty_dirs, (obj["metadata"]["name"], c["name"])
                home = {e["name"]: e.get("value") for e in c.get("env", [])}.get("HOME")
                assert home == "/tmp", (obj["metadata"]["name"], c["name"])


def test_mlflow_runs_on_a_read_only_root():
    mlflow = by_kind(objects(), "Deployment")["embshard-mlflow"]
    (container,) = _containers(mlflow)
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    # The stage pods' settings ask for it too (the pods themselves: tests/test_k8s_pods.py).
    config = yaml.safe_load(by_kind(objects(), "ConfigMap")["embshard-stage-pods"]["data"]["stage-pods.yaml"])
    assert config["containerSecurityContext"]["readOnlyRootFilesystem"] is True
