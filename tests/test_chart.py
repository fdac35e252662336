"""The Helm chart lints and renders offline, and every manifest it renders is a valid Kubernetes object.

Helm runs in-process through PyPI `helm-python-sdk` (Helm v4's Go SDK as a shared library, no `helm` binary,
no network); `kubernetes-validate` checks each manifest against the Kubernetes OpenAPI schema, strictly.
What needs a real cluster (images pulling, MLflow reaching Postgres/MinIO, RWX storage) is in docs/cluster.md.
"""
from __future__ import annotations

import json
import re
import subprocess
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
    # The optional hardening: PriorityClasses for the stage and the measuring pods, images by digest,
    # NetworkPolicies.
    "hardened": {"networkPolicy": {"enabled": True, "apiServer": {"cidrs": ["10.0.0.1/32"]},
                                   "mlflowFrom": [{"namespaceSelector": {"matchLabels": {
                                       "kubernetes.io/metadata.name": "ingress-nginx"}}}]},
                 "stagePods": {"priorityClassName": "embshard-batch",
                               "image": f"ghcr.io/embshard/embshard-cuda@{DIGEST}",
                               "gpu": {"priorityClassName": "embshard-measure"}},
                 "mlflow": {"image": f"ghcr.io/mlflow/mlflow:v3.17.2-full@{DIGEST}"},
                 "postgres": {"image": f"postgres:17.6-bookworm@{DIGEST}"},
                 "minio": {"image": f"quay.io/minio/minio@{DIGEST}", "mcImage": f"quay.io/minio/mc@{DIGEST}"}},
    # No MLflow in the chart at all: stages use an existing tracking server.
    # A private registry (mirrored images) and dedicated, tainted nodes for the chart's services; cost labels.
    "private": {"imagePullSecrets": ["corp-registry"], "commonLabels": {"team": "recsys"},
                "stagePods": {"imagePullSecrets": ["corp-registry"]},
                **{c: {"nodeSelector": {"pool": "services"},
                       "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "services",
                                        "effect": "NoSchedule"}],
                       "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                           "nodeSelectorTerms": [{"matchExpressions": [
                               {"key": "zone", "operator": "In", "values": ["a"]}]}]}}}}
                   for c in ("mlflow", "postgres", "minio")}},
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


def test_chart_pods_pull_from_a_private_registry_and_run_where_they_are_sent():
    """MLflow, Postgres, MinIO and its bucket job had no imagePullSecrets, nodeSelector, tolerations or affinity,
    and the schema refused them: with mirrored images they sat in ImagePullBackOff. commonLabels had reached the
    objects but not the pods, which use the resources that cost labels count."""
    values = PROFILES["private"]
    pods = {o["metadata"]["name"]: o["spec"]["template"]["spec"] for o in objects(values)
            if o["kind"] in ("Deployment", "StatefulSet", "Job")}
    labels = {o["metadata"]["name"]: o["spec"]["template"]["metadata"]["labels"] for o in objects(values)
              if o["kind"] in ("Deployment", "StatefulSet", "Job")}
    assert set(pods) == {"embshard-mlflow", "embshard-postgres", "embshard-minio", "embshard-minio-buckets"}
    for name, spec in pods.items():
        assert spec["imagePullSecrets"] == [{"name": "corp-registry"}], name
        assert spec["nodeSelector"] == {"pool": "services"}, name
        assert spec["tolerations"] == values["mlflow"]["tolerations"], name
        assert spec["affinity"] == values["mlflow"]["affinity"], name
        assert labels[name]["team"] == "recsys", name
    # and none of it by default: the cluster's scheduling
    for o in objects():
        if o["kind"] in ("Deployment", "StatefulSet", "Job"):
            spec = o["spec"]["template"]["spec"]
            assert not ({"imagePullSecrets", "nodeSelector", "tolerations", "affinity"} & set(spec)), \
                o["metadata"]["name"]


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
    external = {"minio": {"enabled": False}, "mlflow": {"artifactsDestination": "s3://team-bucket/mlflow"}}
    assert pod_storage({**bucket, **external})["s3Endpoint"] == ""  # AWS S3
    assert pod_storage({})["s3Endpoint"] == ""  # a shared volume needs none


