"""Imported at start-up by every Python process a test starts (conftest puts this folder on ``PYTHONPATH``): while a
test without the ``served`` marker runs, a server process it starts exits at once (``support.served_guard``)."""

import os

if os.environ.get("MOSSVL_TEST_WITHOUT_SERVED_MARKER"):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    try:
        from support import served_guard
    finally:
        sys.path.pop(0)
    served_guard.refuse_a_server_process()
    served_guard.refuse_sglang_child_processes()
