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
The master address every store client of this release takes (mooncake.json's master_server_address): the
chart's master Service (host:port); with HA on etcd, etcd://<endpoints> (clients find the leader there); with
HA on the k8s backend, the Service that selects the leader pod; or master.external.address.
*/}}
{{- define "lookout.masterAddress" -}}
{{- $m := .Values.master }}
{{- if not $m.enabled }}
{{- required "master.external.address is required when master.enabled is false" $m.external.address }}
{{- else if include "lookout.haEtcd" . }}
{{- printf "etcd://%s" (include "lookout.etcdEndpoints" .) }}
{{- else if $m.ha.enabled }}
{{- printf "%s-master-leader.%s.svc:%d" (include "lookout.fullname" .) .Release.Namespace (int $m.rpcPort) }}
{{- else }}
{{- printf "%s-master.%s.svc:%d" (include "lookout.fullname" .) .Release.Namespace (int $m.rpcPort) }}
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
With engine.connector.curve.secretName, the lookup_curve_* keys point at the mounted key files. A tcp://
lookup_server_address beyond loopback without CURVE fails here, as the worker would at start-up.
*/}}
{{- define "lookout.kvTransferConfig" -}}
{{- $connector := .Values.engine.connector }}
{{- $extra := merge (deepCopy $connector.lookup) (deepCopy $connector.extraConfig) }}
{{- $curve := $connector.curve }}
{{- if $curve.secretName }}
{{- range $key := list "lookup_curve_server_public_key" "lookup_curve_client_secret_key" "lookup_curve_server_secret_key" "lookup_curve_allowed_clients" }}
{{- if index $extra $key }}{{ fail (printf "engine.connector.lookup.%s: leave it empty when engine.connector.curve.secretName mounts the keys" $key) }}{{ end }}
{{- end }}
{{- $_ := set $extra "lookup_curve_server_public_key" (printf "%s/server.key" $curve.mountPath) }}
{{- $_ := set $extra "lookup_curve_client_secret_key" (printf "%s/client.key_secret" $curve.mountPath) }}
{{- $_ := set $extra "lookup_curve_server_secret_key" (printf "%s/server.key_secret" $curve.mountPath) }}
{{- $_ := set $extra "lookup_curve_allowed_clients" (printf "%s/allowed" $curve.mountPath) }}
{{- end }}
{{- $address := $extra.lookup_server_address }}
{{- if hasPrefix "tcp://" $address }}
{{- $host := regexReplaceAll ":[^:]*$" (trimPrefix "tcp://" $address) "" }}
{{- if not (or (hasPrefix "127." $host) (has $host (list "localhost" "[::1]" "::1" "lo")) $extra.lookup_curve_server_secret_key) }}
{{- fail (printf "engine.connector.lookup.lookup_server_address %s listens beyond loopback without CURVE: anyone who reaches it could flood the store with lookups and probe what is cached; set engine.connector.curve.secretName (docs/security.md)" $address) }}
{{- end }}
{{- end }}
{{- with include "lookout.answerTtlLowered" . }}
{{- $_ := set $extra "lookup_answer_ttl_ms" (int64 .) }}
{{- end }}
{{- dict "kv_connector" $connector.name "kv_role" $connector.kvRole "kv_connector_extra_config" $extra | toJson }}
{{- end }}

{{/*
The Mooncake store client's configuration (vLLM reads it from MOONCAKE_CONFIG_PATH). In standalone-store mode the
ranks lend no segment (vLLM refuses any other size there).
*/}}
{{- define "lookout.mooncakeConfig" -}}
{{- $m := .Values.engine.mooncake }}
{{- $segment := ternary 0 $m.globalSegmentSize (eq $m.mode "standalone-store") }}
{{- dict "mode" $m.mode "metadata_server" $m.metadataServer "master_server_address" (include "lookout.masterAddress" .) "protocol" $m.protocol "device_name" $m.deviceName "global_segment_size" $segment "local_buffer_size" $m.localBufferSize | toPrettyJson }}
{{- end }}

