# syntax=docker/dockerfile:1.7
# vLLM with kvtier's plug-ins (backend: kvtier): kvtier_runtime's cache policies and filesystem tier load into
# vLLM by module path (kvtier_runtime.engines.vllm_adapter). The same image runs the init container the operator
# injects (`sh -c "rm -f /dev/shm/vllm_offload_*.mmap"`): the vLLM base image has sh and rm.
# Build from the repository root:
#   docker build -f images/runtime.Dockerfile -t ghcr.io/kvtier/kvtier-runtime:0.1.0 .
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm
# vLLM 0.33.0, the version the renderers and plug-ins are written against.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.33.0

FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator/ operator/
COPY runtime/ runtime/
RUN python -m pip wheel --no-cache-dir --disable-pip-version-check --no-deps -w /wheels .

FROM ${VLLM_IMAGE}
LABEL org.opencontainers.image.title="kvtier-runtime" \
      org.opencontainers.image.description="vLLM 0.33 with kvtier's KV-cache plug-ins" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=wheel /wheels /tmp/wheels
# --no-deps: the plug-ins need torch, numpy and prometheus-client, which vLLM already pins; resolving kvtier's
# own pins here could replace vLLM's torch. The remote tier's client (redis and its C parser hiredis,
# pyproject's runtime extra, no dependencies of their own on Python >= 3.11.3) are the pins vLLM does not carry;
# cryptography (the remote tier's value encryption) is pinned here to pyproject's release whatever vLLM's image
# holds; with --no-deps, the import check below fails the build if its one dependency (cffi) were missing.
RUN python3 -m pip install --no-cache-dir --disable-pip-version-check --no-deps /tmp/wheels/kvtier-*.whl \
        redis==8.1.0 hiredis==3.5.0 cryptography==50.0.2 \
    && rm -rf /tmp/wheels \
    && python3 -c "import kvtier_runtime.config, redis, hiredis; from cryptography.hazmat.primitives.ciphers.aead import AESGCM" \
    && useradd --uid 10001 --create-home --shell /usr/sbin/nologin kvtier
# vLLM and Hugging Face write caches under HOME; a non-root user with its own home keeps that working.
ENV HOME=/home/kvtier \
    HF_HOME=/home/kvtier/.cache/huggingface
USER 10001:10001
WORKDIR /home/kvtier
# vLLM's own server command, unchanged: a pod that used vllm/vllm-openai keeps its args.
ENTRYPOINT ["vllm", "serve"]
