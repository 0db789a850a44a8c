#!/usr/bin/env python
"""The order service's Django command line: ``python manage.py migrate``, ``python manage.py kafka2pc_recover``."""

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "orders_project.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