{{/*
The store's name in the HA backend: the masters' --cluster_id and every store client's MC_STORE_CLUSTER_ID.
*/}}
{{- define "lookout.clusterId" -}}
{{- default (printf "%s-%s" .Release.Namespace (include "lookout.fullname" .)) .Values.master.ha.clusterId }}
{{- end }}

{{/*
True (non-empty) when the chart runs HA masters with the etcd backend.
*/}}
{{- define "lookout.haEtcd" -}}
{{- if and .Values.master.enabled .Values.master.ha.enabled (eq .Values.master.ha.backend "etcd") }}true{{ end }}
{{- end }}

{{/*
True (non-empty) when the chart runs its own etcd for the masters.
*/}}
{{- define "lookout.etcdDeployed" -}}
{{- if and (include "lookout.haEtcd" .) .Values.master.ha.etcd.deploy }}true{{ end }}
{{- end }}

{{/*
The etcd endpoints of the HA masters, host:port joined by ";" (Mooncake's separator).
*/}}
{{- define "lookout.etcdEndpoints" -}}
{{- $etcd := .Values.master.ha.etcd }}
{{- if $etcd.deploy }}
{{- printf "%s-etcd.%s.svc:%d" (include "lookout.fullname" .) .Release.Namespace (int $etcd.clientPort) }}
{{- else }}
{{- if not $etcd.endpoints }}{{ fail "master.ha.etcd.endpoints is required when master.ha.etcd.deploy is false" }}{{ end }}
{{- join ";" $etcd.endpoints }}
{{- end }}
{{- end }}

{{/*
Name of the Lease the masters contend for with the k8s backend.
*/}}
{{- define "lookout.leaseName" -}}
{{- default (printf "%s-master" (include "lookout.fullname" .)) .Values.master.ha.k8s.leaseName }}
{{- end }}

{{/*
A held answer must stay younger than half the master's key lease (a found key is leased that long from the lookup
that found it). Above it, an engine.connector.lookup.lookup_answer_ttl_ms the user set fails the render, naming
both values; the chart's own default is lowered to half the lease, and this prints the value it takes (NOTES says
so); empty when nothing changes.
*/}}
{{- define "lookout.answerTtlLowered" -}}
{{- $ttl := .Values.engine.connector.lookup.lookup_answer_ttl_ms }}
{{- $lease := include "lookout.masterLeaseMs" . | int64 }}
{{- $half := div $lease 2 }}
{{- if lt (float64 $half) (float64 $ttl) }}
{{- $default := (.Files.Get "files/chart-defaults.yaml" | fromYaml).engine.connector.lookup.lookup_answer_ttl_ms }}
{{- if ne (float64 $ttl) (float64 $default) }}
{{- fail (printf "engine.connector.lookup.lookup_answer_ttl_ms %v is more than half the master's key lease (master.defaultKvLeaseTtl %v = %d ms): a held answer must be asked again before the lease that keeps its key from eviction runs out. Set lookup_answer_ttl_ms to at most %d, or lengthen master.defaultKvLeaseTtl to at least %.0f ms" $ttl .Values.master.defaultKvLeaseTtl $lease $half (mulf 2.0 (float64 $ttl))) }}
{{- end }}
{{- $half }}
{{- end }}
{{- end }}

{{/*
The masters' lease of a key (--default_kv_lease_ttl) in milliseconds: raw milliseconds or a number with
ms, s, m or h, as mooncake_master reads it. The lookup path must re-ask an answer older than this.
*/}}
{{- define "lookout.masterLeaseMs" -}}
{{- $v := toString .Values.master.defaultKvLeaseTtl }}
{{- if hasSuffix "ms" $v }}{{ trimSuffix "ms" $v | int64 }}
{{- else if hasSuffix "s" $v }}{{ mul (trimSuffix "s" $v | int64) 1000 }}
{{- else if hasSuffix "m" $v }}{{ mul (trimSuffix "m" $v | int64) 60000 }}
{{- else if hasSuffix "h" $v }}{{ mul (trimSuffix "h" $v | int64) 3600000 }}
{{- else }}{{ $v | int64 }}{{ end }}
{{- end }}

