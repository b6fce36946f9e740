# syntax=docker/dockerfile:1.7
# The kvtier operator: kopf, the Kubernetes client and kvtier's torch-free packages. No torch, no vLLM.
# Build from the repository root:
#   docker build -f images/operator.Dockerfile -t ghcr.io/kvtier/kvtier-operator:0.1.0 .
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator/ operator/
COPY runtime/ runtime/
# The operator extra only: torch and numpy belong to the runtime extra and stay out of this image.
RUN python -m pip install --no-cache-dir --disable-pip-version-check --prefix=/install ".[operator]"

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="kvtier-operator" \
      org.opencontainers.image.description="kvtier operator: KVCachePolicy -> engine configuration, SLO guard" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /install /usr/local
# No shell profile, no caches: Python writes nothing at run time (the chart mounts /tmp for what kopf needs).
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# The distroless "nonroot" user; the chart's pod securityContext uses the same ids.
USER 65532:65532
ENTRYPOINT ["kvtier"]
CMD ["operator"]
