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


class CommittedStateLostError(RuntimeError):
    """Raised by ``state.sync()`` in an elastic job (on every worker of the new
    generation) when the job has committed before but no worker of the new
    generation holds the last commit: every worker that held it is gone (e.g. rank 0
    was killed while the only other worker, a replacement, had not synced yet).
    Training cannot resume without going back to some worker's initial state, so the
    job ends (horovodrun exits 1) instead of silently restarting from scratch.

    Not a HorovodInternalError: ``hvd.elastic.run`` does not catch it. ``commit`` is
    the number of the lost commit (commits counted from the job's start, 1 = the first
    ``state.commit()``); ``counters`` the state's integer attributes saved in it (e.g.
    ``{"epoch": 3, "batch": 120}``), when known.
    """

    def __init__(self, message: str, commit: int = 0, counters=None):
        super().__init__(message)
        self.commit = commit
        self.counters = dict(counters or {})


def get_version_mismatch_message(name: str, version: str, installed_version: str) -> str:
    return (f"Framework {name} installed with version {installed_version} but found version "
            f"{version}. This can result in unexpected behavior including runtime errors. "
            "Rebuild horovod_torch against the installed version (`make`).")


class HorovodVersionMismatchError(ImportError):
    """The framework found at run time is not the version horovod_torch was built
    against (so its extension may not load)."""

    def __init__(self, name: str, version: str, installed_version: str):
        super().__init__(get_version_mismatch_message(name, version, installed_version))
        self.name = name
        self.version = version
        self.installed_version = installed_version
