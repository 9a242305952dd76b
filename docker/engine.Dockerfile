# syntax=docker/dockerfile:1
# The vLLM engine image of the mooncake-lookout chart: the pinned vLLM OpenAI image, Mooncake's CUDA 13 wheel, this
# package from its wheel and the RDMA user-space drivers, nothing else. Build from the repository root (docs/helm.md):
#   docker build -f docker/engine.Dockerfile -t ghcr.io/mooncake-lookout/engine:0.1.0 .
# Versions match pyproject.toml's pins (tests/test_dockerfiles.py checks them).
#
# Which Mooncake: vLLM 0.33.0 is built for CUDA 13 (its kernels link libcudart.so.13 and it pins the cu13 extras
# of its CUDA dependencies), and vLLM's release images install the KV-connector packages with Mooncake's CUDA 13
# variant, mooncake-transfer-engine-cuda13 (the plain mooncake-transfer-engine wheel is the CUDA 12 build). The
# image may carry either variant at whatever version its build resolved; both own the same files, so both are
# removed and the CUDA 13 one is installed at the version the master image runs (client and master must agree).
ARG VLLM_VERSION=0.33.0
ARG MOONCAKE_VERSION=0.3.13.post1

# Stage 1: build mooncake-lookout's wheel from the source tree (pure Python, no dependencies installed).
FROM python:3.11-slim AS wheel
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY connector ./connector
COPY metrics ./metrics
RUN python -m pip wheel --no-cache-dir --no-deps --wheel-dir /dist .

# Stage 2: vLLM's image plus the Mooncake CUDA 13 wheel and our wheel.
FROM vllm/vllm-openai:v${VLLM_VERSION} AS engine
ARG MOONCAKE_VERSION
# Mooncake's transfer engine opens RDMA NICs through libibverbs, which finds the NIC's driver in ibverbs-providers.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libibverbs1 ibverbs-providers \
    && rm -rf /var/lib/apt/lists/*
COPY --from=wheel /dist/ /tmp/dist/
RUN python3 -m pip uninstall -y mooncake-transfer-engine mooncake-transfer-engine-cuda13 \
    && python3 -m pip install --no-cache-dir \
        "mooncake-transfer-engine-cuda13==${MOONCAKE_VERSION}" \
        /tmp/dist/mooncake_lookout-*.whl \
    && rm -rf /tmp/dist
# vLLM loads the connector through the package's vllm.general_plugins entry point: no other change needed.
ENTRYPOINT ["vllm", "serve"]
