# syntax=docker/dockerfile:1
# The Mooncake master image of the mooncake-lookout chart: mooncake_master from Mooncake's wheel, run as a
# non-root user. The master needs no GPU, so it takes the non-CUDA wheel (which needs libibverbs1). The store pods
# run mooncake_client from this image: ibverbs-providers holds the NIC drivers (libmlx5 and others) RDMA needs, which
# --no-install-recommends would leave out.
#   docker build -f docker/master.Dockerfile -t ghcr.io/mooncake-lookout/master:0.1.0 docker
# Versions match pyproject.toml's pins (tests/test_dockerfiles.py checks them).
ARG PYTHON_VERSION=3.11
ARG MOONCAKE_VERSION=0.3.13.post1

FROM python:${PYTHON_VERSION}-slim-bookworm AS master
ARG MOONCAKE_VERSION
RUN apt-get update \
    && apt-get install -y --no-install-recommends libibverbs1 ibverbs-providers \
    && rm -rf /var/lib/apt/lists/*
RUN python -m pip install --no-cache-dir "mooncake-transfer-engine-non-cuda==${MOONCAKE_VERSION}"
RUN groupadd --system --gid 10001 mooncake \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin mooncake
USER 10001:10001
# RPC (store clients) and HTTP (/metrics, /health); the chart passes the flags.
EXPOSE 50051 9003
ENTRYPOINT ["mooncake_master"]
CMD ["--rpc_port=50051", "--metrics_port=9003", "--logtostderr=true"]