{{/*
Deployment strategy of the masters: master.strategy, else Recreate for one master (two would split the index)
and one at a time for HA masters.
*/}}
{{- define "lookout.masterStrategy" -}}
{{- if .Values.master.strategy }}
{{- toYaml .Values.master.strategy }}
{{- else if .Values.master.ha.enabled }}
type: RollingUpdate
rollingUpdate:
  maxSurge: 0
  maxUnavailable: 1
{{- else }}
type: Recreate
{{- end }}
{{- end }}

{{/*
topologySpreadConstraints with the component's own pod labels as labelSelector where none is given.
Call with (dict "ctx" $ "component" "engine" "constraints" $e.topologySpreadConstraints).
*/}}
{{- define "lookout.spread" -}}
{{- $selector := include "lookout.selectorLabels" (dict "ctx" .ctx "component" .component) | fromYaml }}
{{- $out := list }}
{{- range .constraints }}
{{- $c := deepCopy . }}
{{- if not (hasKey $c "labelSelector") }}
{{- $_ := set $c "labelSelector" (dict "matchLabels" $selector) }}
{{- end }}
{{- $out = append $out $c }}
{{- end }}
{{- toYaml $out }}
{{- end }}

{{/*
Environment every store client of this release needs (engines and store pods): the HA store's name (with an
external HA master: master.ha.clusterId when set).
*/}}
{{- define "lookout.storeClientEnv" -}}
{{- $m := .Values.master }}
{{- if or (and $m.enabled $m.ha.enabled) (and (not $m.enabled) $m.ha.clusterId) }}
- name: MC_STORE_CLUSTER_ID
  value: {{ include "lookout.clusterId" . | quote }}
{{- end }}
# Mooncake's transfer-engine ports (it listens on all interfaces): the range the NetworkPolicy admits.
- name: MC_MIN_RPC_PORT
  value: {{ .Values.transferPorts.min | quote }}
- name: MC_MAX_RPC_PORT
  value: {{ .Values.transferPorts.max | quote }}
{{- end }}

{{/*
NetworkPolicy peers of this release's store clients: its engine pods, its store pods (when deployed) and
networkPolicy.extraClients.
*/}}
{{- define "lookout.storeClientPeers" -}}
- podSelector:
    matchLabels:
      {{- include "lookout.selectorLabels" (dict "ctx" . "component" "engine") | nindent 6 }}
{{- if .Values.store.enabled }}
- podSelector:
    matchLabels:
      {{- include "lookout.selectorLabels" (dict "ctx" . "component" "store") | nindent 6 }}
{{- end }}
{{- with .Values.networkPolicy.extraClients }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
The NetworkPolicy peer of the Prometheus pods: monitoring.namespace, narrowed by networkPolicy.monitoringPodSelector.
*/}}
{{- define "lookout.prometheusPeer" -}}
- namespaceSelector:
    matchLabels:
      kubernetes.io/metadata.name: {{ .Values.monitoring.namespace }}
  podSelector:
    {{- if .Values.networkPolicy.monitoringPodSelector }}
    {{- toYaml .Values.networkPolicy.monitoringPodSelector | nindent 4 }}
    {{- else }}
    {}
    {{- end }}
{{- end }}

{{/*
The engine's lifecycle hooks: engine.lifecycle, plus a preStop pause of engine.preStopSleepSeconds unless it sets a
preStop of its own. The pause must leave part of the grace period to the shutdown itself.
*/}}
{{- define "lookout.engineLifecycle" -}}
{{- $e := .Values.engine }}
{{- $hooks := deepCopy $e.lifecycle }}
{{- if and $e.preStopSleepSeconds (not (hasKey $hooks "preStop")) }}
{{- if ge (int $e.preStopSleepSeconds) (int $e.terminationGracePeriodSeconds) }}
{{- fail (printf "engine.preStopSleepSeconds %v must be below engine.terminationGracePeriodSeconds %v: the pause counts against the grace period, and the engine needs time after it to finish its requests" $e.preStopSleepSeconds $e.terminationGracePeriodSeconds) }}
{{- end }}
{{- $_ := set $hooks "preStop" (dict "exec" (dict "command" (list "sleep" (toString $e.preStopSleepSeconds)))) }}
{{- end }}
{{- with $hooks }}{{ toYaml . }}{{ end }}
{{- end }}

