"""The WSGI application ``bench_django.py --gunicorn`` serves: one Django project, two write endpoints.

``POST /nonatomic/<n>``: ``n`` rows in one ``transaction.atomic()``, then a plain confluent-kafka
transaction with ``n`` records (the baseline). ``POST /dual/<n>``: the same rows and records in one
``dual_write()``, in the same order (the rows, then the records: with ``linger.ms`` 0, records produced
between the rows' round trips would each go to the broker in a request of their own). Configured by the environment the benchmark sets: ``BENCH_DB_URL``,
``BENCH_BOOTSTRAP``, ``BENCH_TOPIC``, ``BENCH_PREFIX``, ``BENCH_POOL_SIZE`` and ``BENCH_PIPELINED``
(``1``: ``POOL_OPTIONS["pipelined"]``).
"""

from __future__ import annotations

import os
import threading
import uuid
from typing import Any

import django
import sqlalchemy as sa
from django.conf import settings

_url = sa.make_url(os.environ["BENCH_DB_URL"])
_pipelined = os.environ.get("BENCH_PIPELINED") == "1"
settings.configure(
    DATABASES={"default": {
        "ENGINE": "django.db.backends.postgresql", "NAME": _url.database, "USER": _url.username,
        "PASSWORD": _url.password, "HOST": _url.host, "PORT": str(_url.port or 5432), "CONN_MAX_AGE": None,
    }},
    INSTALLED_APPS=["django.contrib.contenttypes", "kafka2pc.recipes.django"],
    USE_TZ=True,
    ROOT_URLCONF=__name__,
    ALLOWED_HOSTS=["*"],
    SECRET_KEY="bench",
    DEBUG=False,
    KAFKA2PC={"PRODUCER": {"bootstrap.servers": os.environ["BENCH_BOOTSTRAP"], "linger.ms": 0},
              "TRANSACTIONAL_ID_PREFIX": os.environ["BENCH_PREFIX"],
              "POOL_SIZE": int(os.environ["BENCH_POOL_SIZE"]),
              "POOL_OPTIONS": {"pipelined": _pipelined}},
)
django.setup()

from confluent_kafka import Producer  # noqa: E402
from django.core.wsgi import get_wsgi_application  # noqa: E402
from django.db import models, transaction  # noqa: E402
from django.http import HttpRequest, HttpResponse  # noqa: E402
from django.urls import path  # noqa: E402
from django.views.decorators.csrf import csrf_exempt  # noqa: E402
from kafka2pc.recipes.django import dual_write  # noqa: E402

TOPIC = os.environ["BENCH_TOPIC"]


class BenchOrder(models.Model):
    id = models.CharField(max_length=64, primary_key=True)
    payload = models.CharField(max_length=200)

    class Meta:
        app_label = "kafka2pc"
        db_table = "bench_orders"


_local = threading.local()


def _plain() -> Any:
    """This thread's transactional producer for the baseline (one per thread, as a worker thread would hold)."""
    producer = getattr(_local, "producer", None)
    if producer is None:
        producer = Producer({"bootstrap.servers": os.environ["BENCH_BOOTSTRAP"], "linger.ms": 0,
                             "transactional.id": f"bench-http-plain-{uuid.uuid4().hex[:10]}"})
        producer.init_transactions(30)
        _local.producer = producer
    return producer


def _keys(n: int) -> list[str]:
    return [uuid.uuid4().hex for _ in range(n)]


@csrf_exempt
def nonatomic(request: HttpRequest, n: int) -> HttpResponse:
    ks = _keys(n)
    with transaction.atomic():
        for k in ks:
            BenchOrder.objects.create(id=k, payload="x")
    producer = _plain()
    producer.begin_transaction()
    for k in ks:
        producer.produce(TOPIC, key=k, value=b"x")
    producer.commit_transaction(30)
    return HttpResponse(status=201)


@csrf_exempt
def dual(request: HttpRequest, n: int) -> HttpResponse:
    ks = _keys(n)
    with dual_write() as tx:
        for k in ks:
            BenchOrder.objects.create(id=k, payload="x")
        for k in ks:
            tx.produce(TOPIC, key=k, value=b"x")
    return HttpResponse(status=201)


urlpatterns = [path("nonatomic/<int:n>", nonatomic), path("dual/<int:n>", dual)]
application = get_wsgi_application()
