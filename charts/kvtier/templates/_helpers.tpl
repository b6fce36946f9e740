{{/* Chart name, truncated to the 63 characters a label value allows. */}}
{{- define "kvtier.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: the release name, plus the chart name unless the release name already contains it. */}}
{{- define "kvtier.fullname" -}}
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

{{- define "kvtier.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvtier.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "kvtier.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "kvtier.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvtier
{{- end }}

{{- define "kvtier.peeringName" -}}
{{- default (include "kvtier.fullname" .) .Values.peering.name }}
{{- end }}

{{- define "kvtier.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvtier.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* repository@digest when a digest is set, else repository:tag (tag defaults to appVersion). */}}
{{- define "kvtier.imageRef" -}}
{{- $image := index . 0 }}
{{- $root := index . 1 }}
{{- if $image.digest }}
{{- printf "%s@%s" $image.repository $image.digest }}
{{- else }}
{{- printf "%s:%s" $image.repository (default $root.Chart.AppVersion $image.tag) }}
{{- end }}
{{- end }}

{{/*
Rules on namespaced resources: a ClusterRole's when the operator watches the whole cluster, a Role's in each
watched namespace otherwise. Each rule names only what the operator does with the resource.
*/}}
{{- define "kvtier.namespacedRules" -}}
# Policies: read and watch them, add and remove the operator's finalizer, write status.
- apiGroups: ["kvtier.io"]
  resources: ["kvcachepolicies"]
  verbs: ["get", "list", "watch", "patch", "update"]
- apiGroups: ["kvtier.io"]
  resources: ["kvcachepolicies/status"]
  verbs: ["get", "patch", "update"]
- apiGroups: ["kvtier.io"]
  resources: ["kvcachepolicies/finalizers"]
  verbs: ["update"]
# Target workloads: server-side apply of the injected volumes, mounts, env and annotations (a patch); never
# create or delete.
- apiGroups: ["apps"]
  resources: ["deployments", "statefulsets"]
  verbs: ["get", "list", "watch", "patch"]
# The rendered engine configuration lives in a ConfigMap the operator owns: server-side apply creates and
# updates it (create, patch), deleting the policy removes it. It is read by name (get) only to check who owns it
# before writing or deleting: one of the same name held by anyone else is never adopted. It is never listed.
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "create", "patch", "delete"]
# Events on policies: kopf posts core/v1 Events, one POST each.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end }}
