"""Recipes: thin clients of the kafka2pc core that need a second system (a database, Spark).

Each recipe is its own module so importing one never imports another's
dependencies:

- :mod:`kafka2pc.recipes.dual_write` — KIP-939's dual-write recipe on SQLAlchemy 2.x
  (PostgreSQL, SQLite, any dialect with row locks): atomic database + Kafka writes,
  recovery, exactly-once consume-transform-produce.
- :mod:`kafka2pc.recipes.spark` — exactly-once Kafka writes from Spark Structured
  Streaming (``[spark]`` extra).
- :mod:`kafka2pc.recipes.django` — a reusable Django app: the dual write for Django's ORM, on
  the dual-write recipe's protocol, tables and recovery (``[django]`` extra).
"""
