"""Exception types users catch, with Horovod's names and meanings."""


class HorovodInternalError(RuntimeError):
    """A collective failed because the job lost a peer or the engine stopped.

    Recoverable: elastic training (``hvd.elastic.run``) catches it, restores the last
    committed state and re-forms the job. Outside elastic mode, re-run the job.
    """


class HostsUpdatedInterrupt(RuntimeError):
    """Raised at ``state.commit()`` / ``check_host_updates()`` when hosts changed.

    ``skip_sync`` is True when hosts were only removed, so no state sync is needed.
    """

    def __init__(self, skip_sync: bool = False):
        super().__init__("the set of hosts changed")
        self.skip_sync = skip_sync
