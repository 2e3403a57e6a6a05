{{/*
The coordinator, drafter and verifier run the same kind of pod: one Python
server with a gRPC port (standard health service, probed natively or, with TLS,
by an exec probe), its Secrets (_security.tpl), a metrics
port, a writable /tmp on a read-only root filesystem, and a model volume. These
defines build those pieces; the per-tier templates add each tier's arguments.

All defines take (dict "root" $ "tier" "<tier>" ...); `values` below is
.Values.<tier>.
*/}}

{{/* Environment every server needs: caches on the /tmp emptyDir, no hub access at run time. */}}
{{- define "specserve.baseEnv" -}}
- name: HOME
  value: /tmp
- name: TMPDIR
  value: /tmp
- name: XDG_CACHE_HOME
  value: /tmp/.cache
- name: HF_HOME
  value: /tmp/hf
- name: TRANSFORMERS_CACHE
  value: /tmp/hf/transformers
# A .gguf model is converted once per pod into this cache (see scratchSizeLimit).
- name: SPECSERVE_CACHE_DIR
  value: /tmp/specserve
- name: PYTHONUNBUFFERED
  value: "1"
{{- end }}

{{/* SPECSERVE_MODEL, checked against the model source. */}}
{{- define "specserve.modelEnv" -}}
{{- $model := (index .root.Values .tier).model }}
{{- if ne $model.source "package" }}
{{- $_ := required (printf "%s.model.path is required when %s.model.source is %s" .tier .tier $model.source) $model.path }}
{{- end }}
{{- with $model.path }}
- name: SPECSERVE_MODEL
  value: {{ . | quote }}
{{- end }}
{{- end }}

{{- define "specserve.modelVolume" -}}
{{- $model := (index .root.Values .tier).model }}
{{- if eq $model.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ required (printf "%s.model.pvc.claimName is required when %s.model.source is pvc" .tier .tier) $model.pvc.claimName }}
    readOnly: true
{{- else if eq $model.source "initContainer" }}
- name: model
  emptyDir:
    sizeLimit: {{ $model.initContainer.sizeLimit }}
{{- end }}
{{- end }}

{{- define "specserve.modelMount" -}}
{{- $model := (index .root.Values .tier).model }}
{{- if ne $model.source "package" }}
- name: model
  mountPath: {{ $model.mountPath }}
  readOnly: true
  {{- if and (eq $model.source "pvc") $model.pvc.subPath }}
  subPath: {{ $model.pvc.subPath }}
  {{- end }}
{{- end }}
{{- end }}

