"""Stage pods on Kubernetes: the one source of truth for how each pipeline stage runs as a pod.

The DAG's `kubernetes` runner builds one KubernetesPodOperator per stage from `pod_operator_kwargs(stage,
arguments)`. Its settings are `POD_DEFAULTS`, overridden by the YAML file named in `EMBSHARD_K8S_CONFIG`.
The Helm chart (charts/embshard) renders that YAML into a ConfigMap from its `stagePods` values, and the
Airflow values (charts/airflow-values.yaml) mount it into the scheduler and workers; tests/test_k8s_pods.py
checks that the chart's defaults equal `POD_DEFAULTS`, so the two cannot drift apart.

Credentials never appear here: pods get them from Kubernetes Secrets (`envFromSecrets`, `secretEnv`).
The kubernetes client is imported inside functions so that importing this module stays cheap.
"""
from __future__ import annotations

import copy
import json
import os
import re
from typing import Any

from .errors import EmbshardError

CONFIG_ENV = "EMBSHARD_K8S_CONFIG"
# Environment names that hold credentials (the chart's values.schema.json refuses the same in stagePods.env).
CREDENTIAL_NAME = re.compile(r"(?i)(SECRET|PASSWORD|TOKEN|ACCESS_KEY|API_KEY)")
# An image reference, [registry[:port]/]path[:tag][@sha256:<64 hex>]: a digest pins the exact image (the chart's
# schema holds the same pattern).
IMAGE_NAME = re.compile(r"(?:[A-Za-z0-9.-]+(?::[0-9]+)?/)?[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
                        r"(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?")
DIGEST = re.compile(r"sha256:[a-f0-9]{64}")
# A PriorityClass name is a DNS subdomain (the chart's schema holds the same pattern).
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")

MLFLOW_WAIT_ENV, MLFLOW_WAIT_S = "EMBSHARD_MLFLOW_WAIT_S", 300  # registry.WAIT_ENV (k8s.py imports no registry)

# Stage names (`embshard stage NAME`; the outer loop's tasks run train_cost_model, train_policy and
# measure_policy_plans with --round, under their own task ids).
STAGES = ("ingest", "sample_shards", "benchmark", "train_cost_model", "train_policy", "measure_policy_plans",
          "evaluate_and_promote", "export_placements")

# Stages that time kernels (export_placements too, with refine_k > 0).
MEASURING = ("sample_shards", "benchmark", "measure_policy_plans", "evaluate_and_promote")
# `embshard stage` exits 2 on an EmbshardError (cli): it said what to fix, and running it again changes nothing.
BAD_INPUT_EXIT_CODE = 2

# The stage container's root filesystem is read-only (containerSecurityContext.readOnlyRootFilesystem): what a
# stage writes besides its data goes to an emptyDir at SCRATCH (benchmark inputs, a decompressed trace, MLflow's
# artifact staging), and these point every home, cache and config there. The image's home is read-only, so
# without them matplotlib rebuilds its font cache in a new temp folder (with a warning) in every process.
SCRATCH = "/tmp"
SCRATCH_ENV = {
    "HOME": SCRATCH,
    "TMPDIR": SCRATCH,
    "XDG_CACHE_HOME": f"{SCRATCH}/.cache",  # torch hub and kernels, fsspec
    "XDG_CONFIG_HOME": f"{SCRATCH}/.config",
    "MPLCONFIGDIR": f"{SCRATCH}/matplotlib",  # matplotlib's config and font cache
    "TRITON_CACHE_DIR": f"{SCRATCH}/triton",  # kernels triton (and torch.compile) compile
    "TORCHINDUCTOR_CACHE_DIR": f"{SCRATCH}/torchinductor",
    "CUDA_CACHE_PATH": f"{SCRATCH}/.nv/ComputeCache",  # the driver's JIT cache of PTX kernels
    "PYTHONDONTWRITEBYTECODE": "1",  # the images compile bytecode at build; none to write beside the code
}

