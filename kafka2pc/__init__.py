"""kafka2pc: Apache Kafka as a two-phase-commit participant (KIP-939)."""
