# The synthetic engine (e2e/synthetic_engine/engine.py) as a pod: vLLM's metric names, a settable latency, and
# it refuses to start when --config does not parse. Build context: e2e/synthetic_engine.
#   docker build -f e2e/scenario/kind/engine.Dockerfile -t kvtier-synthetic-engine:e2e e2e/synthetic_engine
FROM python:3.11.14-slim-bookworm
RUN python -m pip install --no-cache-dir --disable-pip-version-check prometheus-client==0.26.0 pyyaml==6.0.3
COPY engine.py /app/engine.py
USER 65532:65532
ENTRYPOINT ["python", "/app/engine.py"]
