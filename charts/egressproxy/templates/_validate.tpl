{{- /*
Settings the schema accepts one by one but that cannot work together with an agent in
the cluster. Each refusal names the field and says what to do instead. Included by the
agent's Deployment, so `helm template`, `helm lint` and `helm install` all refuse them.
*/ -}}
{{- define "egressproxy.kvmAgent.validate" -}}
{{- $agent := .Values.kvmAgent }}
{{- if not $agent.config.hosts }}
{{- fail "kvmAgent.config.hosts: list at least one hypervisor (name, and ssh with address and user): an agent with no hosts cannot start" }}
{{- end }}
{{- range $index, $host := $agent.config.hosts }}
{{- if $host.local }}
{{- fail (printf "kvmAgent.config.hosts[%d].local: host %q would use the libvirt socket of the pod's own node, which the agent's container does not have; reach it with ssh (address, user), or run the agent on that hypervisor (docs/install.md, 2b) and list it in operator.providers" $index (toString $host.name)) }}
{{- end }}
{{- if not $host.ssh }}
{{- fail (printf "kvmAgent.config.hosts[%d].ssh: host %q needs ssh (address, user): the in-cluster agent reaches hypervisors over SSH" $index (toString $host.name)) }}
{{- end }}
{{- end }}
{{- if eq (int $agent.port) (int $agent.metricsPort) }}
{{- fail (printf "kvmAgent.metricsPort (%v) must differ from kvmAgent.port: one port cannot serve gRPC and /metrics" $agent.metricsPort) }}
{{- end }}
{{- if and $agent.tls.mtls.enabled (not $agent.tls.enabled) }}
{{- fail "kvmAgent.tls.mtls.enabled needs kvmAgent.tls.enabled=true (mutual TLS is TLS with client certificates); to serve plaintext, set kvmAgent.tls.mtls.enabled=false as well" }}
{{- end }}
{{- end -}}
