"""Settings of the order service (environment variables; see ``gunicorn.conf.py`` for how to run it).

``ORDERS_DB``
    ``postgresql://user:password@host:port/name`` (Django's PostgreSQL backend, psycopg 3),
    ``mysql://...`` (MariaDB/MySQL: mysqlclient, or PyMySQL installed as ``MySQLdb``), or a
    SQLite file path (default ``orders.db``).
``KAFKA_BOOTSTRAP_SERVERS``
    default ``localhost:9092``.
``ORDERS_TOPIC``
    the events' topic (default ``orders``; it must exist).
``ORDERS_POOL_SIZE``
    transactional ids shared by all workers of all hosts (default 16).
``ORDERS_KAFKA_TIMEOUT_S``, ``ORDERS_ACQUIRE_TIMEOUT_S``, ``ORDERS_LEASE_S``
    the pool's bounds (defaults 5, 5 and 15 s): a request ends within
    ``ACQUIRE_TIMEOUT_S + 2 * KAFKA_TIMEOUT_S``; a killed worker's ids are settled by the
    other workers about ``LEASE_S`` after it died.
``ORDERS_PIPELINED``
    ``1``: a request's response is sent once the database COMMIT is durable, and its Kafka commit
    completes in the background (``POOL_OPTIONS["pipelined"]``, docs/django.md); default off.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote, urlsplit

BASE_DIR = Path(__file__).resolve().parent.parent


def _database(value: str) -> dict[str, object]:
    url = urlsplit(value)
    if url.scheme.startswith("postgres"):
        engine = "django.db.backends.postgresql"
    elif url.scheme.startswith("mysql"):
        engine = "django.db.backends.mysql"
        try:
            import MySQLdb  # noqa: F401 - mysqlclient
        except ImportError:
            import pymysql

            pymysql.version_info = (2, 2, 1, "final", 0)  # Django asks for mysqlclient >= 2.2.1
            pymysql.install_as_MySQLdb()
    else:
        return {"ENGINE": "django.db.backends.sqlite3", "NAME": value, "OPTIONS": {"timeout": 10}}
    return {"ENGINE": engine, "NAME": url.path.lstrip("/"), "USER": unquote(url.username or ""),
            "PASSWORD": unquote(url.password or ""), "HOST": url.hostname or "localhost", "PORT": str(url.port or "")}


DATABASES = {"default": _database(os.environ.get("ORDERS_DB", str(BASE_DIR / "orders.db")))}
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "kafka2pc.recipes.django",
    "orders",
]
MIDDLEWARE: list[str] = []
ROOT_URLCONF = "orders_project.urls"
WSGI_APPLICATION = "orders_project.wsgi.application"
SECRET_KEY = os.environ.get("ORDERS_SECRET_KEY", "change-me")
DEBUG = False
ALLOWED_HOSTS = ["*"]
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

ORDERS_TOPIC = os.environ.get("ORDERS_TOPIC", "orders")
KAFKA2PC = {
    "PRODUCER": {"bootstrap.servers": os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "localhost:9092")},
    "TRANSACTIONAL_ID_PREFIX": os.environ.get("ORDERS_TRANSACTIONAL_ID_PREFIX", "orders-service"),
    "POOL_SIZE": int(os.environ.get("ORDERS_POOL_SIZE", "16")),
    "POOL_OPTIONS": {
        "kafka_timeout_s": float(os.environ.get("ORDERS_KAFKA_TIMEOUT_S", "5")),
        "acquire_timeout_s": float(os.environ.get("ORDERS_ACQUIRE_TIMEOUT_S", "5")),
        "lease_s": float(os.environ.get("ORDERS_LEASE_S", "15")),
        "max_slots": 4,
        "pipelined": os.environ.get("ORDERS_PIPELINED", "") == "1",
    },
}
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"kafka2pc": {"handlers": ["console"], "level": "INFO"}},
}
