# hkserve: CPU image by default, CUDA with --build-arg ACCEL=cuda12 (or cuda13). docs/deploy.md.
#   docker build -t hkserve .                                   # CPU
#   docker build -t hkserve:cuda --build-arg ACCEL=cuda12 .     # NVIDIA GPUs
#   docker run --gpus all -p 8000:8000 -v hkserve-models:/models hkserve:cuda
#
# BASE: any Debian-based image with Python >= 3.11 and its venv module. No CUDA base image is needed:
# the JAX CUDA wheels (jax[cuda12] / jax[cuda13]) bring CUDA, cuDNN, cuBLAS and NCCL from PyPI, and only
# the driver comes from the host (NVIDIA container toolkit). `make docker-check` builds on a Debian
# base made locally with mmdebstrap (scripts/docker-check.sh).
ARG BASE=python:3.12-slim-bookworm

# ---- dependencies: a layer that changes only with pyproject.toml (or ACCEL) ----
FROM ${BASE} AS deps
# cpu | cuda12 | cuda13: which JAX backend the image carries
ARG ACCEL=cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/hkserve
WORKDIR /src
COPY pyproject.toml ./
RUN case "$ACCEL" in \
      cpu) backend="" ;; \
      cuda12|cuda13) backend="jax[$ACCEL]" ;; \
      *) echo "ACCEL must be cpu, cuda12 or cuda13, got '$ACCEL'" >&2; exit 1 ;; \
    esac \
 && /opt/hkserve/bin/python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" > requirements.txt \
 && /opt/hkserve/bin/pip install -r requirements.txt $backend

# ---- hkserve itself: rebuilt when the source changes, on top of the cached dependencies ----
FROM deps AS build
COPY README.md ./
COPY hkserve ./hkserve
RUN /opt/hkserve/bin/pip install --no-deps . && /opt/hkserve/bin/pip check

# ---- the image: the venv, no compiler, no source tree ----
FROM ${BASE}
# The CPU kernels (hkserve/kernels) serve int8 weights on a CPU only (--weights int8). They are compiled
# on first use for the CPU that runs them (the cache is keyed by its feature flags), so a library built
# here would not match the host's CPU. CPU_KERNELS=1 keeps g++ in the image to compile them once into
# /models/kernels; the default leaves it out (GPU images and float32 CPU serving never use them, and
# int8 on a CPU then runs XLA's dots, which the server logs).
ARG CPU_KERNELS=0
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini $(test "$CPU_KERNELS" = 1 && echo g++) \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --uid 1000 --user-group --home-dir /models --no-create-home --shell /usr/sbin/nologin hkserve \
 && mkdir -p /models && chown hkserve:hkserve /models
COPY --from=build /opt/hkserve /opt/hkserve
COPY deploy/entrypoint.py /usr/local/bin/hkserve-entrypoint
COPY deploy/healthcheck.py /usr/local/bin/hkserve-healthcheck
# HKSERVE_HOST/HKSERVE_PORT and every other serve flag: see deploy/entrypoint.py.
ENV PATH=/opt/hkserve/bin:$PATH PYTHONUNBUFFERED=1 HKSERVE_HOME=/models HKSERVE_HOST=0.0.0.0 HKSERVE_PORT=8000
USER hkserve
WORKDIR /models
# The store: models, the XLA compile cache (a restart skips most compiles) and the kernels' cache.
VOLUME ["/models"]
EXPOSE 8000
# SIGTERM drains: /health turns 503, new requests 503, running ones finish (at most 300 s, then
# uvicorn's 60 s): the orchestrator's grace period must be longer (deploy/: 400 s).
STOPSIGNAL SIGTERM
# The first start pulls the default model and compiles: allow it 10 minutes before counting failures.
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 CMD ["hkserve-healthcheck"]
# tini: forwards the stop signal and reaps zombies; -s also when it is not PID 1 (a shared PID namespace).
ENTRYPOINT ["tini", "-s", "--", "hkserve-entrypoint"]
CMD []