# camelCase keys, as in the chart's values (`stagePods`), so the ConfigMap is this dict verbatim.
POD_DEFAULTS: dict[str, Any] = {
    "image": "ghcr.io/embshard/embshard-cuda:0.1.0",
    "imagePullPolicy": "IfNotPresent",
    "imagePullSecrets": [],
    "namespace": "embshard",
    "serviceAccountName": "embshard-stage",
    "labels": {"app.kubernetes.io/name": "embshard", "app.kubernetes.io/component": "stage"},
    "annotations": {},
    # A PriorityClass (created by the cluster admin) for every stage pod; empty: the cluster's default.
    "priorityClassName": "",
    # In-cluster MLflow server of the chart (release "embshard" in namespace "embshard").
    "mlflowTrackingUri": "http://embshard-mlflow.embshard.svc.cluster.local:5000",
    # Plain, non-secret settings.
    "env": {"PYTHONUNBUFFERED": "1"},
    # Whole Secrets as environment (S3 keys, MLflow auth); optional so clusters with workload identity
    # (IRSA, GKE WI) need none. The stages' own key (the chart's secrets.stageCredentials), not MinIO's root user.
    "envFromSecrets": [{"name": "embshard-stage-credentials", "optional": True}],
    # Single keys from Secrets: [{"name": ENV_NAME, "secretName": ..., "key": ..., "optional": bool}].
    "secretEnv": [],
    # Volumes every stage pod mounts besides its own (Kubernetes Volume and VolumeMount specs, camelCase): e.g. a
    # read-only volume of DLRM traces, which are read from a local path (ingest, and the benchmark replays them).
    "extraVolumes": [],
    "extraVolumeMounts": [],
    # Where stages exchange Parquet: a shared ReadWriteMany PVC, or a bucket (then no volume is mounted).
    "storage": {
        "type": "pvc",  # "pvc" | "bucket"
        "claimName": "embshard-data",
        "mountPath": "/data",
        "dataRoot": "file:///data/embshard",
        # For type "bucket": dataRoot "s3://bucket/prefix"; endpoint for S3-compatible stores (MinIO).
        "s3Endpoint": "",
    },
    "gpu": {
        "resourceName": "nvidia.com/gpu",
        "count": 1,
        # /dev/shm of a pod with 2+ GPUs (NCCL's buffers; the runtime's default is 64 MiB), from its memory limit
        "shmSize": "2Gi",
        # None by default: the GPU request alone keeps a pod on GPU nodes, and GPU feature discovery's labels
        # (nvidia.com/gpu.present, .product) are not on every cluster (a selector on them left pods Pending, and an
        # autoscaler cannot scale a GPU pool up from zero for a label added after boot). Pin a product here to
        # measure on one GPU type only, e.g. {"nvidia.com/gpu.product": "NVIDIA-H200"}.
        "nodeSelector": {},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        # The GPU (measuring) pods' PriorityClass; empty: the stage pods' one. A higher one lets measuring pods
        # preempt others for GPU nodes; a lower one leaves them to run in the gaps.
        "priorityClassName": "",
    },
    # fsGroupChangePolicy: the volume is re-owned only when its root is not the group's (a full chown of a volume
    # holding every run slowed each pod's start)
    "podSecurityContext": {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001,
                           "fsGroup": 10001, "fsGroupChangePolicy": "OnRootMismatch",
                           "seccompProfile": {"type": "RuntimeDefault"}},
    # Read-only root: the stage writes only to its data (volume or bucket) and the emptyDir at SCRATCH.
    "containerSecurityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                                 "readOnlyRootFilesystem": True},
    "startupTimeoutSeconds": 900,  # GPU nodes may scale up from zero and pull a multi-GB image
    # Benchmark chunk pods of one run at a time (each holds gpu.count GPUs); 0: as many as there are chunks.
    "maxBenchmarkPods": 0,
    "onFinishAction": "delete_succeeded_pod",  # failed pods stay for `kubectl logs/describe`
    # Per stage: resources and whether the pod needs a GPU. Measuring stages run on the GPU type whose costs
    # they learn from: sample_shards calibrates the all-to-all of that hardware, benchmark measures shards,
    # measure_policy_plans the policy's plans, evaluate_and_promote whole placements. Where they measure is the
    # run's `device` param (auto: the pod's GPU); a CPU-only cluster sets these to false and device=cpu.
    "stages": {
        "ingest": {"gpu": False, "resources": {"requests": {"cpu": "1", "memory": "4Gi"},
                                               "limits": {"cpu": "2", "memory": "8Gi"}}},
        # Measuring stages: requests = limits in whole CPUs (Guaranteed QoS; with the kubelet's static CPU
        # manager, cores of their own): a pod sharing cores with its neighbours times their load too.
        "sample_shards": {"gpu": True, "resources": {"requests": {"cpu": "2", "memory": "4Gi"},
                                                      "limits": {"cpu": "2", "memory": "4Gi"}}},
        "benchmark": {"gpu": True, "resources": {"requests": {"cpu": "8", "memory": "32Gi"},
                                                 "limits": {"cpu": "8", "memory": "32Gi"}}},
        "train_cost_model": {"gpu": False, "resources": {"requests": {"cpu": "4", "memory": "8Gi"},
                                                         "limits": {"cpu": "8", "memory": "16Gi"}}},
        "train_policy": {"gpu": False, "resources": {"requests": {"cpu": "4", "memory": "8Gi"},
                                                     "limits": {"cpu": "8", "memory": "16Gi"}}},
        "measure_policy_plans": {"gpu": True, "resources": {"requests": {"cpu": "8", "memory": "32Gi"},
                                                            "limits": {"cpu": "8", "memory": "32Gi"}}},
        "evaluate_and_promote": {"gpu": True, "resources": {"requests": {"cpu": "8", "memory": "32Gi"},
                                                            "limits": {"cpu": "8", "memory": "32Gi"}}},
        "export_placements": {"gpu": False, "resources": {"requests": {"cpu": "1", "memory": "2Gi"},
                                                          "limits": {"cpu": "2", "memory": "4Gi"}}},
    },
}


