{{/* Chart name, truncated to the 63 characters of a DNS label. */}}
{{- define "embshard.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified app name; a release named like the chart is not repeated ("embshard", not "embshard-embshard"). */}}
{{- define "embshard.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "embshard.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "embshard.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Selector labels of one component: include with (dict "ctx" $ "component" "mlflow"). */}}
{{- define "embshard.selectorLabels" -}}
app.kubernetes.io/name: {{ include "embshard.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* A chart pod's template labels: its selector labels and commonLabels (cost-allocation labels must reach the
  pods, which use the resources). Include with (dict "ctx" $ "component" "mlflow"). */}}
{{- define "embshard.podLabels" -}}
{{ include "embshard.selectorLabels" . }}
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Where a chart pod may run and how it pulls its image: the release's imagePullSecrets and the component's
  nodeSelector, tolerations and affinity (a private registry or mirror, tainted or dedicated nodes). Include in a
  pod spec with (dict "ctx" $ "values" .Values.mlflow). */}}
{{- define "embshard.podScheduling" -}}
{{- with .ctx.Values.imagePullSecrets }}
imagePullSecrets:
{{- range . }}
  - name: {{ . }}
{{- end }}
{{- end }}
{{- with .values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* The longest object name the release renders fits Kubernetes' 63 characters, else a render error (a 62-character
  release had rendered and linted a 69-character Service name, which the API server refuses). Included by the
  templates that are always rendered. */}}
{{- define "embshard.checkNames" -}}
{{- $suffixes := list "-stage-pods" }}
{{- if .Values.rbac.create }}{{- $suffixes = append $suffixes "-pod-launcher" }}{{- end }}
{{- if .Values.mlflow.enabled }}{{- $suffixes = append $suffixes "-mlflow" }}{{- end }}
{{- if .Values.postgres.enabled }}{{- $suffixes = append $suffixes "-postgres" }}{{- end }}
{{- if .Values.minio.enabled }}{{- $suffixes = append $suffixes "-minio-buckets" }}{{- end }}
{{- $full := include "embshard.fullname" . }}
{{- $longest := "" }}
{{- range $suffixes }}{{- if gt (len .) (len $longest) }}{{- $longest = . }}{{- end }}{{- end }}
{{- if gt (len (printf "%s%s" $full $longest)) 63 }}
{{- fail (printf "the object name %s%s is %d characters, more than Kubernetes' 63: give a shorter release name or fullnameOverride (at most %d characters with these values)" $full $longest (len (printf "%s%s" $full $longest)) (sub 63 (len $longest))) }}
{{- end }}
{{- end }}

{{- define "embshard.mlflowName" -}}{{ include "embshard.fullname" . }}-mlflow{{- end }}
{{- define "embshard.postgresName" -}}{{ include "embshard.fullname" . }}-postgres{{- end }}
{{- define "embshard.minioName" -}}{{ include "embshard.fullname" . }}-minio{{- end }}

{{/* In-cluster URLs. */}}
{{- define "embshard.mlflowUri" -}}
{{- printf "http://%s.%s.svc.%s:%d" (include "embshard.mlflowName" .) .Release.Namespace .Values.clusterDomain (int .Values.mlflow.port) }}
{{- end }}
{{- define "embshard.minioEndpoint" -}}
{{- printf "http://%s.%s.svc.%s:9000" (include "embshard.minioName" .) .Release.Namespace .Values.clusterDomain }}
{{- end }}

