# syntax=docker/dockerfile:1
# m3serve container image. Written without a Docker engine at hand, so never built as an
# image; scripts/check_image_stages.sh runs both stages in debootstrapped Debian 12 roots with
# their packages, files and commands as written here (NVIDIA's CUDA packages replaced by a
# local CUDA 13 toolkit) and serves the demo model from the runtime stage as its user.
#
#   docker build -t m3serve .
#   docker run --gpus all --stop-timeout 25 -p 50051:50051 -p 9464:9464 m3serve   # demo model
#   docker run --gpus all --stop-timeout 25 -v /models:/models:ro -p 50051:50051 -p 9464:9464 \
#       m3serve --model /models/s2s-14l --tokenizer /models/s2s-14l/tokenizer.model
#
# --stop-timeout: on `docker stop` m3serve reports NOT_SERVING for drain_delay_s (5 s) while
# still serving, then gives running replies shutdown_grace_s (10 s) to finish (server.yaml);
# Docker's default of 10 s would SIGKILL it first.
#
# Base: Debian 12 plus NVIDIA's CUDA 13.0 apt repository for Debian 12, not
# nvidia/cuda:13.0.x-devel-ubuntu24.04. The server's libraries come from the distribution
# (gRPC 1.51, protobuf 3.21, SentencePiece 0.1.97 with its private protobuf that the
# libm3_spm.so shim works around, prometheus-cpp 1.0, spdlog 1.10, yaml-cpp 0.7), and
# Debian 12 is the set m3serve is developed and tested on (scripts/setup.sh); Ubuntu 24.04
# carries other versions of several of them. CUDA is NVIDIA's toolkit in /usr/local/cuda,
# as scripts/setup.sh expects. The engine links the CUDA runtime statically, so the
# runtime stage needs no CUDA packages: the driver (libcuda) comes from the host through
# the NVIDIA Container Toolkit (`--gpus`). Without a GPU the server runs the CPU engine.

ARG DEBIAN_IMAGE=debian:12-slim

# ---- build ----------------------------------------------------------------------------
FROM ${DEBIAN_IMAGE} AS build
ARG CUDA_VERSION_DASHED=13-0
ARG CUDA_ARCHITECTURES="90;120"
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update && apt-get install -y --no-install-recommends \
        ca-certificates curl gnupg \
    && curl -fsSL -o /tmp/cuda-keyring.deb \
        https://developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64/cuda-keyring_1.1-1_all.deb \
    && dpkg -i /tmp/cuda-keyring.deb && rm /tmp/cuda-keyring.deb \
    && apt-get update && apt-get install -y --no-install-recommends \
        build-essential cmake ninja-build pkg-config \
        libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler \
        libsentencepiece-dev libspdlog-dev prometheus-cpp-dev libyaml-cpp-dev nlohmann-json3-dev \
        cuda-nvcc-${CUDA_VERSION_DASHED} cuda-cudart-dev-${CUDA_VERSION_DASHED} \
        cuda-cccl-${CUDA_VERSION_DASHED} libcublas-dev-${CUDA_VERSION_DASHED} \
    && rm -rf /var/lib/apt/lists/*
ENV PATH=/usr/local/cuda/bin:${PATH}

WORKDIR /src
# Only the sources: build trees in the checkout never enter the image.
COPY CMakeLists.txt ./
COPY kernels/ kernels/
COPY model/ model/
COPY proto/ proto/
COPY server/ server/
COPY configs/ configs/
RUN cmake -S . -B /build -G Ninja \
        -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHITECTURES}" \
        -DM3_BUILD_SERVER=ON -DM3_BUILD_TESTS=OFF -DM3_REQUIRE_CUDA=ON \
    && cmake --build /build -j"$(nproc)" --target m3serve m3cli m3bench m3make m3check m3_spm \
    && mkdir -p /out/bin /out/lib \
    && cp /build/server/m3serve /build/server/m3cli /build/server/m3bench \
          /build/model/m3make /build/model/m3check /out/bin/ \
    && cp /build/server/libm3_spm.so /out/lib/ \
    && strip /out/bin/* /out/lib/*

# ---- runtime --------------------------------------------------------------------------
FROM ${DEBIAN_IMAGE} AS runtime
ENV DEBIAN_FRONTEND=noninteractive
# Shared libraries of the binaries above (their dependencies follow).
RUN apt-get update && apt-get install -y --no-install-recommends \
        libgrpc++1.51 libprotobuf32 libsentencepiece0 libspdlog1.10 libyaml-cpp0.7 \
        libprometheus-cpp-core1.0 libprometheus-cpp-pull1.0 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --create-home --home-dir /var/lib/m3serve --shell /usr/sbin/nologin m3serve

# m3serve finds the SentencePiece shim in ../lib beside its executable.
COPY --from=build /out/bin/ /opt/m3serve/bin/
COPY --from=build /out/lib/ /opt/m3serve/lib/
# cuBLASLt (the prefill projections), where the loader looks by default.
COPY --from=build /usr/local/cuda/lib64/libcublasLt.so.13 /usr/local/lib/libcublasLt.so.13
RUN ldconfig
COPY configs/server.yaml /etc/m3serve/server.yaml
COPY configs/models/ /etc/m3serve/models/
COPY configs/prometheus.yml /etc/m3serve/prometheus.yml
COPY configs/grafana/ /etc/m3serve/grafana/
# The demo model (served when no --model is given) is generated under $XDG_CACHE_HOME.
ENV PATH=/opt/m3serve/bin:${PATH} \
    XDG_CACHE_HOME=/var/lib/m3serve/cache \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

USER m3serve
WORKDIR /var/lib/m3serve
# gRPC (server.yaml `listen`) and Prometheus /metrics (`metrics_listen`).
EXPOSE 50051 9464
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["m3cli", "--server", "127.0.0.1:50051", "--connect-timeout", "3", "--timeout", "3", "health"]
# configs/server.yaml listens on loopback; a container serves its network.
ENTRYPOINT ["m3serve", "--config", "/etc/m3serve/server.yaml", "--listen", "0.0.0.0:50051", "--metrics-listen", "0.0.0.0:9464"]
