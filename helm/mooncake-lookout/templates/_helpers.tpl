{{/*
The chart name, overridable by nameOverride. Kubernetes names are limited to 63 characters (DNS labels).
*/}}
{{- define "lookout.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The full name prefix of every object: <release>-<chart> (or the release alone when it already holds the
chart name). Truncated to 56 so that suffixes like "-master" still fit in a 63-character DNS label.
*/}}
{{- define "lookout.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 56 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 56 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 56 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Chart name and version, for the helm.sh/chart label.
*/}}
{{- define "lookout.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Labels of every object. Call with (dict "ctx" $ "component" "engine").
*/}}
{{- define "lookout.labels" -}}
helm.sh/chart: {{ include "lookout.chart" .ctx }}
{{ include "lookout.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: mooncake-lookout
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Selector labels of one component (engine, master, test): stable across upgrades, so never the version.
*/}}
{{- define "lookout.selectorLabels" -}}
app.kubernetes.io/name: {{ include "lookout.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/*
Name of the ServiceAccount the pods run as.
*/}}
{{- define "lookout.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "lookout.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
An image reference; the tag defaults to the chart's appVersion. Call with (dict "image" .Values.engine.image "ctx" $).
*/}}
{{- define "lookout.image" -}}
{{- printf "%s:%s" .image.repository (default .ctx.Chart.AppVersion .image.tag) }}
{{- end }}

{{/*
host:port of the master's RPC endpoint: the chart's master Service, or master.external.address.
*/}}
{{- define "lookout.masterAddress" -}}
{{- if .Values.master.enabled }}
{{- printf "%s-master.%s.svc:%d" (include "lookout.fullname" .) .Release.Namespace (int .Values.master.rpcPort) }}
{{- else }}
{{- required "master.external.address is required when master.enabled is false" .Values.master.external.address }}
{{- end }}
{{- end }}

{{/*
URL of the master's /health for the helm test (empty: the test only connects to the RPC port).
*/}}
{{- define "lookout.masterHealthUrl" -}}
{{- if .Values.master.enabled }}
{{- printf "http://%s-master.%s.svc:%d/health" (include "lookout.fullname" .) .Release.Namespace (int .Values.master.metricsPort) }}
{{- else }}
{{- .Values.master.external.healthUrl }}
{{- end }}
{{- end }}

{{/*
The --kv-transfer-config JSON: our connector, kv_role and kv_connector_extra_config made of the upstream
pass-through keys and every lookup key (the lookup keys win; the schema forbids lookup_* in extraConfig).
*/}}
{{- define "lookout.kvTransferConfig" -}}
{{- $connector := .Values.engine.connector }}
{{- $extra := merge (deepCopy $connector.lookup) (deepCopy $connector.extraConfig) }}
{{- dict "kv_connector" $connector.name "kv_role" $connector.kvRole "kv_connector_extra_config" $extra | toJson }}
{{- end }}

{{/*
The Mooncake store client's configuration (vLLM reads it from MOONCAKE_CONFIG_PATH).
*/}}
{{- define "lookout.mooncakeConfig" -}}
{{- $m := .Values.engine.mooncake }}
{{- dict "metadata_server" $m.metadataServer "master_server_address" (include "lookout.masterAddress" .) "protocol" $m.protocol "device_name" $m.deviceName "global_segment_size" $m.globalSegmentSize "local_buffer_size" $m.localBufferSize | toPrettyJson }}
{{- end }}
