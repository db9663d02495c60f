"""``horovod.common`` for scripts written against Horovod: ``basics``, ``elastic``,
``exceptions``, ``process_sets`` and ``util``, each backed by horovod_torch."""