{{/* Init container that writes the model into the emptyDir before the server starts. */}}
{{- define "specserve.modelInitContainer" -}}
{{- $root := .root }}
{{- $model := (index $root.Values .tier).model }}
{{- if eq $model.source "initContainer" }}
{{- $init := $model.initContainer }}
- name: fetch-model
  image: {{ default (include "specserve.image" .) $init.image }}
  imagePullPolicy: {{ $root.Values.image.pullPolicy }}
  command: {{- required (printf "%s.model.initContainer.command is required when %s.model.source is initContainer" .tier .tier) $init.command | toYaml | nindent 4 }}
  {{- with $init.args }}
  args: {{- toYaml . | nindent 4 }}
  {{- end }}
  env:
    {{- include "specserve.baseEnv" . | nindent 4 }}
    - name: SPECSERVE_MODEL_DIR
      value: {{ $model.mountPath | quote }}
    {{- with $init.env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $init.resources }}
  resources: {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext: {{- toYaml $root.Values.securityContext | nindent 4 }}
  volumeMounts:
    - name: scratch
      mountPath: /tmp
    - name: model
      mountPath: {{ $model.mountPath }}
{{- end }}
{{- end }}

{{/* The tier's --device: its `device` value, else cuda with gpu.enabled and cpu without (validate.yaml checks the pair). */}}
{{- define "specserve.device" -}}
{{- $values := index .root.Values .tier }}
{{- default (ternary "cuda" "cpu" $values.gpu.enabled) $values.device }}
{{- end }}

{{/* Container resources, plus the GPU extended resource (requests = limits) when the tier has gpu.enabled. */}}
{{- define "specserve.resources" -}}
{{- $values := index .root.Values .tier }}
{{- $resources := deepCopy (default dict $values.resources) }}
{{- if and (hasKey $values "gpu") $values.gpu.enabled }}
{{- $gpu := dict $values.gpu.resourceName (int $values.gpu.count) }}
{{- $_ := set $resources "requests" (merge (deepCopy $gpu) (default dict $resources.requests)) }}
{{- $_ := set $resources "limits" (merge (deepCopy $gpu) (default dict $resources.limits)) }}
{{- end }}
{{- toYaml $resources }}
{{- end }}

{{/*
Deployment of one tier. Extra keys:
  args    - tier-specific arguments (after --host/--port/--metrics-port); the
            image's entrypoint (deploy/docker/Dockerfile) names the server
            module, so the chart passes arguments only
  env     - rendered YAML list of tier-specific EnvVars (may be empty)
  serviceAccountName
  automountToken - mount the ServiceAccount's API token (the coordinator with kubernetes discovery)
  ports   - extra container ports, a list of {name, port} (the coordinator's HTTP API)
  volumes, volumeMounts - rendered YAML lists of tier-specific Volumes and the
            server container's VolumeMounts (the drafter's draft model; may be empty)
*/}}
{{- define "specserve.deployment" -}}
{{- $root := .root }}
{{- $values := index $root.Values .tier }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "specserve.tierName" . }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "specserve.tierLabels" . | nindent 4 }}
spec:
  {{- if not $values.autoscaling.enabled }}
  replicas: {{ $values.replicaCount }}
  {{- end }}
  revisionHistoryLimit: 5
  strategy:
    {{- toYaml $values.strategy | nindent 4 }}
  selector:
    matchLabels:
      {{- include "specserve.tierSelectorLabels" . | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "specserve.tierSelectorLabels" . | nindent 8 }}
        {{- with $values.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      annotations:
        kubectl.kubernetes.io/default-container: {{ .tier }}
        {{- with .podAnnotations }}
        {{- . | trim | nindent 8 }}
        {{- end }}
        {{- with $values.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      serviceAccountName: {{ .serviceAccountName }}
      {{- if .automountToken }}
      # The coordinator watches EndpointSlices (coordinator.discovery: kubernetes); its Role allows nothing else.
      automountServiceAccountToken: true
      {{- else }}
      # This pod does not talk to the Kubernetes API.
      automountServiceAccountToken: false
      {{- end }}
      # Service links would inject SPECSERVE_*_PORT style variables into the
      # specserve-* pods and could shadow the servers' own SPECSERVE_* settings.
      enableServiceLinks: false
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $values.priorityClassName }}
      priorityClassName: {{ . }}
      {{- end }}
      {{- with $values.runtimeClassName }}
      runtimeClassName: {{ . }}
      {{- end }}
      securityContext:
        {{- toYaml $root.Values.podSecurityContext | nindent 8 }}
      terminationGracePeriodSeconds: {{ $values.terminationGracePeriodSeconds }}
      {{- with include "specserve.modelInitContainer" . }}
      initContainers:
        {{- . | trim | nindent 8 }}
      {{- end }}
      containers:
        - name: {{ .tier }}
          image: {{ include "specserve.image" . }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          args:
            - --host=0.0.0.0
            - --port={{ $values.port }}
            - --metrics-port={{ $root.Values.metrics.port }}
            {{- include "specserve.securityArgs" . | trim | nindent 12 }}
            {{- range .args }}
            - {{ . | quote }}
            {{- end }}
            {{- range $values.extraArgs }}
            - {{ . | quote }}
            {{- end }}
          ports:
            - name: grpc
              containerPort: {{ $values.port }}
              protocol: TCP
            - name: metrics
              containerPort: {{ $root.Values.metrics.port }}
              protocol: TCP
            {{- range .ports }}
            - name: {{ .name }}
              containerPort: {{ .port }}
              protocol: TCP
            {{- end }}
          env:
            - name: POD_NAME
              valueFrom:
                fieldRef:
                  fieldPath: metadata.name
            - name: POD_NAMESPACE
              valueFrom:
                fieldRef:
                  fieldPath: metadata.namespace
            {{- include "specserve.baseEnv" . | nindent 12 }}
            - name: HF_HUB_OFFLINE
              value: "1"
            {{- with include "specserve.modelEnv" . }}
            {{- . | trim | nindent 12 }}
            {{- end }}
            {{- with .env }}
            {{- . | trim | nindent 12 }}
            {{- end }}
            {{- with $values.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          # Probes ask the grpc.health.v1 service (natively, or with an exec
          # probe once the port speaks TLS): NOT_SERVING until the model (or
          # tokenizer) is loaded, so the startup probe covers the load.
          startupProbe:
            {{- include "specserve.probeHandler" . | trim | nindent 12 }}
            {{- toYaml $values.probes.startup | nindent 12 }}
          readinessProbe:
            {{- include "specserve.probeHandler" . | trim | nindent 12 }}
            {{- toYaml $values.probes.readiness | nindent 12 }}
          livenessProbe:
            {{- include "specserve.probeHandler" . | trim | nindent 12 }}
            {{- toYaml $values.probes.liveness | nindent 12 }}
          {{- if $values.preStopSleepSeconds }}
          lifecycle:
            preStop:
              sleep:
                seconds: {{ $values.preStopSleepSeconds }}
          {{- end }}
          resources:
            {{- include "specserve.resources" . | nindent 12 }}
          securityContext:
            {{- toYaml $root.Values.securityContext | nindent 12 }}
          volumeMounts:
            - name: scratch
              mountPath: /tmp
            {{- with include "specserve.modelMount" . }}
            {{- . | trim | nindent 12 }}
            {{- end }}
            {{- with .volumeMounts }}
            {{- . | trim | nindent 12 }}
            {{- end }}
            {{- with include "specserve.securityMounts" . }}
            {{- . | trim | nindent 12 }}
            {{- end }}
      volumes:
        - name: scratch
          emptyDir:
            sizeLimit: {{ $root.Values.scratchSizeLimit }}
        {{- with include "specserve.modelVolume" . }}
        {{- . | trim | nindent 8 }}
        {{- end }}
        {{- with .volumes }}
        {{- . | trim | nindent 8 }}
        {{- end }}
        {{- with include "specserve.securityVolumes" . }}
        {{- . | trim | nindent 8 }}
        {{- end }}
      {{- with $values.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $values.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $values.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $values.topologySpreadConstraints }}
      topologySpreadConstraints:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end }}

{{/*
Service of one tier. Extra key `headless`: drafter and verifier Services are
headless so the coordinator's gRPC DNS resolver sees every pod and balances
per call (round_robin); a ClusterIP would pin each long-lived HTTP/2 connection
to a single pod. Extra key `ports`: more {name, port, appProtocol} ports (the
coordinator's HTTP API), each aimed at the container port of the same name.
*/}}
{{- define "specserve.service" -}}
{{- $root := .root }}
{{- $values := index $root.Values .tier }}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "specserve.tierName" . }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "specserve.tierLabels" . | nindent 4 }}
  {{- with .annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  {{- if .headless }}
  clusterIP: None
  {{- else }}
  type: {{ .type | default "ClusterIP" }}
  {{- end }}
  selector:
    {{- include "specserve.tierSelectorLabels" . | nindent 4 }}
  ports:
    - name: grpc
      port: {{ $values.port }}
      targetPort: grpc
      protocol: TCP
      # HTTP/2 in the clear, or over TLS once tls.enabled.
      appProtocol: {{ ternary "https" "kubernetes.io/h2c" $root.Values.tls.enabled }}
    - name: metrics
      port: {{ $root.Values.metrics.port }}
      targetPort: metrics
      protocol: TCP
      appProtocol: http
    {{- range .ports }}
    - name: {{ .name }}
      port: {{ .port }}
      targetPort: {{ .name }}
      protocol: TCP
      appProtocol: {{ .appProtocol }}
    {{- end }}
{{- end }}

{{/* CPU-utilisation HorizontalPodAutoscaler of one tier (coordinator, drafter). */}}
{{- define "specserve.cpuAutoscaler" -}}
{{- $values := index .root.Values .tier }}
{{- if $values.autoscaling.enabled }}
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ include "specserve.tierName" . }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "specserve.tierLabels" . | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ include "specserve.tierName" . }}
  minReplicas: {{ $values.autoscaling.minReplicas }}
  maxReplicas: {{ $values.autoscaling.maxReplicas }}
  metrics:
    - type: Resource
      resource:
        name: cpu
        target:
          type: Utilization
          averageUtilization: {{ $values.autoscaling.targetCPUUtilizationPercentage }}
  {{- with $values.autoscaling.behavior }}
  behavior:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
{{- end }}

{{- define "specserve.podDisruptionBudget" -}}
{{- $values := index .root.Values .tier }}
{{- if $values.podDisruptionBudget.enabled }}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "specserve.tierName" . }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "specserve.tierLabels" . | nindent 4 }}
spec:
  maxUnavailable: {{ $values.podDisruptionBudget.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "specserve.tierSelectorLabels" . | nindent 6 }}
{{- end }}
{{- end }}
