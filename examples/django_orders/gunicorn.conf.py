"""gunicorn's configuration of the order service.

Run it (from this directory)::

    pip install 'kafka2pc[django,postgres]' gunicorn
    export ORDERS_DB=postgresql://app:app@localhost/app KAFKA_BOOTSTRAP_SERVERS=localhost:9092
    python manage.py migrate
    gunicorn -c gunicorn.conf.py orders_project.wsgi

    curl -X POST localhost:8000/orders -d '{"id": "o-1", "item": "book", "quantity": 2}'

Each worker process recovers at its start (``post_worker_init``: Django is set up by then) and
closes its pool when it exits; a worker killed with SIGKILL leaves its ids to the other workers,
which settle them once its leases expired (``ORDERS_LEASE_S``).
"""

import os

bind = os.environ.get("ORDERS_BIND", "127.0.0.1:8000")
workers = int(os.environ.get("ORDERS_WORKERS", "4"))
worker_class = "gthread"
threads = int(os.environ.get("ORDERS_THREADS", "4"))
# Above a request's bound (ORDERS_ACQUIRE_TIMEOUT_S + 2 * ORDERS_KAFKA_TIMEOUT_S, 15 s by default).
timeout = int(os.environ.get("ORDERS_WORKER_TIMEOUT", "60"))
graceful_timeout = 30


def post_worker_init(worker):  # type: ignore[no-untyped-def]
    from kafka2pc.recipes.django import recover

    for result in recover():
        worker.log.info("kafka2pc: settled %s (%s)", result.transactional_id,
                        result.settlement.plan.decision.value if result.settlement else "error")


def worker_exit(server, worker):  # type: ignore[no-untyped-def]
    from kafka2pc.recipes.django import close

    close(timeout=10)
