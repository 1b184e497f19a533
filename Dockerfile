# The monitor's image for docker-compose.yml. One process per container: the service
# runs one BLAS thread and scales with instances and partitions.
#
# The entry point (deploy/monitor/entrypoint.sh) starts as root only to hand the mounted
# secrets to the unprivileged user (65534, ATTENTION_MONITOR_RUN_AS) that then runs the
# command: compose keeps a secret file's host owner and mode, and `keyring new` writes 0600.
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY monitor ./monitor
RUN pip install --no-cache-dir .
COPY deploy/monitor/entrypoint.sh /usr/local/bin/attention-monitor-entrypoint
RUN mkdir -p /var/lib/attention-monitor && chown 65534:65534 /var/lib/attention-monitor
EXPOSE 9464
ENTRYPOINT ["/usr/local/bin/attention-monitor-entrypoint"]
CMD ["attention-monitor", "run"]