def test_without_minio_mlflow_writes_to_the_bucket_given_as_the_identity_annotated_for_it():
    """With minio.enabled=false MLflow wrote to s3://mlflow/artifacts (a bucket on AWS nobody here owns), and ran as
    the namespace's default ServiceAccount, so an IRSA / workload-identity annotation on embshard-stage (what the
    docs said to do) never reached it: model registration failed."""
    with pytest.raises(helm.HelmError, match="minio.enabled=false needs mlflow.artifactsDestination"):
        render({"minio": {"enabled": False}})

    def mlflow_pod(values):
        return by_kind(objects(values), "Deployment")["embshard-mlflow"]["spec"]["template"]["spec"]

    spec = mlflow_pod({"minio": {"enabled": False}, "mlflow": {"artifactsDestination": "s3://team-bucket/mlflow"}})
    assert "--artifacts-destination=s3://team-bucket/mlflow" in spec["containers"][0]["args"]
    assert spec["serviceAccountName"] == "embshard-stage"  # the ServiceAccount serviceAccount.annotations annotate
    spec = mlflow_pod({"mlflow": {"serviceAccountName": "mlflow-writer"}})
    assert spec["serviceAccountName"] == "mlflow-writer"
    assert "--artifacts-destination=s3://mlflow/artifacts" in spec["containers"][0]["args"]  # the bundled MinIO


@pytest.mark.parametrize("storage, words", [
    ({"mountPath": "/mnt/embshard"}, "dataRoot file:///data/embshard is not on the volume mounted at /mnt/embshard"),
    ({"mountPath": "/tmp", "dataRoot": "file:///tmp/embshard"}, "/tmp is the stage pods' scratch folder"),
    ({"mountPath": "/"}, "a mount path below /"),
])
def test_stage_volume_settings_the_dag_would_refuse_fail_at_render(storage, words):
    """These rendered and linted, then every DAG import failed (k8s.load_pod_config), runs in flight included."""
    with pytest.raises(helm.HelmError, match=re.escape(words)):
        render({"stagePods": {"storage": storage}})
    render({"stagePods": {"storage": {"mountPath": "/mnt/embshard", "dataRoot": "file:///mnt/embshard/runs"}}})


@pytest.mark.parametrize("extra, words", [
    ({"extraVolumes": [{"name": "scratch", "emptyDir": {}}]}, "volume name scratch is taken"),
    ({"extraVolumes": [{"name": "t", "emptyDir": {}}], "extraVolumeMounts": [{"name": "u", "mountPath": "/u"}]},
     "mount u names no volume"),
    ({"extraVolumes": [{"name": "t", "emptyDir": {}}], "extraVolumeMounts": [{"name": "t", "mountPath": "/data"}]},
     "mount path /data is taken"),
])
def test_extra_volumes_the_dag_would_refuse_fail_at_render(extra, words):
    """Rendered and linted, they failed every DAG import (k8s.load_pod_config) instead."""
    with pytest.raises(helm.HelmError, match=re.escape(words)):
        render({"stagePods": extra})
    bucket = {"storage": {"type": "bucket", "dataRoot": "s3://embshard/runs"}}  # nothing mounted at /data then
    render({"stagePods": {**bucket, "extraVolumes": [{"name": "t", "emptyDir": {}}],
                          "extraVolumeMounts": [{"name": "t", "mountPath": "/data"}]}})


def test_an_mlflow_uri_with_credentials_fails_at_render():
    """It rendered, linted and put the password in the ConfigMap; then every DAG import failed (k8s._check)."""
    off = {"mlflow": {"enabled": False}, "postgres": {"enabled": False}, "minio": {"enabled": False}}
    with pytest.raises(helm.HelmError, match=re.escape("stagePods.mlflowTrackingUri carries credentials")):
        render({**off, "stagePods": {"mlflowTrackingUri": "https://user:pw@mlflow.example.com"}})
    # an @ in the path is no credential
    render({**off, "stagePods": {"mlflowTrackingUri": "https://mlflow.example.com/team@recsys"}})


def test_a_release_name_too_long_for_its_object_names_fails_at_render():
    """A 62-character release rendered and linted a 69-character Service name, which the API server refuses."""
    name = "embshard-" + "x" * 53  # 62 characters: the full name is the release's (it holds the chart's name)
    with pytest.raises(helm.HelmError, match=re.escape(f"the object name {name}-minio-buckets is 76 characters")):
        render(name=name)
    longest_ok = "embshard-" + "x" * 40  # 49 + "-minio-buckets" = 63
    names = [o["metadata"]["name"] for o in [obj for objs in render(name=longest_ok).values() for obj in objs]
             if isinstance(o, dict)]
    assert max(len(n) for n in names) == 63
    # without MinIO the longest name is shorter, and so is what it needs
    off = {"minio": {"enabled": False}, "mlflow": {"artifactsDestination": "s3://bucket/mlflow"}}
    render(off, name="embshard-" + "x" * 41)


