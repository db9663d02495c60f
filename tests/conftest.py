import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pytest_ignore_collect(collection_path, config):
    """tests/compat is a Horovod user's suite: it runs on every rank of a job
    (tests/test_compat.py starts `horovodrun -np 2 python -m pytest tests/compat`), so a
    plain `pytest tests` does not collect it."""
    if collection_path.name == "compat" and not os.environ.get("HOROVOD_RANK"):
        return True
    return None
