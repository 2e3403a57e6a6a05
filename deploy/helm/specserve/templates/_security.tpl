{{/*
Trust boundaries of the release (deploy/README.md, "Security"): API keys on the
coordinator, a shared internal token and/or mTLS between the coordinator and the
tiers behind it, TLS on every gRPC port, drain deadlines inside the pods'
termination grace. Every Secret is mounted as a directory, never with subPath:
the kubelet then swaps updated files in, and the coordinator reloads its API key
file without a restart.

All tier defines take (dict "root" $ "tier" "<tier>").
*/}}

{{- define "specserve.secretsDir" -}}/etc/specserve{{- end }}

{{- define "specserve.apiKeysSecretName" -}}
{{- default (printf "%s-api-keys" (include "specserve.fullname" .)) .Values.auth.apiKeys.existingSecret }}
{{- end }}

{{- define "specserve.internalTokenSecretName" -}}
{{- default (printf "%s-internal-token" (include "specserve.fullname" .)) .Values.auth.internalToken.existingSecret }}
{{- end }}

{{- define "specserve.metricsTokenSecretName" -}}
{{- default (printf "%s-metrics-token" (include "specserve.fullname" .)) .Values.metrics.auth.existingSecret }}
{{- end }}

{{/* TLS Secret of a tier: its own existingSecret, the shared one, or the one its cert-manager Certificate writes. */}}
{{- define "specserve.tlsSecretName" -}}
{{- $tls := .root.Values.tls }}
{{- $own := (index $tls .tier).existingSecret }}
{{- if $own }}
{{- $own }}
{{- else if $tls.existingSecret }}
{{- $tls.existingSecret }}
{{- else if $tls.certManager.enabled }}
{{- printf "%s-tls" (include "specserve.tierName" .) }}
{{- else }}
{{- fail (printf "tls.enabled needs a certificate for the %s: set tls.%s.existingSecret, tls.existingSecret or tls.certManager.enabled" .tier .tier) }}
{{- end }}
{{- end }}

{{/* Whether cert-manager issues this tier's certificate ("true" or ""). */}}
{{- define "specserve.certManagerIssues" -}}
{{- $tls := .root.Values.tls }}
{{- if and $tls.enabled $tls.certManager.enabled (not (index $tls .tier).existingSecret) (not $tls.existingSecret) }}true{{ end }}
{{- end }}

{{/* A number as a flag value: integers in full (YAML numbers reach templates as floats, which %v prints as 1e+07), others as they are. */}}
{{- define "specserve.flagNumber" -}}
{{- if eq (float64 .) (floor (float64 .)) }}{{ int64 . }}{{ else }}{{ . }}{{ end }}
{{- end }}

{{/* MiB in a Kubernetes memory quantity ("4Gi", "512M", "1073741824"), rounded down. */}}
{{- define "specserve.mebibytes" -}}
{{- $quantity := toString . }}
{{- $number := regexFind "^[0-9]+(\\.[0-9]+)?" $quantity }}
{{- $unit := trimPrefix $number $quantity }}
{{- $factors := dict "" 1.0 "k" 1e3 "Ki" 1024.0 "M" 1e6 "Mi" 1048576.0 "G" 1e9 "Gi" 1073741824.0 "T" 1e12 "Ti" 1099511627776.0 }}
{{- if or (not $number) (not (hasKey $factors $unit)) }}
{{- fail (printf "cannot read the memory quantity %q" $quantity) }}
{{- end }}
{{- divf (mulf (float64 $number) (index $factors $unit)) 1048576.0 | floor | int }}
{{- end }}

{{/*
Seconds a tier drains after SIGTERM (`--shutdown-grace-s`): its own
shutdownGraceSeconds, or what is left of terminationGracePeriodSeconds once the
preStop sleep (which the kubelet counts against the same budget) and a margin
are taken off.
*/}}
{{- define "specserve.shutdownGrace" -}}
{{- $values := index .root.Values .tier }}
{{- $budget := int $values.terminationGracePeriodSeconds }}
{{- $preStop := int $values.preStopSleepSeconds }}
{{- $grace := 0 }}
{{- if kindIs "invalid" $values.shutdownGraceSeconds }}
{{- $grace = sub (sub $budget $preStop) (int .root.Values.shutdownMarginSeconds) }}
{{- else }}
{{- $grace = int $values.shutdownGraceSeconds }}
{{- end }}
{{- if lt $grace 1 }}
{{- fail (printf "%s: terminationGracePeriodSeconds (%d) leaves no drain time after preStopSleepSeconds (%d) and shutdownMarginSeconds (%d)" .tier $budget $preStop (int .root.Values.shutdownMarginSeconds)) }}
{{- end }}
{{- if ge (add $grace $preStop) $budget }}
{{- fail (printf "%s: preStopSleepSeconds (%d) + shutdownGraceSeconds (%d) must stay below terminationGracePeriodSeconds (%d), or the kubelet kills the server mid-drain" .tier $preStop $grace $budget) }}
{{- end }}
{{- $grace }}
{{- end }}

