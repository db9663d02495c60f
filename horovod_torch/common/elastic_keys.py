"""The store keys of the elastic protocol, written once for the driver and the workers.

The elastic driver (horovod_torch/runner/elastic_driver.py, part of the torch-free
launcher) and the workers (horovod_torch/common/elastic_worker.py, and
horovod_torch/integrations/ray/worker.py) talk only through the launcher's store. This module
names every key they use; it imports nothing, so the launcher may import it without
loading torch (it sits at the package's top level, not in horovod_torch/training/elastic/,
whose ``__init__`` imports torch). Values are ASCII bytes; nothing is ever deleted.

Every key, who writes it, who reads it, and its value:

``elastic/gen`` (:data:`GEN_KEY`)
    written by the driver, last of a generation's keys; read by the workers (``init()``
    waits for a newer one; rank 0's host-update poll). Value: the newest generation,
    decimal.
``elastic/<gen>/assign/<id>`` (:func:`assign_key`)
    written by the driver; read by worker ``<id>`` (``init()``; the Ray worker, for
    the rank it last had). Value: ``rank,size,local_rank,local_size,cross_rank,cross_size``.
``elastic/<gen>/added`` (:func:`added_key`)
    written by the driver; read by rank 0 (host-update poll). Value: ``1`` if
    generation ``<gen>`` brought in workers, else ``0``.
``elastic/<gen>/addr/<rank>`` (:func:`addr_key`; ``elastic/<gen>`` is
:func:`rendezvous_prefix`)
    written by each rank's engine at init (C++, csrc/transport/tcp_transport.cc, under
    the prefix the worker gives it); read by the other ranks (C++) and by the driver
    (did a worker that finished reach generation ``<gen>``?). Value:
    ``<IPv4 address>:<port>`` of that rank's mesh listener.
``elastic/<gen>/joined/<id>`` (:func:`joined_key`)
    written by worker ``<id>`` at ``init()`` when it takes its assignment in generation
    ``<gen>`` (it has left the one before); read by the driver: a removed worker is
    killed only a grace period after every member of a generation without it joined.
    Value: ``1``.
``elastic/ready/<id>`` (:func:`ready_key`)
    written by a new worker at its first ``init()``; read by the driver (only such a
    worker is put in a generation). Value: ``1``.
``elastic/commit`` (:data:`COMMIT_KEY`)
    written by rank 0 at each ``state.commit()``, after the commit's collective
    returned; read by every worker at ``state.sync()``. Value: ``N[ <json>]``: commit
    N, which every worker of the job saved, and the state's integer attributes in it.
``elastic/<gen>/failed`` (:func:`failed_key`)
    written by a worker of generation ``<gen>`` when a collective failed there
    (``HorovodInternalError``: a peer died or stopped answering); read by the driver.
    Value: the error's message (the last reporter's).
``elastic/<gen>/left/<id>`` (:func:`left_key`)
    written by worker ``<id>`` when it leaves generation ``<gen>`` to re-form the job (a
    failure, or a host update); read by the driver: once ``failed`` is written and no
    worker of the generation exited, the one live worker that never leaves is stopped or
    hung (it never exits either), and the driver kills it. Value: ``1``.
``elastic/<gen>/straggler`` (:func:`straggler_key`)
    written by rank 0 of generation ``<gen>`` under ``horovodrun --straggler-policy
    evict``, once, when the same rank has been named a straggler for the patience
    (hvd.straggler_report()); read by the driver, which evicts that rank's host. Value:
    ``<host>`` TAB the reason (one line).
``elastic/fatal`` (:data:`FATAL_KEY`)
    written by a worker when the job cannot go on (the committed state was lost); read
    by the driver when a worker exits non-zero: it then stops the job (status 1)
    instead of starting replacements. Value: the message.

``<gen>`` is a generation number (0, 1, ...), ``<id>`` a worker id ``<host>/<n>``
(``HOROVOD_ELASTIC_WORKER_ID``), ``<rank>`` a rank of generation ``<gen>``. The driver
writes a generation's ``assign`` and ``added`` keys before ``gen``, so a worker that
reads ``gen`` finds them. A worker left out of a newer generation was removed and exits.
The protocol itself: docs/design.md section 12.
"""

ROOT = "elastic"

GEN_KEY = f"{ROOT}/gen"
COMMIT_KEY = f"{ROOT}/commit"
FATAL_KEY = f"{ROOT}/fatal"


def ready_key(worker_id: str) -> str:
    """``elastic/ready/<worker_id>``: a new worker reached ``init()``."""
    return f"{ROOT}/ready/{worker_id}"


def rendezvous_prefix(gen: int) -> str:
    """``elastic/<gen>``: the store namespace of generation `gen` (the rendezvous
    prefix its workers give the engine, which writes ``<prefix>/addr/<rank>``)."""
    return f"{ROOT}/{gen}"


def assign_key(gen: int, worker_id: str) -> str:
    """``elastic/<gen>/assign/<worker_id>``: the worker's place in generation `gen`."""
    return f"{rendezvous_prefix(gen)}/assign/{worker_id}"


def added_key(gen: int) -> str:
    """``elastic/<gen>/added``: whether generation `gen` brought in workers."""
    return f"{rendezvous_prefix(gen)}/added"


def addr_key(gen: int, rank: int) -> str:
    """``elastic/<gen>/addr/<rank>``: the mesh address rank `rank` of generation `gen`
    published at its init (written by the engine: csrc/transport/tcp_transport.cc)."""
    return f"{rendezvous_prefix(gen)}/addr/{rank}"


def joined_key(gen: int, worker_id: str) -> str:
    """``elastic/<gen>/joined/<worker_id>``: that worker took its place in generation `gen`."""
    return f"{rendezvous_prefix(gen)}/joined/{worker_id}"


def init_error_key(gen: int) -> str:
    """``elastic/<gen>/init_error``: why generation `gen`'s rendezvous cannot complete
    (the driver writes it when a member died before reaching it; the engine watches
    it while it sets the mesh up: csrc/transport/tcp_transport.cc)."""
    return f"{rendezvous_prefix(gen)}/init_error"


def failed_key(gen: int) -> str:
    """``elastic/<gen>/failed``: a collective of generation `gen` failed."""
    return f"{rendezvous_prefix(gen)}/failed"


def left_key(gen: int, worker_id: str) -> str:
    """``elastic/<gen>/left/<worker_id>``: that worker left generation `gen` to re-form."""
    return f"{rendezvous_prefix(gen)}/left/{worker_id}"


def straggler_key(gen: int) -> str:
    """``elastic/<gen>/straggler``: rank 0 of generation `gen` asks to evict a host."""
    return f"{rendezvous_prefix(gen)}/straggler"
