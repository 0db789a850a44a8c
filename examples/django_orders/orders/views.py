"""``POST /orders``: the order row and its ``OrderPlaced`` event, committed together or not at all.

201: both are committed (with ``ORDERS_PIPELINED=1``: the row is, and the event is decided and
visible a moment later).  409: an order with that id exists (nothing written).  503: Kafka or the
pool could not serve the request within its bound (nothing written; retry).  400: bad input.
``GET /orders`` lists the ids (for the example's test), ``GET /health`` answers 200.
"""

from __future__ import annotations

import json
import logging

from django.conf import settings
from django.db import IntegrityError
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from kafka2pc.recipes.django import dual_write

from kafka2pc import Kafka2pcError

from .models import Order

logger = logging.getLogger(__name__)


@csrf_exempt
def orders(request: HttpRequest) -> HttpResponse:
    if request.method == "GET":
        return JsonResponse({"ids": sorted(Order.objects.values_list("id", flat=True))})
    if request.method != "POST":
        return JsonResponse({"error": "GET or POST"}, status=405)
    try:
        data = json.loads(request.body)
        order_id, item, quantity = str(data["id"]), str(data["item"]), int(data["quantity"])
    except (ValueError, KeyError, TypeError):
        return JsonResponse({"error": "expected JSON {id, item, quantity}"}, status=400)
    try:
        with dual_write() as tx:
            Order.objects.create(id=order_id, item=item, quantity=quantity)
            event = {"type": "OrderPlaced", "id": order_id, "item": item, "quantity": quantity}
            tx.produce(settings.ORDERS_TOPIC, key=order_id, value=json.dumps(event))
    except IntegrityError:
        return JsonResponse({"error": f"order {order_id} exists"}, status=409)
    except Kafka2pcError as exc:
        logger.warning("order %s not written: %s", order_id, exc)
        return JsonResponse({"error": f"{type(exc).__name__}: {exc}"}, status=503)
    return JsonResponse({"id": order_id}, status=201)


def health(request: HttpRequest) -> HttpResponse:
    return JsonResponse({"ok": True})
