{{/* Common names and labels. Names are fixed per release so the webhook's own
registration (in the code) and the chart agree on them. */}}

{{- define "gpudra.name" -}}gpudra{{- end -}}

{{- define "gpudra.fullname" -}}
{{- if contains "gpudra" .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-gpudra" .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "gpudra.labels" -}}
app.kubernetes.io/name: gpudra
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- with .Values.commonLabels }}
{{ include "gpudra.stringMap" . | trim }}
{{- end }}
{{- end -}}

{{- define "gpudra.selectorLabels" -}}
app.kubernetes.io/name: gpudra
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "gpudra.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "gpudra.node.fullname" -}}{{ include "gpudra.fullname" . }}-node{{- end -}}
{{- define "gpudra.webhook.fullname" -}}{{ include "gpudra.fullname" . }}-webhook{{- end -}}
{{- define "gpudra.node.serviceAccount" -}}{{ include "gpudra.node.fullname" . }}{{- end -}}
{{- define "gpudra.webhook.serviceAccount" -}}{{ include "gpudra.webhook.fullname" . }}{{- end -}}
{{/* The Service the API server calls; the webhook's --service flag names the same. */}}
{{- define "gpudra.webhook.service" -}}{{ include "gpudra.webhook.fullname" . }}{{- end -}}

{{/* Webhook TLS: the Secret the pods mount for sources 'helm' and 'secret'. */}}
{{- define "gpudra.webhook.tlsSecret" -}}
{{- if eq .Values.webhook.tls.source "secret" -}}
{{- .Values.webhook.tls.secretName -}}
{{- else -}}
{{- include "gpudra.webhook.fullname" . }}-tls
{{- end -}}
{{- end -}}

{{/* The legacy-pod matchCondition; the same CEL as gpudra.webhook.registration.GPU_POD_CEL
(tests/chart compares them). With an extended resource name mapped to a DeviceClass,
that resource is left to the scheduler, but its pods are still sent for the tenant rules. */}}
{{- define "gpudra.webhook.gpuPodCel" -}}
{{- $cel := include "gpudra.webhook.baseGpuPodCel" . -}}
{{- with .Values.deviceClasses.gpu.extendedResourceName -}}
{{- $cel = replace "k.startsWith('nvidia.com/')" (printf "(k.startsWith('nvidia.com/') && k != '%s')" .) $cel -}}
{{- $limit := printf "has(c.resources) && has(c.resources.limits) && c.resources.limits.exists(k, k in ['%s'])" . -}}
{{- $cel = printf "%s || object.spec.containers.exists(c, %s) || (has(object.spec.initContainers) && object.spec.initContainers.exists(c, %s))" $cel $limit $limit -}}
{{- end -}}
{{- $cel -}}
{{- end -}}

{{- define "gpudra.webhook.baseGpuPodCel" -}}
object.spec.containers.exists(c, has(c.resources) && ((has(c.resources.limits) && c.resources.limits.exists(k, k.startsWith('nvidia.com/'))) || (has(c.resources.requests) && c.resources.requests.exists(k, k.startsWith('nvidia.com/'))))) || (has(object.spec.initContainers) && object.spec.initContainers.exists(c, has(c.resources) && has(c.resources.limits) && c.resources.limits.exists(k, k.startsWith('nvidia.com/')))) || has(object.spec.resourceClaims) || object.spec.containers.exists(c, has(c.resources) && ((has(c.resources.limits) && c.resources.limits.exists(k, k.startsWith('deviceclass.resource.kubernetes.io/'))) || (has(c.resources.requests) && c.resources.requests.exists(k, k.startsWith('deviceclass.resource.kubernetes.io/'))))) || (has(object.spec.initContainers) && object.spec.initContainers.exists(c, has(c.resources) && ((has(c.resources.limits) && c.resources.limits.exists(k, k.startsWith('deviceclass.resource.kubernetes.io/'))) || (has(c.resources.requests) && c.resources.requests.exists(k, k.startsWith('deviceclass.resource.kubernetes.io/'))))))
{{- end -}}

{{/* CEL: the object's devices (a CEL path) request one of the classes or carry an opaque
config for the driver; the same text as gpudra.webhook.registration.claim_cel. */}}
{{- define "gpudra.webhook.claimCel" -}}
{{- $d := index . 0 -}}
{{- $quoted := list -}}
{{- range (index . 1) }}{{ $quoted = append $quoted (printf "'%s'" .) }}{{ end -}}
{{- $classes := printf "[%s]" (join ", " $quoted) -}}
{{- $drivers := printf "['%s']" (index . 2) -}}
{{- printf "has(%[1]s) && ((has(%[1]s.requests) && %[1]s.requests.exists(r, (has(r.exactly) && r.exactly.deviceClassName in %[2]s) || (has(r.firstAvailable) && r.firstAvailable.exists(s, s.deviceClassName in %[2]s)))) || (has(%[1]s.config) && %[1]s.config.exists(c, has(c.opaque) && c.opaque.driver in %[3]s)))" $d $classes $drivers -}}
{{- end -}}

