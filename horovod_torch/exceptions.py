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
