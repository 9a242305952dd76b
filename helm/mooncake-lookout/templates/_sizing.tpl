{{/*
Bytes of a Kubernetes quantity (a number, or a number with Ki Mi Gi Ti Pi, k M G T P or m), as a decimal string.
Call with (dict "value" "32Gi" "key" "engine.resources.limits.memory").
*/}}
{{- define "lookout.quantityBytes" -}}
{{- $v := toString .value }}
{{- if not (regexMatch "^[0-9]+(\\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P|m)?$" $v) }}
{{- fail (printf "%s: %q is not a memory quantity this chart reads (a number with Ki, Mi, Gi, Ti, Pi, k, M, G, T, P or none)" .key $v) }}
{{- end }}
{{- $units := dict "" 1.0 "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "Pi" 1125899906842624.0 "k" 1000.0 "M" 1000000.0 "G" 1000000000.0 "T" 1000000000000.0 "P" 1000000000000000.0 "m" 0.001 }}
{{- $number := regexReplaceAll "[A-Za-z]+$" $v "" }}
{{- $unit := trimPrefix $number $v }}
{{- printf "%.0f" (mulf (float64 $number) (index $units $unit)) }}
{{- end }}

{{/*
Bytes of a Mooncake size (global_segment_size, local_buffer_size): a number with GB, MB, KB or B in either case,
binary multiples, as vLLM's mooncake.json loader and mooncake_client read it. Call with (dict "value" "4GB").
*/}}
{{- define "lookout.mooncakeBytes" -}}
{{- $v := lower (replace " " "" (toString .value)) }}
{{- $units := dict "" 1.0 "b" 1.0 "kb" 1024.0 "mb" 1048576.0 "gb" 1073741824.0 }}
{{- $number := regexReplaceAll "[a-z]+$" $v "" }}
{{- printf "%.0f" (mulf (float64 $number) (index $units (trimPrefix $number $v))) }}
{{- end }}

{{/*
GiB of a byte count, with one decimal, for messages.
*/}}
{{- define "lookout.gib" -}}
{{- printf "%.1f GiB" (divf (float64 .) 1073741824.0) }}
{{- end }}

{{/*
The vLLM ranks in one engine pod: tensor x pipeline x data parallel. In embedded mode each rank's worker opens a
Mooncake store client of its own, with its own segment and local buffer.
*/}}
{{- define "lookout.engineRanks" -}}
{{- $e := .Values.engine }}
{{- mul (int $e.tensorParallelSize) (int $e.pipelineParallelSize) (int $e.dataParallelSize) }}
{{- end }}

{{/*
Fails unless the engine's memory limit holds what the pod takes beyond the model on the GPUs: per rank a Mooncake
segment (embedded mode) and local buffer, the memory-backed /dev/shm, and engine.memoryHeadroom for vLLM itself. A
pod without a memory limit is not checked. Also checks the GPU limit against the ranks, and that the parallel sizes
are values, not engine.extraArgs (the check could not see them there).
*/}}
{{- define "lookout.checkEngineSizing" -}}
{{- $e := .Values.engine }}
{{- range $arg := $e.extraArgs }}
{{- range $flag, $key := dict "--tensor-parallel-size" "tensorParallelSize" "-tp" "tensorParallelSize" "--pipeline-parallel-size" "pipelineParallelSize" "-pp" "pipelineParallelSize" "--data-parallel-size" "dataParallelSize" "-dp" "dataParallelSize" }}
{{- if or (eq $arg $flag) (hasPrefix (printf "%s=" $flag) $arg) }}
{{- fail (printf "engine.extraArgs sets %s: set engine.%s instead (the chart sizes the engine's memory and GPUs by it)" $flag $key) }}
{{- end }}
{{- end }}
{{- end }}
{{- $ranks := include "lookout.engineRanks" . | int }}
{{- $limits := default dict $e.resources.limits }}
{{- with index $limits "nvidia.com/gpu" }}
{{- if lt (int .) $ranks }}
{{- fail (printf "engine.resources.limits.nvidia.com/gpu %v is fewer than the engine's %d ranks (engine.tensorParallelSize x pipelineParallelSize x dataParallelSize): vLLM needs a GPU per rank" . $ranks) }}
{{- end }}
{{- end }}
{{- with $limits.memory }}
{{- $m := $e.mooncake }}
{{- $limit := include "lookout.quantityBytes" (dict "value" . "key" "engine.resources.limits.memory") | float64 }}
{{- $segment := ternary 0.0 (include "lookout.mooncakeBytes" (dict "value" $m.globalSegmentSize) | float64) (eq $m.mode "standalone-store") }}
{{- $buffer := include "lookout.mooncakeBytes" (dict "value" $m.localBufferSize) | float64 }}
{{- $store := mulf (float64 $ranks) (addf $segment $buffer) }}
{{- $shm := ternary (include "lookout.quantityBytes" (dict "value" $e.shm.sizeLimit "key" "engine.shm.sizeLimit") | float64) 0.0 $e.shm.enabled }}
{{- $headroom := include "lookout.quantityBytes" (dict "value" $e.memoryHeadroom "key" "engine.memoryHeadroom") | float64 }}
{{- $need := addf $store $shm $headroom }}
{{- if gt $need $limit }}
{{- $segmentText := ternary "0 (standalone-store)" (printf "engine.mooncake.globalSegmentSize %s" $m.globalSegmentSize) (eq $m.mode "standalone-store") }}
{{- fail (printf "engine.resources.limits.memory %v (%s) cannot hold what the engine pod takes: %d rank(s), each a store client (engine.tensorParallelSize %v x pipelineParallelSize %v x dataParallelSize %v) x (%s + engine.mooncake.localBufferSize %s) = %s, plus /dev/shm %s (engine.shm.sizeLimit, memory-backed) and engine.memoryHeadroom %s for vLLM itself: %s. Raise engine.resources.limits.memory to at least that, or lower those sizes (engine.mooncake.mode standalone-store lends no segment)" . (include "lookout.gib" $limit) $ranks $e.tensorParallelSize $e.pipelineParallelSize $e.dataParallelSize $segmentText $m.localBufferSize (include "lookout.gib" $store) (ternary $e.shm.sizeLimit "0 (off)" $e.shm.enabled) $e.memoryHeadroom (include "lookout.gib" $need)) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Fails unless a store pod's memory limit holds its segment, its local buffer and store.memoryHeadroom.
*/}}
{{- define "lookout.checkStoreSizing" -}}
{{- $s := .Values.store }}
{{- with (default dict $s.resources.limits).memory }}
{{- $limit := include "lookout.quantityBytes" (dict "value" . "key" "store.resources.limits.memory") | float64 }}
{{- $segment := include "lookout.mooncakeBytes" (dict "value" $s.globalSegmentSize) | float64 }}
{{- $buffer := include "lookout.mooncakeBytes" (dict "value" $s.localBufferSize) | float64 }}
{{- $headroom := include "lookout.quantityBytes" (dict "value" $s.memoryHeadroom "key" "store.memoryHeadroom") | float64 }}
{{- $need := addf $segment $buffer $headroom }}
{{- if gt $need $limit }}
{{- fail (printf "store.resources.limits.memory %v (%s) cannot hold a store pod: store.globalSegmentSize %s + store.localBufferSize %s + store.memoryHeadroom %s = %s. Raise the limit to at least that, or lend less (store.globalSegmentSize)" . (include "lookout.gib" $limit) $s.globalSegmentSize $s.localBufferSize $s.memoryHeadroom (include "lookout.gib" $need)) }}
{{- end }}
{{- end }}
{{- end }}
