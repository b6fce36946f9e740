#!/usr/bin/env bash
# The end-to-end scenario on a kind cluster, for hosts with Docker: the same steps as the local provider
# (`kvtier demo`), with a real kubelet, the chart-installed operator and an in-cluster Prometheus.
#
#   e2e/scenario/kind/run.sh                  create the cluster, run the scenario, delete the cluster
#   KEEP_CLUSTER=1 e2e/scenario/kind/run.sh   keep it (then: kind delete cluster --name kvtier-e2e)
#
# Needs docker, kind v0.33.0 (the node image in kind-config.yaml is that release's), kubectl and helm (both
# from tools/helm.sh when not on PATH). Pulls python, prometheus, kindest/node and busybox images.
# On failure it prints the operator log, the namespace's events, the policy and the engine pod's log.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../../.." && pwd)"
cluster=kvtier-e2e
ns=kvtier-demo
policy=llama-demo
deploy=llama-demo
operator_ns=kvtier-system
KIND=${KIND:-kind}
HELM=${HELM:-$(command -v helm || "$repo/tools/helm.sh" --path)}
KUBECTL=${KUBECTL:-$(command -v kubectl || "$repo/tools/helm.sh" --kubectl-path)}
DOCKER=${DOCKER:-docker}

step() { printf '\n\033[1m[%s/8] %s\033[0m\n' "$1" "$2"; }
k() { "$KUBECTL" --context "kind-$cluster" "$@"; }

dump() {
    echo "== operator log"; k -n "$operator_ns" logs deploy/kvtier --tail=200 || true
    echo "== events"; k -n "$ns" get events --sort-by=.lastTimestamp || true
    echo "== policy"; k -n "$ns" get kvcachepolicy "$policy" -o yaml || true
    echo "== pods"; k -n "$ns" get pods -o wide || true
    echo "== engine log"; k -n "$ns" logs "deploy/$deploy" --tail=30 || true
}

finish() {
    local rc=$?
    if ((rc != 0)); then
        echo "kind scenario failed (exit $rc)" >&2
        dump >&2
    fi
    if [[ -z "${KEEP_CLUSTER:-}" ]]; then
        "$KIND" delete cluster --name "$cluster" >/dev/null 2>&1 || true
    fi
    exit "$rc"
}

status() {
    k -n "$ns" get kvcachepolicy "$policy" --no-headers -o \
        'custom-columns=TIERS:.status.tiers[*].name,STATES:.status.tiers[*].state,SLO:.status.sloState,TTFT:.status.slo.last.ttftP99,ITL:.status.slo.last.itlP99,BREACHES:.status.slo.consecutiveBreaches' \
        2>/dev/null || true
}

# wait_for WHAT SECONDS COMMAND...: retry COMMAND every 2 s, printing the policy's status line.
wait_for() {
    local what=$1 timeout=$2 start=$SECONDS
    shift 2
    until "$@"; do
        if ((SECONDS - start > timeout)); then
            echo "timed out after ${timeout}s waiting for $what" >&2
            return 1
        fi
        echo "  $(status)"
        sleep 2
    done
}