def _merge(base: dict, override: dict) -> dict:
    """Deep-merge `override` into a copy of `base`: dicts merge, lists and scalars replace, null deletes
    (Helm's rules for values, so a file and the chart's values mean the same thing)."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _check(config: dict, source: str) -> dict:
    unknown = sorted(set(config) - set(POD_DEFAULTS))
    if unknown:
        raise EmbshardError(f"unknown pod setting(s) {unknown}", path=source,
                            fix=f"use only {sorted(POD_DEFAULTS)}")
    if not config.get("image"):
        raise EmbshardError("no image set", path=source, field="image",
                            fix="set the embshard image, e.g. <registry>/embshard-cuda:0.1.0")
    _check_image(config["image"], source, "image")
    for stage, spec in config["stages"].items():
        if stage not in STAGES:
            raise EmbshardError(f"unknown stage '{stage}'", path=source, field="stages",
                                fix=f"use one of {list(STAGES)}")
        if not isinstance(spec, dict) or not isinstance(spec.get("resources", {}), dict):
            raise EmbshardError("a stage needs a mapping with 'gpu' and 'resources'", path=source,
                                field=f"stages.{stage}")
        if spec.get("image"):
            _check_image(spec["image"], source, f"stages.{stage}.image")
    storage = config["storage"]
    if storage.get("type") not in ("pvc", "bucket"):
        raise EmbshardError(f"storage type '{storage.get('type')}' is not supported", path=source,
                            field="storage.type", fix="use 'pvc' (a shared volume) or 'bucket' (s3://)")
    if storage["type"] == "pvc" and not storage.get("claimName"):
        raise EmbshardError("a pvc storage needs a claim name", path=source, field="storage.claimName")
    # Credentials go through Secrets (envFromSecrets, secretEnv), never the ConfigMap this file becomes: the chart's
    # schema refuses them, and a file given by EMBSHARD_K8S_CONFIG is held to the same rule.
    secret = [k for k in (config.get("env") or {}) if CREDENTIAL_NAME.search(str(k))]
    if secret:
        raise EmbshardError(f"env {secret[0]!r} looks like a credential", path=source, field="env",
                            fix="put it in a Secret and name it in envFromSecrets or secretEnv")
    if "@" in str(config.get("mlflowTrackingUri") or "").split("://", 1)[-1].split("/", 1)[0]:
        raise EmbshardError("mlflowTrackingUri carries credentials (user:password@host)", path=source,
                            field="mlflowTrackingUri",
                            fix="give the URI without them; MLflow reads MLFLOW_TRACKING_USERNAME/PASSWORD or "
                                "MLFLOW_TRACKING_TOKEN from a Secret (secretEnv)")
    for field, name in (("priorityClassName", config.get("priorityClassName")),
                        ("gpu.priorityClassName", config["gpu"].get("priorityClassName"))):
        if name and not (isinstance(name, str) and len(name) <= 253 and DNS_SUBDOMAIN.fullmatch(name)):
            raise EmbshardError(f"{name!r} is not a PriorityClass name", path=source, field=field,
                                fix="give a lowercase DNS name (a-z, 0-9, '-', '.'), e.g. embshard-measure, or ''")
    cap = config.get("maxBenchmarkPods", 0)
    if not isinstance(cap, int) or isinstance(cap, bool) or cap < 0:
        raise EmbshardError(f"maxBenchmarkPods {cap!r} is not a count", path=source, field="maxBenchmarkPods",
                            fix="give 0 (every chunk at once) or a positive integer")
    if storage["type"] == "pvc" and str(storage.get("mountPath", "")).strip("/") == "":
        raise EmbshardError("a pvc storage needs a mount path below /", path=source, field="storage.mountPath",
                            fix="e.g. /data")
    if storage["type"] == "pvc" and "/" + str(storage.get("mountPath", "")).strip("/") == SCRATCH:
        raise EmbshardError(f"{SCRATCH} is the pods' scratch folder (an emptyDir)", path=source,
                            field="storage.mountPath", fix="mount the data volume elsewhere, e.g. /data")
    if storage["type"] == "pvc":
        # A data root outside the mount is each pod's own disk: a stage's outputs vanish with its pod and the
        # next stage fails with "missing stage output".
        mount = "/" + str(storage.get("mountPath", "")).strip("/")
        root = "/" + str(storage.get("dataRoot", "")).removeprefix("file://").strip("/")
        if not (root == mount or root.startswith(mount.rstrip("/") + "/")):
            raise EmbshardError(f"data root {storage.get('dataRoot')} is not on the volume mounted at "
                                f"{storage.get('mountPath')}", path=source, field="storage.dataRoot",
                                fix=f"put it under the mount, e.g. file://{mount.rstrip('/')}/embshard, or mount "
                                    "the volume where it is")
    if storage["type"] == "bucket" and not str(storage.get("dataRoot", "")).startswith("s3://"):
        raise EmbshardError("a bucket storage needs an s3:// data root", path=source,
                            field="storage.dataRoot", fix="e.g. s3://my-bucket/embshard")
    for item in config.get("secretEnv", []):
        if not {"name", "secretName", "key"} <= set(item):
            raise EmbshardError("each secretEnv entry needs name, secretName and key", path=source,
                                field="secretEnv")
    _check_extra_volumes(config, source)
    return config


OWN_VOLUMES = ("scratch", "embshard-data", "dshm")  # the volumes a stage pod mounts itself


def _check_extra_volumes(config: dict, source: str) -> None:
    """extraVolumes / extraVolumeMounts: each a named mapping, no name or path a stage pod uses itself, every mount
    of a volume given (a pod naming a missing volume is refused by the API server only when a run starts)."""
    volumes, mounts = config.get("extraVolumes") or [], config.get("extraVolumeMounts") or []
    for field, items in (("extraVolumes", volumes), ("extraVolumeMounts", mounts)):
        if not isinstance(items, list) or not all(isinstance(v, dict) and v.get("name") for v in items):
            raise EmbshardError("needs a list of mappings, each with a name", path=source, field=field,
                                fix="e.g. [{name: traces, persistentVolumeClaim: {claimName: dlrm-traces}}]")
    names = [v["name"] for v in volumes]
    taken = [n for n in names if n in OWN_VOLUMES] or [n for n in set(names) if names.count(n) > 1]
    if taken:
        raise EmbshardError(f"volume name {taken[0]!r} is taken", path=source, field="extraVolumes",
                            fix=f"name each extra volume once, and none of {list(OWN_VOLUMES)}")
    own_paths = {SCRATCH, "/dev/shm"}
    if config["storage"].get("type") == "pvc":  # a bucket mounts nothing
        own_paths.add("/" + str(config["storage"].get("mountPath", "")).strip("/"))
    seen: set[str] = set()
    for m in mounts:
        path = "/" + str(m.get("mountPath", "")).strip("/")
        if m["name"] not in names:
            raise EmbshardError(f"mount {m['name']!r} names no volume of extraVolumes", path=source,
                                field="extraVolumeMounts", fix=f"add it to extraVolumes, or use one of {names}")
        if path == "/" or path in own_paths or path in seen:
            raise EmbshardError(f"mount path {m.get('mountPath')!r} is taken (the stage pods' own, or another "
                                "mount's)", path=source, field="extraVolumeMounts",
                                fix="mount it elsewhere, e.g. /traces")
        seen.add(path)


def _check_image(ref: Any, source: str, field: str) -> None:
    """A malformed reference fails here in one line, not as a pod stuck in InvalidImageName."""
    ref = str(ref)
    digest = ref.partition("@")[2]
    if "@" in ref and not DIGEST.fullmatch(digest):
        raise EmbshardError(f"image digest {digest!r} is not sha256: and 64 lowercase hex digits", path=source,
                            field=field, fix="pin as <image>@sha256:<digest>, the digest `docker push` printed")
    if not IMAGE_NAME.fullmatch(ref.partition("@")[0]):
        raise EmbshardError(f"{ref!r} is not an image reference", path=source, field=field,
                            fix="give <registry>/<name>:<tag> or <registry>/<name>[:<tag>]@sha256:<digest>")


def load_pod_config(path: str | os.PathLike | None = None) -> dict:
    """POD_DEFAULTS overridden by the YAML at `path` (else $EMBSHARD_K8S_CONFIG; else the defaults alone).

    The YAML has the same keys as POD_DEFAULTS (the chart's `stagePods` values); it may set only a few.
    """
    import yaml

    path = path or os.environ.get(CONFIG_ENV) or None
    if path is None:
        return _check(copy.deepcopy(POD_DEFAULTS), "POD_DEFAULTS")
    try:
        with open(path, encoding="utf-8") as f:
            override = yaml.safe_load(f) or {}
    except OSError as exc:
        raise EmbshardError(f"cannot read the pod settings ({exc.strerror})", path=str(path),
                            fix=f"mount the chart's ConfigMap there or unset {CONFIG_ENV}") from exc
    except yaml.YAMLError as exc:
        raise EmbshardError(f"not valid YAML ({exc})", path=str(path)) from exc
    if not isinstance(override, dict):
        raise EmbshardError("the pod settings must be a YAML mapping", path=str(path))
    return _check(_merge(POD_DEFAULTS, override), str(path))


def data_root(config: dict | None = None) -> str:
    """The storage root stage pods see (file:///data/... on the shared PVC, or s3://...)."""
    config = config if config is not None else load_pod_config()
    return config["storage"]["dataRoot"]


# How many GPUs the pod was given (GPU stages only; stages.measuring_device reads it).
GPUS_GIVEN_ENV = "EMBSHARD_GPUS_GIVEN"
# Environment variables that carry a run's root and params into a mapped stage pod's arguments (`env_ref`).
RUN_ROOT_ENV = "EMBSHARD_RUN_ROOT"
RUN_PARAMS_ENV = "EMBSHARD_RUN_PARAMS"


def env_ref(name: str) -> str:
    """An argument that Kubernetes replaces with the container's environment variable `name` (`$(NAME)`).
    Airflow renders no value a mapped task gets from XCom, so a mapped pod's templated arguments (the run root,
    the params) go in as environment variables, which are rendered, referred to from its arguments."""
    return f"$({name})"


def pod_operator_kwargs(stage: str, arguments: list[str], config: dict | None = None,
                        argument_env: dict[str, str] | None = None) -> dict:
    """Keyword arguments for `KubernetesPodOperator(task_id=..., **kwargs)` running `embshard <arguments>`.

    The image's entrypoint is `embshard`, so `arguments` start with the command: ["bench", "--tables", ...].
    GPU stages request and limit `gpu.count` of `gpu.resourceName` and carry the GPU node selector and
    tolerations; the others carry neither. `argument_env`: environment variables the arguments refer to
    (`env_ref`), set after the configured ones so that no configured `env` can replace them.
    """
    from kubernetes.client import models as k8s

    config = config if config is not None else load_pod_config()
    if stage not in STAGES:
        raise EmbshardError(f"unknown stage '{stage}'", field="stage", fix=f"use one of {list(STAGES)}")
    spec = config["stages"].get(stage) or {"gpu": False, "resources": {}}
    gpu = config["gpu"]
    image = spec.get("image") or config["image"]  # e.g. the CPU image for the stages without a GPU

    requests = {k: str(v) for k, v in (spec.get("resources", {}).get("requests") or {}).items()}
    limits = {k: str(v) for k, v in (spec.get("resources", {}).get("limits") or {}).items()}
    node_selector: dict[str, str] = {}
    tolerations: list[k8s.V1Toleration] = []
    priority_class = config.get("priorityClassName") or None
    if spec.get("gpu"):
        priority_class = gpu.get("priorityClassName") or priority_class
        # Extended resources must be requested and limited with the same whole number.
        requests[gpu["resourceName"]] = limits[gpu["resourceName"]] = str(int(gpu["count"]))
        node_selector = {k: str(v) for k, v in gpu.get("nodeSelector", {}).items()}
        tolerations = [k8s.V1Toleration(key=t.get("key"), operator=t.get("operator"), value=t.get("value"),
                                        effect=t.get("effect"),
                                        toleration_seconds=t.get("tolerationSeconds"))
                       for t in gpu.get("tolerations", [])]

    storage = config["storage"]
    # The communication calibration is kept once per hardware beside the runs (bench.comm.adopt_calibration).
    env = {**SCRATCH_ENV, "EMBSHARD_STAGE": stage, "EMBSHARD_DATA_ROOT": storage["dataRoot"],
           "EMBSHARD_CALIBRATION_DIR": storage["dataRoot"].rstrip("/") + "/calibration"}
    if config.get("mlflowTrackingUri"):
        env["MLFLOW_TRACKING_URI"] = config["mlflowTrackingUri"]
        # A stage asks a server that does not answer again for 5 minutes (registry.WAIT_ENV; a command, 10 s):
        # an MLflow pod restarting must not fail a stage (a retry would redo the stage's work).
        env[MLFLOW_WAIT_ENV] = str(MLFLOW_WAIT_S)
    if storage["type"] == "bucket" and storage.get("s3Endpoint"):
        # pyarrow's S3 filesystem and boto3 both read AWS_ENDPOINT_URL.
        env["AWS_ENDPOINT_URL"] = storage["s3Endpoint"]
    if spec.get("gpu"):
        # A pod given GPUs that torch cannot see (a node driver older than the image's CUDA needs) would measure
        # the CPU under device=auto: stages.measuring_device refuses that when it knows GPUs were given.
        env[GPUS_GIVEN_ENV] = str(int(gpu["count"]))
    else:
        # The CUDA image sets NVIDIA_VISIBLE_DEVICES=all: where the NVIDIA runtime is the node's default, a pod
        # that requested no GPU would see (and measure on) every GPU of the node.
        env["NVIDIA_VISIBLE_DEVICES"] = "void"
    env.update({k: str(v) for k, v in config.get("env", {}).items()})
    # Lineage for MLflow tags (embshard.run_context), rendered by Airflow: env_vars is a templated field.
    env.update({"EMBSHARD_AIRFLOW_DAG_ID": "{{ dag.dag_id }}", "EMBSHARD_AIRFLOW_RUN_ID": "{{ run_id }}",
                "EMBSHARD_AIRFLOW_TASK_ID": "{{ ti.task_id }}", "EMBSHARD_AIRFLOW_TRY_NUMBER": "{{ ti.try_number }}"})
    env.update(argument_env or {})
    env_vars = [k8s.V1EnvVar(name=k, value=v) for k, v in env.items()]
    env_vars += [k8s.V1EnvVar(name=item["name"], value_from=k8s.V1EnvVarSource(
        secret_key_ref=k8s.V1SecretKeySelector(name=item["secretName"], key=item["key"],
                                               optional=item.get("optional", False))))
        for item in config.get("secretEnv", [])]
    env_from = [k8s.V1EnvFromSource(secret_ref=k8s.V1SecretEnvSource(name=s["name"],
                                                                      optional=s.get("optional", False)))
                for s in config.get("envFromSecrets", [])]

    # The scratch folder is always there (harmless with a writable root, needed with a read-only one).
    volumes = [k8s.V1Volume(name="scratch", empty_dir=k8s.V1EmptyDirVolumeSource())]
    volume_mounts = [k8s.V1VolumeMount(name="scratch", mount_path=SCRATCH)]
    if spec.get("gpu") and int(gpu["count"]) >= 2:
        # NCCL among the pod's GPUs (the all-to-all measured) moves data through /dev/shm, which the container
        # runtime sizes at 64 MiB: too small for NCCL's buffers. Memory-backed, counted in the pod's memory limit.
        volumes.append(k8s.V1Volume(name="dshm", empty_dir=k8s.V1EmptyDirVolumeSource(
            medium="Memory", size_limit=str(gpu.get("shmSize") or "2Gi"))))
        volume_mounts.append(k8s.V1VolumeMount(name="dshm", mount_path="/dev/shm"))
    if storage["type"] == "pvc":
        volumes.append(k8s.V1Volume(name="embshard-data", persistent_volume_claim=(
            k8s.V1PersistentVolumeClaimVolumeSource(claim_name=storage["claimName"]))))
        volume_mounts.append(k8s.V1VolumeMount(name="embshard-data", mount_path=storage["mountPath"]))
    volumes += [_deserialize(k8s.V1Volume, v) for v in config.get("extraVolumes") or []]
    volume_mounts += [_deserialize(k8s.V1VolumeMount, m) for m in config.get("extraVolumeMounts") or []]

    psc = config.get("podSecurityContext") or {}
    csc = config.get("containerSecurityContext") or {}
    labels = {**config.get("labels", {}), "embshard.io/stage": stage.replace("_", "-")}
    return {
        "name": f"embshard-{stage.replace('_', '-')}",
        "image": image,
        "image_pull_policy": config.get("imagePullPolicy", "IfNotPresent"),
        "image_pull_secrets": [k8s.V1LocalObjectReference(name=n) for n in config.get("imagePullSecrets", [])],
        "cmds": ["embshard"],
        "arguments": [str(a) for a in arguments],
        "namespace": config["namespace"],
        "service_account_name": config["serviceAccountName"],
        "labels": labels,
        "annotations": dict(config.get("annotations", {})),
        "container_resources": k8s.V1ResourceRequirements(requests=requests or None, limits=limits or None),
        "node_selector": node_selector,
        "tolerations": tolerations,
        "priority_class_name": priority_class,
        "env_vars": env_vars,
        "env_from": env_from,
        "volumes": volumes,
        "volume_mounts": volume_mounts,
        "security_context": _security(k8s.V1PodSecurityContext, psc),
        "container_security_context": _security(k8s.V1SecurityContext, csc),
        # the XCom sidecar (sample_shards pushes its chunk list) is hardened as the stage container: namespaces
        # that enforce the `restricted` Pod Security standard refuse a pod with a container lacking it
        "xcom_sidecar_container_security_context": _security(k8s.V1SecurityContext, csc),
        # The operator waits up to this long to be scheduled, then as long again to start (image pull).
        "schedule_timeout_seconds": startup_timeout_s(config),
        "startup_timeout_seconds": startup_timeout_s(config),
        "on_finish_action": config.get("onFinishAction", "delete_succeeded_pod"),
        "get_logs": True,
        "log_events_on_failure": True,
        "do_xcom_push": False,
    }


def stage_exit_code(remote_pod, container: str) -> int | None:
    """The exit code of the pod's stage container, None when it did not terminate (evicted, preempted, lost)."""
    statuses = (remote_pod.status.container_statuses if remote_pod is not None and remote_pod.status else None) or []
    status = next((c for c in statuses if c.name == container), None)
    terminated = status.state.terminated if status is not None and status.state is not None else None
    return None if terminated is None else terminated.exit_code


def past_deadline(remote_pod) -> bool:
    """Whether Kubernetes stopped the pod at its activeDeadlineSeconds (the task's own time limit)."""
    status = remote_pod.status if remote_pod is not None else None
    return status is not None and status.reason == "DeadlineExceeded"


def check_run_params(config: dict, params: dict) -> None:
    """The cluster's own rules for a run's params, checked by check_params on the Airflow worker: a measured
    refinement (refine_k) runs in the export_placements pod, which must then measure on the run's device."""
    p = {**{"refine_k": 0, "device": "auto"}, **params}
    stages = config["stages"]
    if int(p["refine_k"]) > 0 and str(p["device"]) != "cpu" and not (stages.get("export_placements") or {}).get("gpu"):
        measured_on_gpu = any((stages.get(s) or {}).get("gpu") for s in MEASURING)
        if measured_on_gpu or str(p["device"]).startswith("cuda"):
            raise EmbshardError(
                f"refine_k {p['refine_k']} measures the exported plans in the export_placements pod, which has no "
                f"GPU: it would measure on the CPU (device auto) or fail at the end of the run (device cuda)",
                field="refine_k",
                fix="set stagePods.stages.export_placements.gpu: true in the chart's values, or give refine_k 0")


def startup_timeout_s(config: dict) -> int:
    """How long a stage pod may wait to be scheduled (a GPU node scaling up from zero), and as long again to
    start (pulling a multi-GB image): the operator's schedule and startup timeouts."""
    return int(config.get("startupTimeoutSeconds", 900))


def startup_allowance_s(config: dict) -> int:
    """The most a stage task waits for its pod before the stage runs: scheduling, then starting."""
    return 2 * startup_timeout_s(config)


def _security(cls, settings: dict):
    """A kubernetes-client security context object from camelCase settings (None when empty)."""
    if not settings:
        return None
    return _deserialize(cls, settings)


def _deserialize(cls, settings: dict):
    """A kubernetes-client model object from its camelCase manifest form."""
    from kubernetes.client import ApiClient

    # The client's own deserializer maps camelCase JSON onto its snake_case models.
    class _Response:
        data = json.dumps(settings)

    return ApiClient().deserialize(_Response(), cls.__name__)
