{{/*
"true" when the Prometheus Operator kind (ServiceMonitor, PodMonitor or PrometheusRule) is rendered:
monitoring.enabled true, or "auto" and the cluster serves that kind. helm's .Capabilities lists each served kind as
monitoring.coreos.com/v1/<Kind> (with helm template: --api-versions monitoring.coreos.com/v1/<Kind>); a cluster
may serve ServiceMonitor and not PrometheusRule, so each kind is asked for on its own.
Call with (dict "ctx" $ "kind" "PrometheusRule").
*/}}
{{- define "lookout.monitoringOn" -}}
{{- $on := .ctx.Values.monitoring.enabled }}
{{- if eq (toString $on) "auto" }}
{{- if .ctx.Capabilities.APIVersions.Has (printf "monitoring.coreos.com/v1/%s" .kind) }}true{{ end }}
{{- else if $on }}true{{ end }}
{{- end }}

{{/*
Labels of a monitoring object: the release label kube-prometheus-stack selects on (monitoring.release), then the
object's own. Neither is required: a Prometheus that selects every monitor (or by labels of your own) picks them up
as they are, and NOTES says which label a stock kube-prometheus-stack needs ("lookout.unlabelledMonitoring").
Call with (dict "ctx" $ "labels" .labels).
*/}}
{{- define "lookout.monitorLabels" -}}
{{- $release := .ctx.Values.monitoring.release }}
{{- if and $release (ne (toString $release) "false") }}
release: {{ $release | quote }}
{{- end }}
{{- with .labels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
The kinds of the monitoring objects this release renders with no label a stock kube-prometheus-stack selects on
(monitoring.release empty, no labels of their own), comma-separated; empty when there are none.
*/}}
{{- define "lookout.unlabelledMonitoring" -}}
{{- $m := .Values.monitoring }}
{{- $out := list }}
{{- if eq (toString $m.release) "" }}
{{- $objects := list (list "ServiceMonitor" $m.serviceMonitor true) (list $m.masterMonitor.kind $m.masterMonitor .Values.master.enabled) (list "PodMonitor" $m.storeMonitor .Values.store.enabled) (list "PrometheusRule" $m.prometheusRule true) }}
{{- range $objects }}
{{- $kind := index . 0 }}
{{- $cfg := index . 1 }}
{{- if and (index . 2) $cfg.enabled (not $cfg.labels) (include "lookout.monitoringOn" (dict "ctx" $ "kind" $kind)) }}
{{- $out = append $out $kind }}
{{- end }}
{{- end }}
{{- end }}
{{- join ", " (uniq $out) }}
{{- end }}

{{/*
The job label of one component's targets: <fullname>-<component>. Every component and every release gets a job of
its own, whatever the Operator's default would be (a Service's name, or <namespace>/<monitor>): the alerts group
by job, and MooncakeLookupMetricsAbsent reads a job that once had lookup metrics and now has a target without
them as an engine that lost its plugin, so a master in the engines' job would raise it for ever.
*/}}
{{- define "lookout.job" -}}
{{- printf "%s-%s" (include "lookout.fullname" .ctx) .component }}
{{- end }}

{{/*
A ServiceMonitor or PodMonitor of one component's metrics port (/metrics), in the release's namespace, with the
component's job label. Call with (dict "ctx" $ "component" "engine" "kind" "ServiceMonitor" "port" "http"
"cfg" .Values.monitoring.serviceMonitor).
*/}}
{{- define "lookout.monitor" -}}
{{- $ctx := .ctx }}
{{- $name := include "lookout.job" . }}
apiVersion: monitoring.coreos.com/v1
kind: {{ .kind }}
metadata:
  name: {{ $name }}
  namespace: {{ $ctx.Release.Namespace }}
  labels:
    {{- include "lookout.labels" (dict "ctx" $ctx "component" .component) | nindent 4 }}
    {{- include "lookout.monitorLabels" (dict "ctx" $ctx "labels" .cfg.labels) | trim | nindent 4 }}
spec:
  {{- with .cfg.scrapeProtocols }}
  scrapeProtocols:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  namespaceSelector:
    matchNames:
      - {{ $ctx.Release.Namespace }}
  selector:
    matchLabels:
      {{- include "lookout.selectorLabels" (dict "ctx" $ctx "component" .component) | nindent 6 }}
  {{ ternary "podMetricsEndpoints" "endpoints" (eq .kind "PodMonitor") }}:
    - port: {{ .port }}
      path: /metrics
      interval: {{ .cfg.interval }}
      scrapeTimeout: {{ .cfg.scrapeTimeout }}
      # After the Operator's own job rule, so this one wins.
      relabelings:
        - action: replace
          targetLabel: job
          replacement: {{ $name }}
{{- end }}

{{/*
NOTES' line for one monitoring object: on (with its job), or why it is off. Call with
(dict "ctx" $ "kind" "ServiceMonitor" "enabled" .Values.monitoring.serviceMonitor.enabled "job" "engine").
*/}}
{{- define "lookout.monitorState" -}}
{{- $m := .ctx.Values.monitoring }}
{{- if not .enabled }}off (switched off)
{{- else if include "lookout.monitoringOn" . }}on{{ with .job }}, job {{ include "lookout.job" (dict "ctx" $.ctx "component" .) }}{{ end }}
{{- else if eq (toString $m.enabled) "auto" }}off: the cluster does not serve monitoring.coreos.com/v1/{{ .kind }}
{{- else }}off (monitoring.enabled=false)
{{- end }}
{{- end }}
