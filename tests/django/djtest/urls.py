from django.contrib import admin
from django.urls import path
from kafka2pc.recipes.django.health import pool_health

urlpatterns = [path("admin/", admin.site.urls), path("health/kafka2pc", pool_health)]