{{/* Arguments every tier gets for its trust boundary and shutdown, one `- --flag` line each. */}}
{{- define "specserve.securityArgs" -}}
{{- $root := .root }}
{{- $tls := $root.Values.tls }}
{{- $dir := include "specserve.secretsDir" . }}
- --shutdown-grace-s={{ include "specserve.shutdownGrace" . }}
{{- if $root.Values.insecure }}
- --insecure
{{- end }}
{{- if $root.Values.auth.internalToken.enabled }}
- --internal-token-file={{ $dir }}/internal-token/{{ $root.Values.auth.internalToken.existingSecretKey }}
{{- end }}
{{- if and (eq .tier "coordinator") $root.Values.auth.apiKeys.enabled }}
- --api-keys-file={{ $dir }}/api-keys/{{ $root.Values.auth.apiKeys.existingSecretKey }}
{{- end }}
{{- if and (eq .tier "coordinator") $root.Values.metrics.auth.enabled }}
- --metrics-token-file={{ $dir }}/metrics-token/{{ $root.Values.metrics.auth.existingSecretKey }}
{{- end }}
{{- if $tls.enabled }}
- --tls-cert={{ $dir }}/tls/tls.crt
- --tls-key={{ $dir }}/tls/tls.key
{{- if eq .tier "coordinator" }}
{{- if $tls.coordinator.requireClientCert }}
- --tls-client-ca={{ $dir }}/tls/ca.crt
{{- end }}
- --internal-tls-ca={{ $dir }}/tls/ca.crt
{{- if $tls.internalMTLS }}
- --internal-tls-cert={{ $dir }}/tls/tls.crt
- --internal-tls-key={{ $dir }}/tls/tls.key
{{- end }}
{{- else if $tls.internalMTLS }}
- --tls-client-ca={{ $dir }}/tls/ca.crt
{{- end }}
{{- end }}
{{- end }}

{{/* Secret files readable by the pod's group (fsGroup owns them), or by everyone in a pod without fsGroup. */}}
{{- define "specserve.secretFileMode" -}}
{{- ternary "0440" "0444" (hasKey .Values.podSecurityContext "fsGroup") }}
{{- end }}

{{- define "specserve.securityVolumes" -}}
{{- $root := .root }}
{{- if $root.Values.auth.internalToken.enabled }}
- name: internal-token
  secret:
    secretName: {{ include "specserve.internalTokenSecretName" $root }}
    defaultMode: {{ include "specserve.secretFileMode" $root }}
{{- end }}
{{- if and (eq .tier "coordinator") $root.Values.auth.apiKeys.enabled }}
- name: api-keys
  secret:
    secretName: {{ include "specserve.apiKeysSecretName" $root }}
    defaultMode: {{ include "specserve.secretFileMode" $root }}
{{- end }}
{{- if and (eq .tier "coordinator") $root.Values.metrics.auth.enabled }}
- name: metrics-token
  secret:
    secretName: {{ include "specserve.metricsTokenSecretName" $root }}
    defaultMode: {{ include "specserve.secretFileMode" $root }}
{{- end }}
{{- if $root.Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "specserve.tlsSecretName" . }}
    defaultMode: {{ include "specserve.secretFileMode" $root }}
{{- end }}
{{- end }}

{{- define "specserve.securityMounts" -}}
{{- $root := .root }}
{{- $dir := include "specserve.secretsDir" . }}
{{- if $root.Values.auth.internalToken.enabled }}
- name: internal-token
  mountPath: {{ $dir }}/internal-token
  readOnly: true
{{- end }}
{{- if and (eq .tier "coordinator") $root.Values.auth.apiKeys.enabled }}
- name: api-keys
  mountPath: {{ $dir }}/api-keys
  readOnly: true
{{- end }}
{{- if and (eq .tier "coordinator") $root.Values.metrics.auth.enabled }}
- name: metrics-token
  mountPath: {{ $dir }}/metrics-token
  readOnly: true
{{- end }}
{{- if $root.Values.tls.enabled }}
- name: tls
  mountPath: {{ $dir }}/tls
  readOnly: true
{{- end }}
{{- end }}

{{/*
Probe handler of a tier: the kubelet's native gRPC probe in plaintext; with TLS
an exec probe (specserve/health_probe.py), since the native one cannot do TLS.
It dials the pod itself, verifies the certificate against the Service's DNS
name and presents the pod's own certificate for mTLS listeners.
*/}}
{{- define "specserve.probeHandler" -}}
{{- $values := index .root.Values .tier }}
{{- if .root.Values.tls.enabled }}
{{- $dir := include "specserve.secretsDir" . }}
exec:
  command:
    - python
    - -m
    - specserve.health_probe
    - --port={{ $values.port }}
    - --tls-ca={{ $dir }}/tls/ca.crt
    - --tls-cert={{ $dir }}/tls/tls.crt
    - --tls-key={{ $dir }}/tls/tls.key
    - --server-name={{ include "specserve.serviceHost" . }}
{{- else }}
grpc:
  port: {{ $values.port }}
{{- end }}
{{- end }}
