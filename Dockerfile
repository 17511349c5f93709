# ckptd node daemon image. Runs as a DaemonSet or a sidecar next to the trainer;
# see deploy/k8s/. The trainer and the daemon must share /dev/shm and the socket dir.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip wheel --no-cache-dir --wheel-dir /wheels ".[s3,gcs]"

FROM python:3.11-slim
RUN groupadd --system --gid 2000 ckptd && useradd --system --uid 2000 --gid ckptd ckptd \
    && mkdir -p /var/lib/ckptd /run/ckptd && chown ckptd:ckptd /var/lib/ckptd /run/ckptd \
    && chmod 0750 /run/ckptd
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
# Numeric, so Kubernetes' runAsNonRoot can check it (deploy/k8s runs it as 2000:2000).
USER 2000:2000
# No CKPTD_* settings here: they would override the operator's config file. The
# daemon's built-in root and socket are these two volumes; settings come from a file
# (CKPTD_CONFIG or `serve --config`, as deploy/k8s mounts its ConfigMap).
VOLUME ["/var/lib/ckptd", "/run/ckptd"]
# SIGTERM finishes acknowledged saves before exit: give it time (terminationGracePeriodSeconds).
STOPSIGNAL SIGTERM
# /healthz answers while the daemon's event loop runs (metrics_address, default
# 127.0.0.1:9464 inside the container).
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9464/healthz', timeout=4)"]
ENTRYPOINT ["ckptd"]
CMD ["serve"]
