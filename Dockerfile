# The monitor's image for docker-compose.yml. One process per container: the service
# runs one BLAS thread and scales with instances and partitions.
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY monitor ./monitor
RUN pip install --no-cache-dir .
RUN mkdir -p /var/lib/attention-monitor && chown 65534 /var/lib/attention-monitor
USER 65534
EXPOSE 9464
ENTRYPOINT []
CMD ["attention-monitor", "run"]