def test_in_cluster_urls_use_the_clusters_dns_domain():
    """svc.cluster.local was hard-coded: a cluster with its own DNS domain could not reach MLflow or MinIO."""
    objs = objects({"clusterDomain": "corp.internal",
                    "stagePods": {"storage": {"type": "bucket", "dataRoot": "s3://embshard/runs"}}})
    config = yaml.safe_load(by_kind(objs, "ConfigMap")["embshard-stage-pods"]["data"]["stage-pods.yaml"])
    assert config["mlflowTrackingUri"] == "http://embshard-mlflow.embshard.svc.corp.internal:5000"
    assert "svc.cluster.local" not in yaml.safe_dump(objs)


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
    ({"networkPolicy": {"enabled": True, "apiServer": {"cidrs": ["10.0.0.1"]}}}, "cidrs"),
    ({"networkPolicy": {"dns": {"namespaceSelector": {}, "podSelector": {}, "ports": [0]}}}, "ports"),
    ({"networkPolicy": {"enable": True}}, "enable"),
])
def test_schema_rejects_bad_values(bad, where):
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError, match=where):
        chart.validate_schema(bad)


def _bucket_job_script(values: dict) -> tuple[str, dict[str, str]]:
    job = by_kind(objects(values), "Job")["embshard-minio-buckets"]
    (c,) = job["spec"]["template"]["spec"]["containers"]
    return c["args"][0], {e["name"]: e.get("value", "") for e in c["env"]}


_BUCKETS = ["alias set", "mb --ignore-existing embshard/mlflow", "mb --ignore-existing embshard/embshard"]
_USER = ["admin user add", "admin policy create", "admin policy attach"]


@pytest.mark.parametrize("stage_key, attach, code, calls", [
    (None, "", 1, _BUCKETS),  # no stage Secret: a clear failure, no user made
    ("stagekey", "", 0, _BUCKETS + _USER),
    ("stagekey", "already", 0, _BUCKETS + _USER),  # a re-run (helm upgrade)
    ("stagekey", "denied", 1, _BUCKETS + _USER),
])
def test_bucket_storage_on_minio_gives_the_stages_a_user_of_their_bucket_alone(tmp_path, stage_key, attach, code,
                                                                                 calls):
    """The stage pods had MinIO's root key (envFromSecrets: embshard-credentials): a stage could read MLflow's
    artifacts and delete every bucket. They now get secrets.stageCredentials, which the bucket job makes a MinIO
    user whose policy reaches the data bucket alone. MinIO cannot run here: the rendered script runs against a stub
    `mc` that records its calls (attach fails when `attach` says so: MinIO answers "already in effect" on a re-run)."""
    script, env = _bucket_job_script(PROFILES["bucket"])
    assert env["STAGE_BUCKET"] == "embshard" and set(env["BUCKETS"].split()) == {"mlflow", "embshard"}
    stub = tmp_path / "bin" / "mc"
    stub.parent.mkdir()
    log = tmp_path / "calls"
    stub.write_text(f"""#!/bin/sh
echo "$*" >> {log}
case "$*" in "admin policy create"*) cp "$6" {tmp_path}/policy.json;; esac
case "$*" in "admin policy attach"*) [ -n "{attach}" ] && {{ echo "{attach}" >&2; exit 1; }};; esac
exit 0
""")
    stub.chmod(0o755)
    run_env = {**env, "PATH": f"{stub.parent}:/usr/bin:/bin", "AWS_ACCESS_KEY_ID": "root",
               "AWS_SECRET_ACCESS_KEY": "rootsecret", "HOME": str(tmp_path)}
    if stage_key:
        run_env.update(STAGE_ACCESS_KEY_ID=stage_key, STAGE_SECRET_ACCESS_KEY="stagesecret")
    else:
        run_env.update(STAGE_ACCESS_KEY_ID="", STAGE_SECRET_ACCESS_KEY="")
    script = script.replace("/tmp/", f"{tmp_path}/")
    out = subprocess.run(["sh", "-c", script], env=run_env, capture_output=True, text=True)
    assert out.returncode == code, out.stderr
    made = log.read_text().splitlines()
    assert len(made) == len(calls) and all(m.startswith(c) for m, c in zip(made, calls)), made
    if stage_key is None:
        assert "embshard-stage-credentials" in out.stderr and "s3://embshard" in out.stderr
        return
    text = log.read_text()
    assert "admin user add embshard stagekey stagesecret" in text and "--user stagekey" in text
    policy = json.loads((tmp_path / "policy.json").read_text())
    resources = {r for st in policy["Statement"] for r in st["Resource"]}
    assert resources == {"arn:aws:s3:::embshard", "arn:aws:s3:::embshard/*"}  # the data bucket alone
    assert not any(a.startswith("s3:*") or a.startswith("admin") for st in policy["Statement"] for a in st["Action"])


