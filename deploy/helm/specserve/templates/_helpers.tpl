{{/*
Names, labels and small value helpers shared by every template.
Tier templates call them with a dict: (dict "root" $ "tier" "drafter").
*/}}

{{- define "specserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-wide name prefix, at most 63 - len("-coordinator") characters so tier names stay valid DNS labels. */}}
{{- define "specserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 51 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 51 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 51 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Name of one tier's objects: <fullname>-<tier>. */}}
{{- define "specserve.tierName" -}}
{{- printf "%s-%s" (include "specserve.fullname" .root) .tier }}
{{- end }}

{{- define "specserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels that never change for the life of a release (safe in selectors). */}}
{{- define "specserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "specserve.labels" -}}
helm.sh/chart: {{ include "specserve.chart" . }}
{{ include "specserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: specserve
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "specserve.tierSelectorLabels" -}}
{{ include "specserve.selectorLabels" .root }}
app.kubernetes.io/component: {{ .tier }}
{{- end }}

{{- define "specserve.tierLabels" -}}
{{ include "specserve.labels" .root }}
app.kubernetes.io/component: {{ .tier }}
{{- end }}

{{- define "specserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "specserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
Image reference of a tier: <registry>/<repository>@<digest>, or :<tag> where the
tag defaults to image.tag, then appVersion, plus "-cuda" for GPU tiers.
*/}}
{{- define "specserve.image" -}}
{{- $values := index .root.Values .tier }}
{{- $repository := printf "%s/%s" (trimSuffix "/" .root.Values.image.registry) $values.image.repository }}
{{- if $values.image.digest }}
{{- printf "%s@%s" $repository $values.image.digest }}
{{- else if $values.image.tag }}
{{- printf "%s:%s" $repository $values.image.tag }}
{{- else }}
{{- $tag := default .root.Chart.AppVersion .root.Values.image.tag }}
{{- $gpu := and (hasKey $values "gpu") $values.gpu.enabled }}
{{- printf "%s:%s%s" $repository $tag (ternary "-cuda" "" $gpu) }}
{{- end }}
{{- end }}

{{- define "specserve.redisImage" -}}
{{- $image := .Values.redis.image }}
{{- if $image.digest }}
{{- printf "%s@%s" $image.repository $image.digest }}
{{- else }}
{{- printf "%s:%s" $image.repository $image.tag }}
{{- end }}
{{- end }}

{{- define "specserve.redisSecretName" -}}
{{- default (printf "%s-redis" (include "specserve.fullname" .)) .Values.redis.auth.existingSecret }}
{{- end }}

{{/* DNS name of a tier's Service inside the cluster. */}}
{{- define "specserve.serviceHost" -}}
{{- printf "%s.%s.svc.%s" (include "specserve.tierName" .) .root.Release.Namespace .root.Values.clusterDomain }}
{{- end }}

{{/*
Environment giving a tier the Redis URL (SPECSERVE_REDIS_URL). For the in-chart
Redis the password is read from the Secret and spliced in with $(VAR) expansion,
so it never appears in the pod spec.
*/}}
{{- define "specserve.redisEnv" -}}
{{- $redis := .Values.redis }}
{{- if eq $redis.mode "internal" }}
- name: SPECSERVE_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "specserve.redisSecretName" . }}
      key: {{ $redis.auth.existingSecretPasswordKey }}
- name: SPECSERVE_REDIS_URL
  value: {{ printf "redis://:$(SPECSERVE_REDIS_PASSWORD)@%s:%d/%d" (include "specserve.serviceHost" (dict "root" . "tier" "redis")) (int $redis.port) (int $redis.database) | quote }}
{{- else if eq $redis.mode "external" }}
- name: SPECSERVE_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ required "redis.external.existingSecret is required when redis.mode is external" $redis.external.existingSecret }}
      key: {{ $redis.external.existingSecretKey }}
{{- end }}
{{- end }}

{{/* Whether the coordinator watches the other tiers through the Kubernetes API (coordinator.discovery). */}}
{{- define "specserve.kubernetesDiscovery" -}}
{{- if eq .Values.coordinator.discovery "kubernetes" }}true{{ end }}
{{- end }}

{{/*
ServiceAccount of the coordinator: its own (<fullname>-coordinator) with kubernetes discovery, so that the
Role reading EndpointSlices is bound to it alone; the shared one otherwise.
*/}}
{{- define "specserve.coordinatorServiceAccountName" -}}
{{- if and (include "specserve.kubernetesDiscovery" .) .Values.serviceAccount.create }}
{{- printf "%s-coordinator" (include "specserve.fullname" .) }}
{{- else }}
{{- include "specserve.serviceAccountName" . }}
{{- end }}
{{- end }}
