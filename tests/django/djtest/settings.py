"""Settings of the Django app's tests: SQLite (``default``), PostgreSQL (``pg``) and MariaDB (``maria``).

The servers are the test suite's (``$KAFKA2PC_PG_ADMIN_URL``, ``$KAFKA2PC_MARIADB_URL``); pytest-django
creates a test database on each server the selected tests use.  ``KAFKA2PC`` is filled in by the tests'
fixtures (the broker starts with the session).  MariaDB goes through PyMySQL installed as ``MySQLdb``.
"""

from __future__ import annotations

import os
import tempfile
from urllib.parse import unquote, urlsplit

import pymysql

pymysql.version_info = (2, 2, 1, "final", 0)  # Django asks for mysqlclient >= 2.2.1; PyMySQL stands in
pymysql.install_as_MySQLdb()


def _server(env: str, default: str, engine: str, name: str) -> dict[str, object]:
    url = urlsplit(os.environ.get(env, default))
    base = os.environ.get("KAFKA2PC_PORT_BASE", "0")
    return {
        "ENGINE": engine,
        "NAME": f"{name}_{base}",
        "USER": unquote(url.username or ""),
        "PASSWORD": unquote(url.password or ""),
        "HOST": url.hostname or "127.0.0.1",
        "PORT": str(url.port or ""),
        "TEST": {"NAME": f"test_{name}_{base}_{os.getpid()}"},
        **({"OPTIONS": {"charset": "utf8mb4"}} if "mysql" in engine else {}),
    }


_SQLITE = os.environ.get("KAFKA2PC_DJANGO_SQLITE") or os.path.join(tempfile.gettempdir(), f"k2pc-dj-{os.getpid()}.db")

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": _SQLITE,
        "TEST": {"NAME": _SQLITE + ".test"},
        "OPTIONS": {"timeout": 10},
    },
    "pg": _server("KAFKA2PC_PG_ADMIN_URL", "postgresql://postgres:postgres@127.0.0.1:5432/postgres",
                  "django.db.backends.postgresql", "k2pc_dj"),
    "maria": _server("KAFKA2PC_MARIADB_URL", "mysql://kafka2pc:kafka2pc@127.0.0.1:3306/kafka2pc",
                     "django.db.backends.mysql", "k2pc_dj"),
}

INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.admin",
    "django.contrib.sessions",
    "django.contrib.messages",
    "kafka2pc.recipes.django",
    "djtest",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [{
    "BACKEND": "django.template.backends.django.DjangoTemplates",
    "APP_DIRS": True,
    "OPTIONS": {"context_processors": ["django.contrib.auth.context_processors.auth",
                                       "django.contrib.messages.context_processors.messages",
                                       "django.template.context_processors.request"]},
}]
ROOT_URLCONF = "djtest.urls"
SECRET_KEY = "kafka2pc-tests"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
KAFKA2PC = {
    "PRODUCER": {"bootstrap.servers": os.environ.get("KAFKA2PC_DJANGO_BOOTSTRAP", "127.0.0.1:1")},
    "TRANSACTIONAL_ID_PREFIX": "djtest",
    "POOL_SIZE": 4,
}