{{/*
The master image values.yaml names (master.image.repository's default): Mooncake's 0.3.13.post1 PyPI wheels,
built without the k8s lease backend (tests/test_helm_cluster.py checks it is values.yaml's default).
*/}}
{{- define "lookout.defaultMasterRepository" -}}
ghcr.io/mooncake-lookout/master
{{- end }}

{{/*
Fails when engine.extraArgs pick a non-cryptographic block hash (--prefix-caching-hash-algo xxhash or xxhash_cbor)
and nothing sets PYTHONHASHSEED: vLLM then seeds the hashes at random in each process, and no two engines (nor one
engine after a restart) compute the same store keys.
*/}}
{{- define "lookout.checkHashSeed" -}}
{{- $e := .Values.engine }}
{{- $algo := "" }}
{{- range $i, $arg := $e.extraArgs }}
{{- if and (eq $arg "--prefix-caching-hash-algo") (lt (add1 $i) (len $e.extraArgs)) }}
{{- $algo = index $e.extraArgs (add1 $i) }}
{{- else if hasPrefix "--prefix-caching-hash-algo=" $arg }}
{{- $algo = trimPrefix "--prefix-caching-hash-algo=" $arg }}
{{- end }}
{{- end }}
{{- $seeded := $e.hashSeed.secretName }}
{{- range $e.env }}{{ if eq .name "PYTHONHASHSEED" }}{{ $seeded = true }}{{ end }}{{ end }}
{{- if and (hasPrefix "xxhash" $algo) (not $seeded) }}
{{- fail (printf "engine.extraArgs sets --prefix-caching-hash-algo %s, which vLLM seeds with a random value in every process unless PYTHONHASHSEED is set: no two engines would compute the same store keys, and the shared cache would never hit. Set engine.hashSeed.secretName to a Secret holding one secret integer (0 to 4294967295) that every engine sharing the store uses, e.g. kubectl create secret generic lookout-hash-seed --from-literal=seed=$(shuf -i 1-4294967295 -n 1)" $algo) }}
{{- end }}
{{- end }}

{{/*
Seconds the helm test pod keeps retrying: helmTest.timeoutSeconds, or (0) the engine's startup-probe window
(periodSeconds x failureThreshold: as long as the kubelet lets the engine load its model) plus 60 s for the
Service to list the ready pod. The pod runs the engine image, so its clock starts once that image is pulled.
*/}}
{{- define "lookout.helmTestTimeout" -}}
{{- $t := int .Values.helmTest.timeoutSeconds }}
{{- if gt $t 0 }}{{ $t }}
{{- else }}
{{- $s := .Values.engine.probes.startup }}
{{- add (mul (int $s.periodSeconds) (int $s.failureThreshold)) 60 }}
{{- end }}
{{- end }}

{{/*
The --timeout `helm test` needs: the pod's own wait (lookout.helmTestTimeout) plus 10 minutes for pulling the
engine image on a node that has not got it (helm's default, 5m, would give up first).
*/}}
{{- define "lookout.helmTestCommandTimeout" -}}
{{- add (include "lookout.helmTestTimeout" . | int) 600 }}s
{{- end }}

{{/*
"true" when the engines run the lookout connector: engine.connector.name is the chart's default (the name the
plugin registers). Another one (e.g. upstream's MooncakeStoreConnector) exports no lookout metric.
*/}}
{{- define "lookout.connectorIsOurs" -}}
{{- $default := (.Files.Get "files/chart-defaults.yaml" | fromYaml).engine.connector.name }}
{{- if eq .Values.engine.connector.name $default }}true{{ end }}
{{- end }}
