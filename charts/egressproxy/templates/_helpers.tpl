{{/*
Names, labels and images shared by every template. Per-component helpers take the root
context and return that component's name, labels or selector.
*/}}

{{- define "egressproxy.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* `<release>-<chart>` (or fullnameOverride), at most 50 characters: component names
add a suffix and must stay within 63. */}}
{{- define "egressproxy.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "egressproxy.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "egressproxy.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.global.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Image reference: registry/repository, then @digest or :tag (default appVersion). */}}
{{- define "egressproxy.image" -}}
{{- $image := index . 0 -}}
{{- $root := index . 1 -}}
{{- $repository := $image.repository -}}
{{- with $root.Values.global.imageRegistry -}}
{{- $repository = printf "%s/%s" (trimSuffix "/" .) $repository -}}
{{- end -}}
{{- if $image.digest -}}
{{- printf "%s@%s" $repository $image.digest -}}
{{- else -}}
{{- printf "%s:%s" $repository (default $root.Chart.AppVersion $image.tag) -}}
{{- end -}}
{{- end -}}

{{- define "egressproxy.imagePullSecrets" -}}
{{- with .Values.global.imagePullSecrets }}
imagePullSecrets:
{{- range . }}
  - name: {{ . }}
{{- end }}
{{- end }}
{{- end -}}

{{- /* The collector's CA: the volume and the mount (with global.otel.caConfigMap). */ -}}
{{- define "egressproxy.otelCaVolume" -}}
{{- with .Values.global.otel.caConfigMap }}
- name: otel-ca
  configMap:
    name: {{ . }}
    items:
      - key: ca.crt
        path: ca.crt
{{- end }}
{{- end -}}

{{- define "egressproxy.otelCaMount" -}}
{{- if .Values.global.otel.caConfigMap }}
- name: otel-ca
  mountPath: /etc/egressproxy/otel-ca
  readOnly: true
{{- end }}
{{- end -}}

{{- /* Scheduling and security of a pod spec. Args: (list <root> <component values>). */ -}}
{{- define "egressproxy.podSpecExtras" -}}
{{- $root := index . 0 -}}
{{- $values := index . 1 -}}
{{- include "egressproxy.imagePullSecrets" $root }}
{{- with $values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with $values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $values.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* OTEL_* variables for component $name, when an endpoint is set. */}}
{{- define "egressproxy.otelEnv" -}}
{{- $root := index . 0 -}}
{{- $name := index . 1 -}}
{{- with $root.Values.global.otel -}}
{{- if .endpoint }}
- name: OTEL_SERVICE_NAME
  value: {{ $name | quote }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ .endpoint | quote }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: {{ .protocol | quote }}
{{- if .resourceAttributes }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ .resourceAttributes | quote }}
{{- end }}
{{- if .caConfigMap }}
- name: OTEL_EXPORTER_OTLP_CERTIFICATE
  value: /etc/egressproxy/otel-ca/ca.crt
{{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{/* ---- operator ---- */}}

{{- define "egressproxy.operator.fullname" -}}
{{- printf "%s-operator" (include "egressproxy.fullname" .) -}}
{{- end -}}

{{- define "egressproxy.operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "egressproxy.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "egressproxy.operator.labels" -}}
{{ include "egressproxy.labels" . }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "egressproxy.operator.serviceAccountName" -}}
{{- default (include "egressproxy.operator.fullname" .) .Values.operator.serviceAccount.name -}}
{{- end -}}

{{/* ---- kvm-agent ---- */}}

{{- define "egressproxy.kvmAgent.fullname" -}}
{{- printf "%s-kvm-agent" (include "egressproxy.fullname" .) -}}
{{- end -}}

{{- define "egressproxy.kvmAgent.selectorLabels" -}}
app.kubernetes.io/name: {{ include "egressproxy.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: kvm-agent
{{- end -}}

{{- define "egressproxy.kvmAgent.labels" -}}
{{ include "egressproxy.labels" . }}
app.kubernetes.io/component: kvm-agent
{{- end -}}

{{- define "egressproxy.kvmAgent.serviceAccountName" -}}
{{- default (include "egressproxy.kvmAgent.fullname" .) .Values.kvmAgent.serviceAccount.name -}}
{{- end -}}

{{- define "egressproxy.kvmAgent.serverSecretName" -}}
{{- default (printf "%s-tls" (include "egressproxy.kvmAgent.fullname" .)) .Values.kvmAgent.tls.serverSecretName -}}
{{- end -}}

{{- define "egressproxy.kvmAgent.clientSecretName" -}}
{{- default (printf "%s-client-tls" (include "egressproxy.operator.fullname" .)) .Values.kvmAgent.tls.mtls.clientSecretName -}}
{{- end -}}

{{- /*
`kvm-agent probe` against the agent at host $host (list <root> <host>), as YAML list
items: with TLS it verifies the certificate for the Service's name against ca.crt, with
mutual TLS it presents the operator's client certificate (mounted at probe-tls/).
*/ -}}
{{- define "egressproxy.kvmAgent.probeCommand" -}}
{{- $root := index . 0 -}}
{{- $host := index . 1 -}}
{{- $tls := $root.Values.kvmAgent.tls -}}
- /usr/local/bin/kvm-agent
- probe
- --address={{ $host }}:{{ $root.Values.kvmAgent.port }}
{{- if $tls.enabled }}
- --ca=/etc/kvm-agent/tls/ca.crt
- --server-name={{ include "egressproxy.kvmAgent.host" $root }}
{{- if $tls.mtls.enabled }}
- --cert=/etc/kvm-agent/probe-tls/tls.crt
- --key=/etc/kvm-agent/probe-tls/tls.key
{{- end }}
{{- end }}
{{- end -}}

{{/* The in-cluster DNS name of the agent's Service (also in its certificate). */}}
{{- define "egressproxy.kvmAgent.host" -}}
{{- printf "%s.%s.svc" (include "egressproxy.kvmAgent.fullname" .) .Release.Namespace -}}
{{- end -}}

{{/*
The providers the operator is configured with: operator.providers plus, with
kvmAgent.enabled, the in-cluster agent, plus each entry of `providers`. A dict of name -> values entry.
*/}}
{{- define "egressproxy.operator.providerValues" -}}
{{- $providers := deepCopy .Values.operator.providers -}}
{{- if .Values.kvmAgent.enabled -}}
{{- $agent := dict "callTimeout" .Values.kvmAgent.callTimeout -}}
{{- with .Values.kvmAgent.egressCheckUrl -}}
{{- $_ := set $agent "egressCheckUrl" . -}}
{{- end -}}
{{- if .Values.kvmAgent.tls.enabled -}}
{{- $_ := set $agent "endpoint" (printf "https://%s:%v" (include "egressproxy.kvmAgent.host" .) .Values.kvmAgent.port) -}}
{{- $_ := set $agent "tls" (dict "secretName" (include "egressproxy.kvmAgent.serverSecretName" .) "clientCertificate" .Values.kvmAgent.tls.mtls.enabled "clientSecretName" (include "egressproxy.kvmAgent.clientSecretName" .)) -}}
{{- else -}}
{{- $_ := set $agent "endpoint" (printf "http://%s:%v" (include "egressproxy.kvmAgent.host" .) .Values.kvmAgent.port) -}}
{{- end -}}
{{- $_ := set $providers .Values.kvmAgent.providerName $agent -}}
{{- end -}}
{{- range .Values.providers -}}
{{- $entry := include "egressproxy.provider.values" (list $ .) | fromJson -}}
{{- $host := include "egressproxy.provider.host" (list $ $entry) -}}
{{- if $entry.tls.enabled -}}
{{- $fullname := include "egressproxy.provider.fullname" (list $ $entry) -}}
{{- $_ := set $providers $entry.name (dict "endpoint" (printf "https://%s:%v" $host $entry.port) "callTimeout" $entry.callTimeout "tls" (dict "secretName" (printf "%s-tls" $fullname) "clientCertificate" true "clientSecretName" (printf "%s-client-tls" $fullname))) -}}
{{- else -}}
{{- $_ := set $providers $entry.name (dict "endpoint" (printf "http://%s:%v" $host $entry.port) "callTimeout" $entry.callTimeout) -}}
{{- end -}}
{{- end -}}
{{- toJson $providers -}}
{{- end -}}

{{- /*
Refuses egress rules without the NetworkPolicy they belong to, rather than leave the
user believing outgoing traffic is restricted. Args: (list <networkPolicy values>
<values path>).
*/}}
{{- define "egressproxy.networkPolicyCheck" -}}
{{- $policy := index . 0 }}
{{- $path := index . 1 }}
{{- if and $policy.egress.enabled (not $policy.enabled) }}
{{- fail (printf "%s.egress.enabled needs %s.enabled=true: the egress rules are part of that NetworkPolicy" $path $path) }}
{{- end }}
{{- end }}

{{- /*
The egress part of a NetworkPolicy spec. Args: (list <networkPolicy values> <extra
rules>). DNS first, since nothing resolves a name without it.
*/}}
{{- define "egressproxy.networkPolicyEgress" -}}
{{- $policy := index . 0 }}
{{- $extra := index . 1 }}
{{- if $policy.egress.enabled }}
egress:
  {{- if $policy.egress.dns }}
  - ports:
      - port: 53
        protocol: UDP
      - port: 53
        protocol: TCP
  {{- end }}
  {{- with $extra }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
  {{- with $policy.egress.rules }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end }}
{{- end }}

{{/* ---- providers (entries of the `providers` list) ---- */}}

{{- /*
An entry of `providers` with its defaults filled in, as JSON. Args: (list <root> <entry>).
Each top-level key absent from the entry's config takes the default's (as in
deploy/kube-provider/config.yaml); the proxy pods' namespace is the release namespace.
*/ -}}
{{- define "egressproxy.provider.values" -}}
{{- $root := index . 0 -}}
{{- $entry := deepCopy (index . 1) -}}
{{- $image := merge (default dict $entry.image) (dict "repository" "ghcr.io/egressproxy/kube-provider" "tag" "" "digest" "" "pullPolicy" "IfNotPresent") -}}
{{- $proxyImage := printf "ghcr.io/egressproxy/squid-proxy:%s" $root.Chart.AppVersion -}}
{{- with $root.Values.global.imageRegistry -}}
{{- $proxyImage = printf "%s/%s" (trimSuffix "/" .) $proxyImage -}}
{{- end -}}
{{- $defaultConfig := dict
  "zone_label" "topology.kubernetes.io/zone"
  "node_selector" (dict "egressproxy.dev/egress" "true")
  "machine_types" (dict "small" (dict "requests" (dict "cpu" "50m" "memory" "64Mi") "limits" (dict "memory" "128Mi")))
  "images" (dict "squid" (dict "image" $proxyImage "pull_policy" "IfNotPresent" "port_env" "PROXY_PORT")) -}}
{{- $config := deepCopy (default dict $entry.config) -}}
{{- range $key, $value := $defaultConfig -}}
{{- if not (hasKey $config $key) -}}{{- $_ := set $config $key $value -}}{{- end -}}
{{- end -}}
{{- $_ := set $config "namespace" $root.Release.Namespace -}}
{{- $defaults := dict
  "port" 50051
  "callTimeout" "30s"
  "verbosity" 0
  "networkPolicy" true
  "tls" (dict "enabled" true "validityDays" 730 "renewDays" 90)
  "resources" (dict "requests" (dict "cpu" "50m" "memory" "64Mi") "limits" (dict "cpu" "500m" "memory" "256Mi")) -}}
{{- $values := merge $entry $defaults -}}
{{- /* merge takes a false from the user for unset: booleans are copied as written. */ -}}
{{- $raw := index . 1 -}}
{{- if hasKey $raw "networkPolicy" -}}{{- $_ := set $values "networkPolicy" $raw.networkPolicy -}}{{- end -}}
{{- if and $raw.tls (hasKey $raw.tls "enabled") -}}{{- $_ := set $values.tls "enabled" $raw.tls.enabled -}}{{- end -}}
{{- $_ := set $values "image" $image -}}
{{- $_ := set $values "config" $config -}}
{{- toJson $values -}}
{{- end -}}

{{- /* `<fullname>-<name>-provider`. Args: (list <root> <entry>). */ -}}
{{- define "egressproxy.provider.fullname" -}}
{{- printf "%s-%s-provider" (include "egressproxy.fullname" (index . 0)) (index . 1).name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "egressproxy.provider.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "egressproxy.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: provider-{{ (index . 1).name }}
{{- end -}}

{{- define "egressproxy.provider.labels" -}}
{{ include "egressproxy.labels" (index . 0) }}
app.kubernetes.io/component: provider-{{ (index . 1).name }}
{{- end -}}

{{/* The in-cluster DNS name of the provider's Service. Args: (list <root> <entry>). */}}
{{- define "egressproxy.provider.host" -}}
{{- printf "%s.%s.svc" (include "egressproxy.provider.fullname" .) (index . 0).Release.Namespace -}}
{{- end -}}
