"""The order service's own tests: Django's ``TestCase`` and test client, a real broker, the shipped helper.

``python manage.py test orders`` with ``ORDERS_DB`` on PostgreSQL or MariaDB (on SQLite, use
``TransactionTestCase``: see the guide's "Testing your views") and ``KAFKA_BOOTSTRAP_SERVERS`` naming a
broker with two-phase commit.  :class:`DualWriteTestMixin` gives each test a pool of its own and closes
it after the test's rollback.  The view's ``dual_write()`` then runs in the test's transaction: the row
is rolled back with the test, the event is committed in Kafka.
"""

from __future__ import annotations

import json

from django.conf import settings
from django.test import TestCase, override_settings
from kafka2pc.recipes.django.testing import DualWriteTestMixin

from kafka2pc.testing import create_topic, drain

from .models import Order


class OrderViewTests(DualWriteTestMixin, TestCase):
    topic: str

    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        cls.topic = create_topic(settings.KAFKA2PC["PRODUCER"]["bootstrap.servers"], partitions=1)
        cls.enterClassContext(override_settings(ORDERS_TOPIC=cls.topic))

    def _events(self) -> list[dict[str, object]]:
        records = drain(settings.KAFKA2PC["PRODUCER"]["bootstrap.servers"], self.topic, "read_committed")
        return [json.loads(r.value) for r in records if r.value]

    def _post(self, order_id: str) -> int:
        body = {"id": order_id, "item": "book", "quantity": 2}
        return self.client.post("/orders", body, content_type="application/json").status_code

    def test_post_commits_the_order_and_its_event(self) -> None:
        self.assertEqual(self._post("o-1"), 201)
        self.assertEqual(list(Order.objects.values_list("id", flat=True)), ["o-1"])
        self.assertIn({"type": "OrderPlaced", "id": "o-1", "item": "book", "quantity": 2}, self._events())

    def test_a_duplicate_order_is_409_and_publishes_nothing(self) -> None:
        Order.objects.create(id="o-2", item="pen", quantity=1)
        self.assertEqual(self._post("o-2"), 409)
        self.assertEqual(Order.objects.get(id="o-2").item, "pen")
        self.assertNotIn("o-2", [e["id"] for e in self._events()])