tier_is() { [[ "$(k -n "$ns" get kvcachepolicy "$policy" -o jsonpath="{.status.tiers[?(@.name==\"$1\")].state}")" == "$2" ]]; }
slo_is() { [[ "$(k -n "$ns" get kvcachepolicy "$policy" -o jsonpath='{.status.sloState}')" == "$1" ]]; }
ready() { [[ "$(k -n "$ns" get kvcachepolicy "$policy" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}')" == True ]]; }
hash_of_workload() { k -n "$ns" get deploy "$deploy" -o jsonpath='{.spec.template.metadata.annotations.kvtier\.io/config-hash}'; }
hash_of_status() { k -n "$ns" get kvcachepolicy "$policy" -o jsonpath='{.status.targets[0].configHash}'; }
hashes_agree() { [[ -n "$(hash_of_status)" && "$(hash_of_workload)" == "$(hash_of_status)" ]]; }
rendered_has_fs() { k -n "$ns" get configmap "kvtier-$policy" -o jsonpath='{.data.engine\.yaml}' | grep -q /mnt/kvcache; }
rolled_out() { k -n "$ns" rollout status "deploy/$deploy" --timeout=120s >/dev/null; }

fail() { echo "run.sh: $*" >&2; exit 1; }

# engine PATH [JSON]: GET (or POST JSON to) the synthetic engine in every running pod of the Deployment.
engine() {
    local pod
    for pod in $(k -n "$ns" get pods -l "app=$deploy" --field-selector=status.phase=Running -o name); do
        k -n "$ns" exec "$pod" -- python -c '
import sys, urllib.request
body = sys.argv[2].encode() if len(sys.argv) > 2 else None
req = urllib.request.Request("http://127.0.0.1:8000" + sys.argv[1], data=body, method="POST" if body else "GET",
                             headers={"Content-Type": "application/json"})
print(urllib.request.urlopen(req, timeout=5).read().decode())' "$@"
    done
}
pods_load_fs() { engine /config | grep -q /mnt/kvcache; }

trap finish EXIT
for tool in "$DOCKER" "$KIND" "$HELM" "$KUBECTL"; do
    command -v "$tool" >/dev/null || { echo "run.sh: $tool not found" >&2; exit 2; }
done

step 1 "Cluster and images"
"$KIND" create cluster --config "$here/kind-config.yaml" --wait 120s
"$DOCKER" build -f "$repo/images/operator.Dockerfile" -t kvtier-operator:e2e "$repo"
"$DOCKER" build -f "$here/engine.Dockerfile" -t kvtier-synthetic-engine:e2e "$repo/e2e/synthetic_engine"
"$KIND" load docker-image --name "$cluster" kvtier-operator:e2e kvtier-synthetic-engine:e2e

step 2 "Install: the chart (operator + CRD) and Prometheus"
k create namespace "$ns" --dry-run=client -o yaml | k apply -f -
"$HELM" --kube-context "kind-$cluster" install kvtier "$repo/charts/kvtier" --namespace "$operator_ns" \
    --create-namespace -f "$here/values.yaml" --wait --timeout 180s
k apply -f "$here/manifests/monitoring.yaml"
k -n monitoring rollout status deploy/prometheus --timeout=180s

step 3 "Apply the workload and the policy"
k apply -f "$here/manifests/workload.yaml"
k apply -f "$here/manifests/policy.yaml"

step 4 "The workload carries its rendered configuration"
wait_for "the policy Ready" 90 ready
wait_for "the Deployment's config hash" 60 hashes_agree
wait_for "the ConfigMap to render nvme" 10 rendered_has_fs
wait_for "the pods on the rendered config" 180 rolled_out
wait_for "the engine to load nvme from /etc/kvtier/engine.yaml" 30 pods_load_fs
wait_for "SLO OK" 90 slo_is OK
echo "  ok: hash $(hash_of_workload); $(status)"

step 5 "Latency rises: nvme is rolled back"
before=$(hash_of_workload)
engine /control '{"ttft": 2.0, "itl": 0.25}' >/dev/null
wait_for "nvme Disabled" 90 tier_is nvme Disabled
k -n "$ns" get events --field-selector reason=TierDisabled,type=Warning -o jsonpath='{.items[*].message}' \
    | grep -q nvme || fail "no Warning Event TierDisabled naming nvme"
wait_for "a new config hash" 60 hashes_agree
[[ "$(hash_of_workload)" != "$before" ]] || fail "the config hash did not change"
if rendered_has_fs; then fail "the ConfigMap still renders nvme"; fi
wait_for "the pods on the config without nvme" 180 rolled_out
if pods_load_fs; then fail "a pod still loaded nvme"; fi
echo "  ok: status, Warning Event, ConfigMap, Deployment ($before -> $(hash_of_workload)) and pods agree"

step 6 "Latency recovers"
# The rolled pods started with the manifest's healthy latency already; set it anyway, for any pod left.
engine /control '{"ttft": 0.08, "itl": 0.02}' >/dev/null
wait_for "SLO OK" 90 slo_is OK

step 7 "Re-enable nvme"
k -n "$ns" annotate kvcachepolicy "$policy" kvtier.io/reenable=nvme --overwrite
wait_for "nvme Enabled" 60 tier_is nvme Enabled
wait_for "the config hash" 60 hashes_agree
rendered_has_fs || fail "the ConfigMap does not render nvme again"
wait_for "the pods on the full config" 180 rolled_out
wait_for "the engine to load nvme again" 30 pods_load_fs
[[ -z "$(k -n "$ns" get kvcachepolicy "$policy" -o jsonpath='{.metadata.annotations.kvtier\.io/reenable}')" ]] \
    || fail "the kvtier.io/reenable annotation was not consumed"

step 8 "Done"
status
echo "kind scenario passed"
