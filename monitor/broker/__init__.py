"""Everything that talks to Kafka. No other part of the monitor imports the client."""
