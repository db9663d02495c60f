"""A pytest plugin (tools/upstream_tests.sh loads it with -p) that lets upstream Horovod's
elastic integration tests (test/integration/test_elastic_torch.py with elastic_common.py)
drive our ``horovodrun``, unmodified.

Those tests build a ``horovodrun`` command line, then call upstream's launcher in process
(``horovod.runner.launch.parse_args`` and ``_run_elastic``) with module constants patched
by ``mock``. Here the same command line runs as our ``horovodrun`` in a child process:

- ``horovod.runner.launch._run_elastic(args)`` runs ``horovodrun`` with ``sys.argv``
  (what the test set) and raises RuntimeError with the launcher's last output lines when
  the job fails, as upstream's raises with its error message;
- ``horovod.runner.elastic.driver.ELASTIC_TIMEOUT_SECS``, when a test patches it, becomes
  ``--elastic-timeout``;
- the other patched names (``DISCOVER_HOSTS_FREQUENCY_SECS``,
  ``horovod.runner.gloo_run._get_min_start_hosts``) are tuning of upstream's own driver
  with no counterpart to set: they exist here so that ``mock.patch`` finds them;
- ``horovod.runner.elastic.constants.RESET_LIMIT_EXCEEDED_MESSAGE`` and
  ``config_parser.set_env_from_args`` are our message and a no-op (horovodrun reads its
  own arguments).
"""
import os
import subprocess
import sys
import types

import horovod.runner
import horovod.runner.launch
from horovod_torch.runner import discovery, elastic_driver

DEFAULT_ELASTIC_TIMEOUT_S = 600


def _module(name, **attrs):
    """Registers module ``name`` (its parents must exist) with ``attrs``."""
    mod = sys.modules.get(name) or types.ModuleType(name)
    for key, value in attrs.items():
        setattr(mod, key, value)
    sys.modules[name] = mod
    parent, _, leaf = name.rpartition(".")
    setattr(sys.modules[parent], leaf, mod)
    return mod


def _run_elastic(args):
    del args  # parsed by the test with our parse_args; the child parses sys.argv again
    argv = sys.argv[1:]
    timeout = sys.modules["horovod.runner.elastic.driver"].ELASTIC_TIMEOUT_SECS
    if timeout != DEFAULT_ELASTIC_TIMEOUT_S and "--elastic-timeout" not in argv:
        argv = ["--elastic-timeout", str(timeout)] + argv
    env = dict(os.environ)
    # The command names "python": make it this interpreter.
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    proc = subprocess.run([sys.executable, "-m", "horovod_torch.runner.launch", *argv], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=600)
    print(proc.stdout)
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-40:])
        raise RuntimeError(f"horovodrun exited {proc.returncode}:\n{tail}")


_module("horovod.runner.common")
_module("horovod.runner.common.util")
_module("horovod.runner.common.util.config_parser",
        set_env_from_args=lambda env, args: env)
_module("horovod.runner.elastic")
_module("horovod.runner.elastic.constants",
        RESET_LIMIT_EXCEEDED_MESSAGE=elastic_driver.RESET_LIMIT_EXCEEDED_MESSAGE)
_module("horovod.runner.elastic.driver", ELASTIC_TIMEOUT_SECS=DEFAULT_ELASTIC_TIMEOUT_S,
        DISCOVER_HOSTS_FREQUENCY_SECS=discovery.DISCOVERY_PERIOD_S)
_module("horovod.runner.gloo_run", _get_min_start_hosts=lambda settings: 1)
horovod.runner.launch._run_elastic = _run_elastic
