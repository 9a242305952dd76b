{{/*
True (non-empty) when a component's pods use RDMA. Call with (dict "ctx" $ "component" "engine"|"store").
*/}}
{{- define "lookout.rdmaOn" -}}
{{- $protocol := ternary .ctx.Values.engine.mooncake.protocol .ctx.Values.store.protocol (eq .component "engine") }}
{{- if eq $protocol "rdma" }}true{{ end }}
{{- end }}

{{/*
A container's securityContext: the component's own, plus for RDMA pods IPC_LOCK (rdma.ipcLock) and privileged
(rdma.privileged, which Kubernetes refuses beside allowPrivilegeEscalation false, so that one goes).
Call with (dict "ctx" $ "component" "engine" "securityContext" .Values.engine.securityContext).
*/}}
{{- define "lookout.securityContext" -}}
{{- $sc := deepCopy (default dict .securityContext) }}
{{- if include "lookout.rdmaOn" . }}
{{- $rdma := .ctx.Values.rdma }}
{{- if $rdma.ipcLock }}
{{- $caps := default dict $sc.capabilities }}
{{- $_ := set $caps "add" (append (default list $caps.add) "IPC_LOCK" | uniq) }}
{{- $_ := set $sc "capabilities" $caps }}
{{- end }}
{{- if $rdma.privileged }}
{{- $_ := set $sc "privileged" true }}
{{- $_ := unset $sc "allowPrivilegeEscalation" }}
{{- end }}
{{- end }}
{{- with $sc }}{{ toYaml . }}{{ end }}
{{- end }}

{{/*
A container's resources: the component's own, plus for RDMA pods rdma.resourceCount of rdma.resourceName in both
requests and limits (an extended resource must be equal in both). Call like lookout.securityContext, with
"resources".
*/}}
{{- define "lookout.resources" -}}
{{- $res := deepCopy (default dict .resources) }}
{{- $rdma := .ctx.Values.rdma }}
{{- if and (include "lookout.rdmaOn" .) $rdma.resourceName }}
{{- range $part := list "requests" "limits" }}
{{- $_ := set $res $part (merge (dict $rdma.resourceName $rdma.resourceCount) (default dict (index $res $part))) }}
{{- end }}
{{- end }}
{{- with $res }}{{ toYaml . }}{{ end }}
{{- end }}

{{/*
Pod-level fields of RDMA pods on the host network (rdma.hostNetwork). Call with (dict "ctx" $ "component" "store").
*/}}
{{- define "lookout.rdmaPod" -}}
{{- if and (include "lookout.rdmaOn" .) .ctx.Values.rdma.hostNetwork }}
# RDMA on the node's network: the pod keeps cluster DNS.
hostNetwork: true
dnsPolicy: ClusterFirstWithHostNet
{{- end }}
{{- end }}
