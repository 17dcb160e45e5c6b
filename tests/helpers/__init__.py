"""The tests' helper library, one module a subject (conftest.py holds the fixtures and hooks).
tests/ is on sys.path (pytest puts conftest.py's folder there; a subprocess test puts it there
itself), so a test imports `from helpers.models import make_model`."""