def test_notes_ask_only_for_the_secrets_this_release_reads():
    """With MLflow, Postgres and MinIO all outside, NOTES still asked for MLflow's artifact key; with the stages'
    bucket on an outside S3 it gave MinIO's recipe (a key id of our choosing, which no S3 knows)."""
    outside = {"mlflow": {"enabled": False}, "postgres": {"enabled": False}, "minio": {"enabled": False},
               "stagePods": {"mlflowTrackingUri": "https://mlflow.example.com",
                             "storage": {"type": "bucket", "dataRoot": "s3://team-data/embshard",
                                         "s3Endpoint": "https://s3.eu-west-1.amazonaws.com"}}}
    notes = render(outside)["embshard/templates/NOTES.txt"][0]
    assert "embshard-credentials " not in notes and "AWS_ACCESS_KEY_ID=embshard-stage" not in notes
    assert "create secret generic embshard-stage-credentials" in notes and "<your S3 key id>" in notes
    assert "s3://team-data/embshard, made in your S3" in notes
    bundled = render(PROFILES["bucket"])["embshard/templates/NOTES.txt"][0]
    assert "create secret generic embshard-credentials " in bundled
    assert "AWS_ACCESS_KEY_ID=embshard-stage" in bundled and "MinIO user of s3://embshard alone" in bundled


def test_stage_pods_never_get_the_root_key_by_default():
    for profile in ("defaults", "bucket"):
        config = yaml.safe_load(by_kind(objects(PROFILES[profile]), "ConfigMap")["embshard-stage-pods"]["data"][
            "stage-pods.yaml"])
        assert [s["name"] for s in config["envFromSecrets"]] == ["embshard-stage-credentials"], profile
    # on a shared volume the stages need no key and the bucket job makes no user
    assert _bucket_job_script({})[1]["STAGE_BUCKET"] == ""
    # a data bucket of its own is created too, and a stage endpoint elsewhere gets no MinIO user
    own = {"stagePods": {"storage": {"type": "bucket", "dataRoot": "s3://team-data/embshard"}}}
    env = _bucket_job_script(own)[1]
    assert env["STAGE_BUCKET"] == "team-data" and "team-data" in env["BUCKETS"].split()
    other = {"stagePods": {"storage": {"type": "bucket", "dataRoot": "s3://team-data/x",
                                       "s3Endpoint": "https://s3.eu-west-1.amazonaws.com"}}}
    assert _bucket_job_script(other)[1]["STAGE_BUCKET"] == ""
    notes = render(PROFILES["bucket"])["embshard/templates/NOTES.txt"][0]
    assert "create secret generic embshard-stage-credentials" in notes and "WARNING" not in notes
    renamed = {**PROFILES["bucket"], "secrets": {"stageCredentials": "team-stage-key"}}
    assert "WARNING: stagePods.envFromSecrets does not name team-stage-key" in render(renamed)[
        "embshard/templates/NOTES.txt"][0]
    assert _bucket_job_script(renamed)[1]["STAGE_CREDENTIALS"] == "team-stage-key"
    root = {"stagePods": {"envFromSecrets": [{"name": "embshard-credentials", "optional": True}]}}
    assert "WARNING: stagePods.envFromSecrets gives every stage pod embshard-credentials" in render(root)[
        "embshard/templates/NOTES.txt"][0]


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
    assert sorted(config_map["data"]) == ["run-params.yaml", "stage-pods.yaml"]
    volume = next(v for v in values["volumes"] if v.get("configMap", {}).get("name") == "embshard-stage-pods")
    mount = next(m for m in values["volumeMounts"] if m["name"] == volume["name"])
    assert env["EMBSHARD_K8S_CONFIG"] == f"{mount['mountPath']}/stage-pods.yaml"
    assert env["EMBSHARD_PARAMS_FILE"] == f"{mount['mountPath']}/run-params.yaml"
    # Data root and MLflow URI come from the mounted stage-pods file only, never from a second setting.
    assert "EMBSHARD_DATA_ROOT" not in env and "MLFLOW_TRACKING_URI" not in env


