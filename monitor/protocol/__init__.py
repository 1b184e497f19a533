"""What travels on Kafka and what it must satisfy: record values, topics, the trace wire
format and header schema, model contracts and their derivation from a checkpoint,
keyring and scopes, encode/decode with their reject reasons, dead letters, the
anomaly and incident records, and reference decisions. Nothing here talks to Kafka."""
