# syntax=docker/dockerfile:1
# The specserve image: this repository installed at the versions of constraints.txt (the lock), on Python 3.11.
#
#   docker build --build-arg VARIANT=cuda -t specserve:0.1.0-gpu .    # GPU nodes: k8s/rayservice.yaml's image
#   docker build -t specserve:0.1.0-cpu .                             # CPU nodes (deploy/cluster.yaml)
#   docker build --build-arg VARIANT=cuda --build-arg MODELS="qwen-1.5b qwen-0.5b" -t specserve:0.1.0-gpu-models .
#
# VARIANT picks the torch build, the lock's version either way: `cpu` the CPU wheel of download.pytorch.org, `cuda`
# PyPI's Linux wheel, which is the CUDA build and brings its CUDA libraries as its own pinned requirements (the
# node's driver is mounted by the NVIDIA container runtime). MODELS bakes registry models in (python -m modelstore
# list) at the path k8s/ mounts its model cache on, so a pod without that volume finds them: each adds its
# converted folder and GGUF (qwen-1.5b 7.7 GB, qwen-0.5b 2.9 GB), and converting takes ~9 GB of the builder's RAM.
# Without MODELS the pods read the models from a PersistentVolumeClaim (k8s/models.yaml, docs/kubernetes.md).
# BuildKit (Docker >= 23's default builder) for the cache and bind mounts.
ARG VARIANT=cpu
ARG PYTHON=3.11

FROM python:${PYTHON}-slim-bookworm AS base
# bash and wget: KubeRay's injected probes run `bash -c "wget ... | grep success"`. uid 1000 `ray` with its home
# in /home/ray, as in rayproject/ray images, where k8s/ mounts the model cache.
RUN apt-get update \
 && apt-get install -y --no-install-recommends bash wget \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 1000 --shell /bin/bash ray \
 && install -d -o ray -g ray /home/ray/.cache/specserve/models
ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SPECSERVE_MODELS=/home/ray/.cache/specserve/models

# Two pip calls: torch alone from its VARIANT's index (--no-deps), then the package from PyPI under the lock; the
# second keeps that torch (it satisfies ==2.13.0 with its local label) and takes torch's requirements as locked.
# The package is built from the context mounted at /src (its build writes the gRPC stubs, setup.py), which leaves
# no source in the image, so `proto` is the installed package's with its stubs. Then `deploy.lock check` (run from
# /src, where it finds constraints.txt and pyproject.toml) fails the build unless every locked distribution the
# package and its extra need is installed at the lock's version.
FROM base AS cpu
# gcc builds our C kernels as the package installs (setup.py); g++ (and ninja) DeepSpeed's CPU all-reduce for tp_size > 1
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc g++ \
 && rm -rf /var/lib/apt/lists/*
RUN --mount=type=bind,target=/src,rw --mount=type=cache,target=/root/.cache/pip \
    pip install --no-deps --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0" \
 && pip install -c /src/constraints.txt "torch==2.13.0" /src \
 && cd /src && python -m deploy.lock check --extras ""

FROM base AS cuda
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
RUN --mount=type=bind,target=/src,rw --mount=type=cache,target=/root/.cache/pip \
    pip install --no-deps --index-url https://pypi.org/simple "torch==2.13.0" \
 && pip install -c /src/constraints.txt "torch==2.13.0" "/src[gpu]" \
 && cd /src && python -m deploy.lock check --extras gpu

FROM ${VARIANT} AS image
USER ray
WORKDIR /home/ray
ARG MODELS=""
RUN if [ -n "${MODELS}" ]; then python -m modelstore fetch ${MODELS}; fi
CMD ["specserve", "--help"]
