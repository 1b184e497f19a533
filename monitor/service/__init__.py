"""The running service: wiring (app), the Kafka loop, the pipeline, the join, each stream's
judging in one place (fleet) and its one verdict path (findings), delivery of outputs with
offsets, partition assignment, reference state on disk, health, the HTTP endpoint and the
exporter."""
