"""The Django project of the Django app's tests: one settings module, three databases, one model."""
