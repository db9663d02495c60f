"""Fixtures for the Horovod compatibility suite (tests/compat).

The suite is written the way a Horovod user's own test suite is: every rank runs the
same pytest session under the launcher,

    horovodrun -np 2 python -m pytest tests/compat -q -p no:cacheprovider

and each test initialises Horovod itself and tears down with ``hvd.barrier();
hvd.shutdown()``. Outside a launcher (a plain ``pytest tests``) tests/conftest.py does
not collect them: tests/test_compat.py runs them under horovodrun.
"""
import os

import pytest

import horovod.torch as hvd

UNDER_LAUNCHER = os.environ.get("HOROVOD_RANK") not in (None, "")

if UNDER_LAUNCHER:
    # A test that fails on one rank only can leave the other waiting in a collective;
    # the stall inspector then fails the job's pending ops within seconds instead of the
    # run hanging until test_compat.py's timeout. Read at every hvd.init(). (Only under
    # the launcher: a plain `pytest tests` must not leak these into other tests.)
    os.environ.setdefault("HOROVOD_STALL_CHECK_TIME_SECONDS", "10")
    os.environ.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "30")


def _teardown() -> None:
    """hvd.barrier(); hvd.shutdown() -- the shutdown also when the barrier fails (a
    test that aborted the engine), so the next test starts from a clean slate."""
    if not hvd.is_initialized():
        return
    try:
        hvd.barrier()
    finally:
        hvd.shutdown()


@pytest.fixture
def initialized():
    """hvd.init() before the test, hvd.barrier(); hvd.shutdown() after it."""
    hvd.init()
    yield hvd
    _teardown()


@pytest.fixture
def teardown():
    """For tests that call hvd.init() themselves (with arguments, or after checking
    what happens before it): the same teardown as `initialized`."""
    yield
    _teardown()
