# hkserve for GPU hosts: CUDA-enabled JAX, non-root user, the model store as a volume.
#   docker build -t hkserve .
#   docker run --gpus all -p 8000:8000 -v hkserve-models:/models hkserve
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    HKSERVE_HOME=/models VIRTUAL_ENV=/opt/hkserve PATH=/opt/hkserve/bin:$PATH
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-pip curl ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/hkserve

WORKDIR /app
COPY pyproject.toml README.md ./
COPY hkserve ./hkserve
RUN pip install --upgrade pip && pip install "jax[cuda12]>=0.10" . 

RUN useradd --create-home --uid 1000 hkserve && mkdir -p /models && chown hkserve /models
USER hkserve
VOLUME ["/models"]
EXPOSE 8000

HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
  CMD curl -fsS http://127.0.0.1:8000/health || exit 1

# Pulls the default model into /models on first start if it is not there yet.
CMD ["hkserve", "serve", "--host", "0.0.0.0", "--port", "8000"]