{{/* The stage-pod settings the DAG reads: stagePods plus the release namespace and the MLflow URI. */}}
{{- define "embshard.stagePodConfig" -}}
{{- $cfg := deepCopy .Values.stagePods }}
{{- $_ := set $cfg "namespace" .Release.Namespace }}
{{- /* as k8s.py refuses it, here at `helm upgrade` (a DAG import error stopped every run, and the password sat in
  the ConfigMap) */}}
{{- if regexMatch "^[A-Za-z][A-Za-z0-9+.-]*://[^/?#]*@" (toString $cfg.mlflowTrackingUri) }}
{{- fail "stagePods.mlflowTrackingUri carries credentials (user:password@host): give the URI without them; MLflow reads MLFLOW_TRACKING_USERNAME/PASSWORD or MLFLOW_TRACKING_TOKEN from a Secret (stagePods.secretEnv)" }}
{{- end }}
{{- if not $cfg.mlflowTrackingUri }}
{{- if not .Values.mlflow.enabled }}
{{- fail "mlflow.enabled=false needs stagePods.mlflowTrackingUri (the external MLflow server the stages use)" }}
{{- end }}
{{- $_ := set $cfg "mlflowTrackingUri" (include "embshard.mlflowUri" .) }}
{{- end }}
{{- /* A volume the stages cannot use fails here, at `helm upgrade`, not as an import error of the whole DAG
  (components/embshard/k8s.py holds the same rules). */}}
{{- if eq $cfg.storage.type "pvc" }}
{{- $mount := printf "/%s" (trimAll "/" (toString $cfg.storage.mountPath)) }}
{{- $root := printf "/%s" (trimAll "/" (trimPrefix "file://" (toString $cfg.storage.dataRoot))) }}
{{- if eq $mount "/" }}
{{- fail "stagePods.storage.mountPath: a pvc storage needs a mount path below /, e.g. /data" }}
{{- end }}
{{- if eq $mount "/tmp" }}
{{- fail "stagePods.storage.mountPath: /tmp is the stage pods' scratch folder (an emptyDir); mount the data volume elsewhere, e.g. /data" }}
{{- end }}
{{- if not (or (eq $root $mount) (hasPrefix (printf "%s/" $mount) $root)) }}
{{- fail (printf "stagePods.storage.dataRoot %s is not on the volume mounted at %s: put it under the mount, e.g. file://%s/embshard" $cfg.storage.dataRoot $cfg.storage.mountPath $mount) }}
{{- end }}
{{- end }}
{{- /* extraVolumes / extraVolumeMounts, as k8s.py checks them: names apart from the pods' own, every mount of a
  volume given, no path the pods use or two mounts at one. */}}
{{- $names := list }}
{{- range $cfg.extraVolumes }}
{{- if has .name (list "scratch" "embshard-data" "dshm") }}
{{- fail (printf "stagePods.extraVolumes: volume name %s is taken (scratch, embshard-data and dshm are the stage pods' own)" .name) }}
{{- end }}
{{- if has .name $names }}
{{- fail (printf "stagePods.extraVolumes: volume name %s is given twice" .name) }}
{{- end }}
{{- $names = append $names .name }}
{{- end }}
{{- $taken := list "/" "/tmp" "/dev/shm" }}
{{- if eq $cfg.storage.type "pvc" }}
{{- $taken = append $taken (printf "/%s" (trimAll "/" (toString $cfg.storage.mountPath))) }}
{{- end }}
{{- range $cfg.extraVolumeMounts }}
{{- $path := printf "/%s" (trimAll "/" (toString .mountPath)) }}
{{- if not (has .name $names) }}
{{- fail (printf "stagePods.extraVolumeMounts: mount %s names no volume of stagePods.extraVolumes" .name) }}
{{- end }}
{{- if has $path $taken }}
{{- fail (printf "stagePods.extraVolumeMounts: mount path %s is taken (the stage pods' own, or another mount's)" .mountPath) }}
{{- end }}
{{- $taken = append $taken $path }}
{{- end }}
{{- /* Bucket storage on the bundled MinIO: its endpoint, as mlflow.s3Endpoint defaults to it. */}}
{{- if and (eq $cfg.storage.type "bucket") (not $cfg.storage.s3Endpoint) .Values.minio.enabled }}
{{- $_ := set $cfg.storage "s3Endpoint" (include "embshard.minioEndpoint" .) }}
{{- end }}
{{- toYaml $cfg }}
{{- end }}

{{/* The stages' data bucket on the bundled MinIO (bucket storage, no other endpoint), "" otherwise: the bucket
  job makes secrets.stageCredentials a user of it, and the NOTES say so. */}}
{{- define "embshard.stageBucket" -}}
{{- $storage := .Values.stagePods.storage }}
{{- if and .Values.minio.enabled (eq $storage.type "bucket") (or (not $storage.s3Endpoint) (eq $storage.s3Endpoint (include "embshard.minioEndpoint" .))) }}
{{- regexReplaceAll "^s3://([^/]+).*$" (toString $storage.dataRoot) "${1}" }}
{{- end }}
{{- end }}

{{/* Restricted pod security for the bundled services. */}}
{{- define "embshard.containerSecurity" -}}
allowPrivilegeEscalation: false
capabilities:
  drop: [ALL]
{{- end }}
