"""The running service: the Kafka loop, the pipeline (join and outputs), delivery of
outputs with offsets, partition assignment, reference state on disk, health, the HTTP
endpoint and the exporter."""