{{/* "true" when the string is a DNS name (RFC 1123), an IPv4 address or an IPv6 address
without brackets: what KUBERNETES_SERVICE_HOST may hold (the client adds the brackets). */}}
{{- define "gpudra.isHost" -}}
{{- $h4 := `[0-9A-Fa-f]{1,4}` -}}
{{- $v4 := `((25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])` -}}
{{- $v6 := list
  (printf `(%[1]s:){7}%[1]s` $h4)
  (printf `(%[1]s:){1,7}:` $h4)
  (printf `(%[1]s:){1,6}:%[1]s` $h4)
  (printf `(%[1]s:){1,5}(:%[1]s){1,2}` $h4)
  (printf `(%[1]s:){1,4}(:%[1]s){1,3}` $h4)
  (printf `(%[1]s:){1,3}(:%[1]s){1,4}` $h4)
  (printf `(%[1]s:){1,2}(:%[1]s){1,5}` $h4)
  (printf `%[1]s:(:%[1]s){1,6}` $h4)
  (printf `:((:%[1]s){1,7}|:)` $h4)
  (printf `(%[1]s:){6}%[2]s` $h4 $v4)
  (printf `::(%[1]s:){0,5}%[2]s` $h4 $v4)
  (printf `(%[1]s:){1}:(%[1]s:){0,4}%[2]s` $h4 $v4)
  (printf `(%[1]s:){2}:(%[1]s:){0,3}%[2]s` $h4 $v4)
  (printf `(%[1]s:){3}:(%[1]s:){0,2}%[2]s` $h4 $v4)
  (printf `(%[1]s:){4}:(%[1]s:){0,1}%[2]s` $h4 $v4)
  (printf `(%[1]s:){5}:%[2]s` $h4 $v4)
-}}
{{- $label := `[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?` -}}
{{- $dns := printf `^%[1]s(\.%[1]s)*$` $label -}}
{{- if or (regexMatch (printf `^%s$` $v4) .) (regexMatch (printf `^(%s)$` (join "|" $v6)) .) -}}
true
{{- else if and (le (len .) 253) (regexMatch $dns .) (not (regexMatch `^[0-9.]+$` .)) -}}
true
{{- end -}}
{{- end -}}

{{/* The API server's address for the in-cluster client, when kubernetesApi.host is set:
explicit env wins over the kubelet's service variables. */}}
{{- define "gpudra.kubernetesApiEnv" -}}
{{- with .Values.kubernetesApi.host -}}
- name: KUBERNETES_SERVICE_HOST
  value: {{ . | quote }}
- name: KUBERNETES_SERVICE_PORT
  value: {{ $.Values.kubernetesApi.port | toString | quote }}
{{- end -}}
{{- end -}}

{{- /* Label or annotation values, quoted: `--set k=true` gives a boolean or a number, and
Kubernetes takes only strings there. The schema lets all three through for that. */ -}}
{{- define "gpudra.stringMap" -}}
{{- range $k, $v := . }}
{{ $k | quote }}: {{ toString $v | quote }}
{{- end }}
{{- end -}}

{{- /* The DeviceClass of one MIG profile, as gpudra.api.deviceclasses.mig_profile_class
names it (tests/chart renders every suffix): the suffix becomes a token after a dash,
`1g.10gb+me` -> mig-1g.10gb-me.nvidia.com, `1g.10gb-me` -> mig-1g.10gb-nome.nvidia.com. */ -}}
{{- define "gpudra.migProfileClass" -}}
{{- $p := . -}}
{{- if hasSuffix "-me" $p }}{{ $p = printf "%s-nome" (trimSuffix "-me" $p) }}{{ end -}}
{{- $p = $p | replace "+me.all" "-meall" | replace "+me" "-me" | replace "+gfx" "-gfx" -}}
{{- printf "mig-%s.nvidia.com" $p -}}
{{- end -}}

{{/* With webhook.tls.source=self, the caBundles (by webhook name, JSON) that the chart
renders unchanged from the live configuration. Under `self` the chart leaves caBundle to
the webhook, but when the release moves to `self` from a source whose bundle Helm set
(tls.source helm, or secret with tls.caBundle), leaving it out would make Helm take that
bundle out at once, and the API server would trust no webhook pod until the new one has
written its own CA: every GPU pod and claim refused meanwhile. Kept, the new pod finds
the old CA in place and keeps it beside its own while the old pods stop (a CA without a
lease, kept for the rollout window).

- Helm 4 applies server-side: rendering a field claims it, and applying it after the
  webhook changed it would conflict. So a bundle is kept only while the webhook's own
  field manager (gpudra.webhook.cabundle.FIELD_MANAGER) owns no caBundle there; the new
  pod's write makes that manager the field's only owner, and the next upgrade leaves
  caBundle out again. (An entry of that manager without a caBundle says nothing: a
  forced apply of the chart's bundle takes the caBundle out of it and leaves the
  webhooks' names.)
- Helm 3 merges client-side, against the manifest of the release before: a field that
  release rendered and this one leaves out is deleted, whoever wrote it since. So every
  live bundle is kept, each upgrade rendering what is there; the patch then changes
  nothing.

Where `lookup` sees no cluster (helm template) nothing is kept.
Argument: (list <root context> <kind> <name>). */}}
{{- define "gpudra.webhook.heldCABundles" -}}
{{- $helm3 := semverCompare "<4.0.0-0" (index . 0).Capabilities.HelmVersion.Version -}}
{{- $live := lookup "admissionregistration.k8s.io/v1" (index . 1) "" (index . 2) | default dict -}}
{{- $webhookWrites := false -}}
{{- range (get $live "metadata" | default dict).managedFields | default list -}}
{{- if and (eq .manager "gpudra-webhook") (contains "\"f:caBundle\"" (toJson .fieldsV1)) -}}
{{- $webhookWrites = true -}}
{{- end -}}
{{- end -}}
{{- $held := dict -}}
{{- if or $helm3 (not $webhookWrites) -}}
{{- range $hook := get $live "webhooks" | default list -}}
{{- with ($hook.clientConfig | default dict).caBundle -}}
{{- $_ := set $held $hook.name . -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- toJson $held -}}
{{- end -}}
