# diffbatch server image.
#
#   docker build -t diffbatch .                      # CUDA runtime base, torch from PyPI
#   docker run --gpus all -p 8000:8000 diffbatch      # serves the trained shapes model
#   docker run --gpus all -p 8000:8000 -v /data/sd15:/models/sd15:ro diffbatch \
#       /models/sd15 --device cuda --dtype float16
#
# Arguments after the image name are `diffbatch serve` arguments (MODEL and flags); host,
# port and output directory are fixed in the entrypoint, and a later flag overrides them.
#
# BASE_IMAGE may be any Debian or Ubuntu image (scripts/docker_smoke.sh uses a plain Debian
# bookworm base). TORCH_SPEC is what pip installs as torch before the package: a
# requirement, or a wheel in the build context given by its path relative to the context
# (e.g. ./wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl). EXTRAS names
# optional dependency groups to install with the package: `--build-arg
# EXTRAS=ray,postgres,s3` for the image that deploy/rayservice.yaml runs on KubeRay.
ARG BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
FROM ${BASE_IMAGE}

ARG TORCH_SPEC="torch==2.13.0"
ARG EXTRAS=""

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# Package versions differ between the Debian and Ubuntu bases this file supports, so apt
# packages cannot be pinned here; the base image tag pins the distribution release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-pip \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

# torch first, on its own layer: the largest download, and the one a CPU build swaps out.
# The build context is mounted at the working directory, so a relative wheel path works.
# TORCH_SPEC is pinned (its default is torch==2.13.0) or a wheel file; hadolint cannot see
# through the variable.
WORKDIR /mnt/context
# hadolint ignore=DL3013
RUN --mount=type=bind,target=/mnt/context pip install --no-cache-dir "${TORCH_SPEC}"

WORKDIR /opt/diffbatch
# README.m[d]: copied when present (the package metadata reads it; its absence only warns).
COPY pyproject.toml README.m[d] ./
COPY server/ server/
COPY engine/ engine/
COPY pipelines/ pipelines/
COPY configs/ configs/
# The package pins its own dependencies (pyproject.toml), extras included.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".${EXTRAS:+[${EXTRAS}]}" \
    && rm -rf build ./*.egg-info

RUN useradd --uid 10001 --user-group --create-home --home-dir /home/diffbatch \
        --shell /usr/sbin/nologin diffbatch \
    && mkdir -p /models /home/diffbatch/outputs /home/diffbatch/.cache/diffbatch \
    && chown -R diffbatch:diffbatch /home/diffbatch

USER 10001:10001
WORKDIR /home/diffbatch
ENV DIFFBATCH_CACHE_DIR=/home/diffbatch/.cache/diffbatch
VOLUME ["/models", "/home/diffbatch/outputs"]
EXPOSE 8000

# /health is 503 while the model loads; large models can take minutes.
HEALTHCHECK --interval=30s --timeout=10s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=8)"]

ENTRYPOINT ["diffbatch", "serve", "--host", "0.0.0.0", "--port", "8000", "--output-dir", "/home/diffbatch/outputs"]
# The trained shapes model shipped in the package (pipelines/trained/weights/shapes/, package
# data): real pictures with no download. `tiny-sd` and any mounted model work the same way.
CMD ["--config", "/opt/diffbatch/configs/shapes.yaml"]
