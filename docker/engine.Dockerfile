# syntax=docker/dockerfile:1
# The vLLM engine image of the mooncake-lookout chart: the pinned vLLM OpenAI image, Mooncake's CUDA wheel
# and this package from its wheel, nothing else. Build from the repository root (docs/helm.md):
#   docker build -f docker/engine.Dockerfile -t ghcr.io/mooncake-lookout/engine:0.1.0 .
# Versions match pyproject.toml's pins (tests/test_dockerfiles.py checks them).
ARG VLLM_VERSION=0.33.0
ARG MOONCAKE_VERSION=0.3.13.post1

# Stage 1: build mooncake-lookout's wheel from the source tree (pure Python, no dependencies installed).
FROM python:3.11-slim AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY connector ./connector
COPY metrics ./metrics
RUN python -m pip wheel --no-cache-dir --no-deps --wheel-dir /dist .

# Stage 2: vLLM's image plus the Mooncake CUDA wheel and our wheel.
FROM vllm/vllm-openai:v${VLLM_VERSION} AS engine
ARG MOONCAKE_VERSION
COPY --from=wheel /dist/ /tmp/dist/
RUN python3 -m pip install --no-cache-dir \
        "mooncake-transfer-engine==${MOONCAKE_VERSION}" \
        /tmp/dist/mooncake_lookout-*.whl \
    && rm -rf /tmp/dist
# vLLM loads the connector through the package's vllm.general_plugins entry point: no other change needed.
ENTRYPOINT ["vllm", "serve"]
