#!/usr/bin/env bash
# Copy the generated CRDs (crds/, from `kvtier crd`) into the chart, which installs them from crds-source/.
# Helm cannot read files outside the chart directory, so the chart carries a copy; tests/chart fails when the
# copy differs from crds/. Run this after regenerating crds/.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dest="${root}/charts/kvtier/crds-source"
mkdir -p "${dest}"
rm -f "${dest}"/*.yaml
cp "${root}"/crds/*.yaml "${dest}/"
echo "synced $(ls "${dest}" | wc -l) CRD file(s) into charts/kvtier/crds-source/"
