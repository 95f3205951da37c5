"""Imported by name in `test_ray_serve_units.py` (as a pipeline spec's module would be): notes
the thread that imported it."""

import threading

IMPORTED_IN = threading.current_thread()
