"""The repository under test: its root, and tools/checkout.py (which engram_stream the tests and
their subprocesses import; conftest.py applies its choice before anything imports the package)."""
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load_checkout():
    """tools/checkout.py by its path (it does not import engram_stream; tools/ is no package)."""
    spec = importlib.util.spec_from_file_location("engram_checkout", os.path.join(ROOT, "tools", "checkout.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


checkout = _load_checkout()