def test_run_params_are_the_defaults_of_scheduled_runs(tmp_path, monkeypatch):
    """Scheduled and asset-triggered runs have no conf: runParams reach the DAG's defaults (EMBSHARD_PARAMS_FILE)
    through the ConfigMap Airflow mounts; none by default (the params' own defaults)."""
    from embshard import params

    team = {"source": "spec", "input": "s3://team/tables.csv", "devices": 8, "memory_gb": 80}
    for values, want in (({}, {}), ({"runParams": team}, team)):
        text = by_kind(objects(values), "ConfigMap")["embshard-stage-pods"]["data"]["run-params.yaml"]
        assert yaml.safe_load(text) == want
        path = tmp_path / "run-params.yaml"
        path.write_text(text)
        monkeypatch.setenv(params.PARAMS_FILE_ENV, str(path))
        assert params.run_defaults() == {**params.DEFAULT_PARAMS, **want}


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


# --- NetworkPolicy: who may talk to whom, evaluated on the rendered policies -------------------------------------
def _selects(selector: dict, labels: dict) -> bool:
    """A Kubernetes label selector (matchLabels, matchExpressions In/NotIn/Exists/DoesNotExist) on labels."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        have = e["key"] in labels
        ok = {"Exists": have, "DoesNotExist": not have, "In": have and labels[e["key"]] in e.get("values", []),
              "NotIn": not have or labels[e["key"]] not in e.get("values", [])}[e["operator"]]
        if not ok:
            return False
    return True


def _peer_admits(peer: dict, labels: dict, namespace: str, ns_labels: dict) -> bool:
    if "ipBlock" in peer:
        return False  # pods are not addressed by CIDR here
    if "namespaceSelector" in peer:
        if not _selects(peer["namespaceSelector"], ns_labels):
            return False
    elif namespace != NAMESPACE:
        return False  # a bare podSelector means the policy's own namespace
    return _selects(peer.get("podSelector", {}), labels)


def _rules_admit(rules: list[dict], peers_key: str, labels: dict, port: int, namespace: str, ns_labels: dict) -> bool:
    for rule in rules:
        if rule.get("ports") and not any(p.get("port") == port for p in rule["ports"]):
            continue
        if not rule.get(peers_key) or any(_peer_admits(peer, labels, namespace, ns_labels)
                                          for peer in rule[peers_key]):
            return True
    return False


def can_connect(policies: list[dict], src: dict, dst: dict, port: int, src_namespace: str = NAMESPACE,
                dst_namespace: str = NAMESPACE) -> bool:
    """Whether the policies (all in NAMESPACE) let a pod labelled `src` open `port` on a pod labelled `dst`."""
    ns_labels = {"src": {"kubernetes.io/metadata.name": src_namespace},
                 "dst": {"kubernetes.io/metadata.name": dst_namespace}}
    for direction, pod, other, other_ns, peers_key in (("Egress", src, dst, dst_namespace, "to"),
                                                       ("Ingress", dst, src, src_namespace, "from")):
        own_ns = src_namespace if direction == "Egress" else dst_namespace
        applying = [p["spec"] for p in policies if own_ns == NAMESPACE and direction in p["spec"]["policyTypes"]
                    and _selects(p["spec"]["podSelector"], pod)]
        key = "egress" if direction == "Egress" else "ingress"
        if applying and not any(_rules_admit(spec.get(key) or [], peers_key, other, port, other_ns,
                                             ns_labels["dst" if direction == "Egress" else "src"])
                                for spec in applying):
            return False
    return True


def _pod_labels(objs: list[dict], kind: str, name: str) -> dict:
    return by_kind(objs, kind)[name]["spec"]["template"]["metadata"]["labels"]


def test_network_policies_are_off_by_default():
    assert not any(o["kind"] == "NetworkPolicy" for o in objects())


def test_network_policies_let_only_the_release_talk_to_its_services():
    from embshard import k8s

    objs = objects(PROFILES["hardened"])
    policies = list(by_kind(objs, "NetworkPolicy").values())
    assert {p["metadata"]["name"] for p in policies} == {
        "embshard-stage-pods", "embshard-mlflow", "embshard-postgres", "embshard-minio"}
    stage = k8s.pod_operator_kwargs("benchmark", ["bench"])["labels"]  # what the DAG's pods carry
    mlflow = _pod_labels(objs, "Deployment", "embshard-mlflow")
    postgres = _pod_labels(objs, "StatefulSet", "embshard-postgres")
    minio = _pod_labels(objs, "Deployment", "embshard-minio")
    buckets = _pod_labels(objs, "Job", "embshard-minio-buckets")
    dns = {"k8s-app": "kube-dns"}
    other = {"app": "someone-else"}  # any other pod of the namespace

    # stage pods: MLflow, MinIO (S3) and DNS only
    assert can_connect(policies, stage, mlflow, 5000) and can_connect(policies, stage, minio, 9000)
    assert can_connect(policies, stage, dns, 53, dst_namespace="kube-system")
    assert not can_connect(policies, stage, postgres, 5432) and not can_connect(policies, stage, minio, 9001)
    assert not can_connect(policies, stage, other, 8080)
    assert not can_connect(policies, stage, {"k8s-app": "kube-dns"}, 53, dst_namespace="elsewhere")
    # the services accept only the release's pods
    assert can_connect(policies, mlflow, postgres, 5432)
    assert can_connect(policies, mlflow, minio, 9000) and can_connect(policies, buckets, minio, 9000)
    for service, port in ((mlflow, 5000), (postgres, 5432), (minio, 9000)):
        assert not can_connect(policies, other, service, port), service
        assert not can_connect(policies, stage, service, port, src_namespace="elsewhere"), service
    assert not can_connect(policies, other, stage, 8080)  # stage pods accept nothing
    # mlflowFrom adds peers: an ingress controller's namespace
    assert can_connect(policies, {"app": "nginx"}, mlflow, 5000, src_namespace="ingress-nginx")
    # the API server by its CIDR, on the given ports
    stage_policy = by_kind(objs, "NetworkPolicy")["embshard-stage-pods"]["spec"]
    api = [r for r in stage_policy["egress"] if any("ipBlock" in t for t in r["to"])]
    assert api == [{"to": [{"ipBlock": {"cidr": "10.0.0.1/32"}}],
                    "ports": [{"protocol": "TCP", "port": 443}, {"protocol": "TCP", "port": 6443}]}]


def test_network_policy_evaluator_is_not_vacuous():
    """Without the policies everything connects; a policy for MLflow alone shuts out only who it does not name."""
    assert can_connect([], {"app": "x"}, {"app": "y"}, 1)
    objs = objects(PROFILES["hardened"])
    mlflow_only = [by_kind(objs, "NetworkPolicy")["embshard-mlflow"]]
    postgres = _pod_labels(objs, "StatefulSet", "embshard-postgres")
    assert can_connect(mlflow_only, {"app": "x"}, postgres, 5432)
    assert not can_connect(mlflow_only, {"app": "x"}, _pod_labels(objs, "Deployment", "embshard-mlflow"), 5000)


def test_network_policies_without_a_way_out_are_a_render_error():
    """An external MLflow or S3 is not a pod of the release: the stage pods need a rule to reach it."""
    on = {"enabled": True}
    with pytest.raises(helm.HelmError, match="networkPolicy.stageEgress"):
        render({**PROFILES["no-mlflow"], "networkPolicy": on})
    with pytest.raises(helm.HelmError, match="S3 endpoint"):
        render({"minio": {"enabled": False}, "networkPolicy": on,
                "stagePods": {"storage": {"type": "bucket", "dataRoot": "s3://bucket/runs"}}})
    egress = [{"to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}], "ports": [{"protocol": "TCP", "port": 443}]}]
    objs = objects({**PROFILES["no-mlflow"], "networkPolicy": {**on, "stageEgress": egress}})
    (policy,) = by_kind(objs, "NetworkPolicy").values()
    assert policy["spec"]["egress"][-1] == egress[0]
    for obj in objs:
        kubernetes_validate.validate(obj, desired_version=KUBE_VERSION, strict=True)
