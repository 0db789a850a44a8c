"""The WSGI application gunicorn serves (``gunicorn -c gunicorn.conf.py orders_project.wsgi``)."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "orders_project.settings")
application = get_wsgi_application()
