"""``horovodrun``, ``horovod.runner.run`` and friends against Horovod's interface: every
option of Horovod's horovodrun is accepted, with its meaning or a one-line notice;
abbreviations; --config-file; the elastic launcher's messages; ``horovod.run``;
``python -m horovod.runner.launch``; ``horovod.runner.util.threads.in_thread``.

Parsing tests call the parser in process; the others start real jobs (plain Python
workers, except where ``horovod.run`` initialises horovod) with timeouts.
"""
from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Dict, List

import pytest

from horovod_torch.runner import launch, options
from tests.harness import ROOT

PY = sys.executable
TIMEOUT = 180

# The option strings of Horovod's horovodrun (horovod/runner/launch.py, parse_args, at
# horovod/horovod 2626dc87): data to check our parser against.
UPSTREAM_OPTIONS = [
    "-v", "--version", "-np", "--num-proc", "-cb", "--check-build", "--disable-cache",
    "--start-timeout", "--network-interfaces", "--network-interface", "--output-filename",
    "--verbose", "--config-file", "-p", "--ssh-port", "-i", "--ssh-identity-file",
    "--fusion-threshold-mb", "--cycle-time-ms", "--cache-capacity",
    "--hierarchical-allreduce", "--no-hierarchical-allreduce", "--hierarchical-allgather",
    "--no-hierarchical-allgather", "--torus-allreduce", "--no-torus-allreduce",
    "--autotune", "--no-autotune", "--autotune-log-file", "--autotune-warmup-samples",
    "--autotune-steps-per-sample", "--autotune-bayes-opt-max-samples",
    "--autotune-gaussian-process-noise", "--min-np", "--min-num-proc", "--max-np",
    "--max-num-proc", "--slots-per-host", "--elastic-timeout", "--reset-limit",
    "--blacklist-cooldown-range", "--timeline-filename", "--timeline-mark-cycles",
    "--no-timeline-mark-cycles", "--no-stall-check", "--stall-check",
    "--stall-check-warning-time-seconds", "--stall-check-shutdown-time-seconds",
    "--mpi-threads-disable", "--no-mpi-threads-disable", "--mpi-args", "--tcp",
    "--binding-args", "--num-nccl-streams", "--thread-affinity", "--gloo-timeout-seconds",
    "--log-level", "--log-with-timestamp", "--log-without-timestamp", "-prefix-timestamp",
    "--prefix-output-with-timestamp", "--log-hide-timestamp", "--no-log-hide-timestamp",
    "-H", "--hosts", "-hostfile", "--hostfile", "--host-discovery-script", "--gloo",
    "--mpi", "--jsrun",
]


def _env(**extra: str) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HOROVOD_", "OMPI_", "SLURM_"))}
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def _run(cmd: List[str], timeout: float = TIMEOUT, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(**extra), cwd=ROOT,
                          timeout=timeout)


def _horovodrun(*args: str, **extra: str) -> subprocess.CompletedProcess:
    return _run([PY, "-m", "horovod_torch.runner", *args], **extra)


def _worker(script: str) -> List[str]:
    return [PY, "-c", textwrap.dedent(script)]


@pytest.fixture(name="files")
def _files(tmp_path: Path) -> Dict[str, str]:
    """Files some options need: a key, a host file, a discovery script, a config."""
    key = tmp_path / "id_test"
    key.write_text("not a real key\n")
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n")
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost:2\n")
    script.chmod(0o755)
    config = tmp_path / "config.yaml"
    config.write_text("params:\n  fusion_threshold_mb: 32\n")
    return {"key": str(key), "hostfile": str(hostfile), "script": str(script),
            "config": str(config), "dir": str(tmp_path / "out")}


def _values(option: str, files: Dict[str, str]) -> List[str]:
    """A command-line value for ``option`` (none for switches)."""
    numbers = {"-np": "2", "--num-proc": "2", "--start-timeout": "10", "-p": "2222",
               "--ssh-port": "2222", "--fusion-threshold-mb": "4", "--cycle-time-ms": "2.5",
               "--cache-capacity": "64", "--autotune-warmup-samples": "1",
               "--autotune-steps-per-sample": "5", "--autotune-bayes-opt-max-samples": "7",
               "--autotune-gaussian-process-noise": "0.5", "--min-np": "1",
               "--min-num-proc": "1", "--max-np": "2", "--max-num-proc": "2",
               "--slots-per-host": "2", "--elastic-timeout": "30", "--reset-limit": "3",
               "--stall-check-warning-time-seconds": "20",
               "--stall-check-shutdown-time-seconds": "40", "--num-nccl-streams": "2",
               "--thread-affinity": "1", "--gloo-timeout-seconds": "45"}
    if option in numbers:
        return [numbers[option]]
    others = {"--network-interfaces": ["lo"], "--network-interface": ["lo"],
              "--output-filename": [files["dir"]], "--config-file": [files["config"]],
              "-i": [files["key"]], "--ssh-identity-file": [files["key"]],
              "--autotune-log-file": ["tune.csv"], "--timeline-filename": ["t.json"],
              "--blacklist-cooldown-range": ["1", "2"], "--mpi-args": ["--mca btl self,tcp"],
              "--binding-args": ["--bind-to core"], "--log-level": ["info"],
              "-H": ["localhost:2"], "--hosts": ["localhost:2"],
              "-hostfile": [files["hostfile"]], "--hostfile": [files["hostfile"]],
              "--host-discovery-script": [files["script"]]}
    return others.get(option, [])


# -- every option of Horovod's horovodrun -------------------------------------

def test_upstream_option_list_is_complete() -> None:
    assert len(UPSTREAM_OPTIONS) == len(set(UPSTREAM_OPTIONS)) == 71


def test_upstream_list_matches_a_horovod_checkout() -> None:
    """With HOROVOD_UPSTREAM (a horovod checkout or bare mirror, as for
    tools/upstream_tests.sh): read the option strings of its parser and compare."""
    where = os.environ.get("HOROVOD_UPSTREAM")
    if not where:
        pytest.skip("HOROVOD_UPSTREAM is not set")
    path = Path(where, "horovod", "runner", "launch.py")
    if path.exists():
        source = path.read_text()
    else:
        source = subprocess.run(["git", "--git-dir", where, "show",
                                 "HEAD:horovod/runner/launch.py"], capture_output=True,
                                text=True, check=True, timeout=60).stdout
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            found.update(a.value for a in node.args if isinstance(a, ast.Constant)
                         and isinstance(a.value, str) and a.value.startswith("-"))
    assert found, "no add_argument calls found"
    ours = set(options.make_parser()._option_string_actions)  # pylint: disable=protected-access
    assert found - ours == set(), "Horovod options we lack"
    assert found - set(UPSTREAM_OPTIONS) == set(), "UPSTREAM_OPTIONS is out of date"


@pytest.mark.parametrize("option", [o for o in UPSTREAM_OPTIONS if o not in ("-v", "--version")])
def test_every_upstream_option_is_accepted(option: str, files: Dict[str, str],
                                           capsys: pytest.CaptureFixture) -> None:
    argv = ["-np", "2", option, *_values(option, files), "python", "train.py", "--lr", "1"]
    args = launch.parse_args(argv)
    assert args.command == ["python", "train.py", "--lr", "1"]
    err = capsys.readouterr().err
    assert len(err.splitlines()) <= 1, err  # at most one notice


def test_version(capsys: pytest.CaptureFixture) -> None:
    """Our version first (what a script parses), then the Horovod API level it
    implements (horovod.__version__)."""
    import horovod
    import horovod_torch
    want = (f"{horovod_torch.__version__} (horovod_torch; implements the Horovod "
            f"{horovod.__version__} API)")
    for option in ("-v", "--version", "--vers"):
        with pytest.raises(SystemExit) as exit_info:
            launch.parse_args([option])
        assert exit_info.value.code == 0
        assert capsys.readouterr().out.strip() == want
    result = _horovodrun("--version", timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == want


# Option -> the variables it sets for the workers (Horovod's config_parser rules).
KNOB_ENV = [
    (["--fusion-threshold-mb", "4"], {"HOROVOD_FUSION_THRESHOLD": str(4 * 1024 * 1024)}),
    (["--cycle-time-ms", "2.5"], {"HOROVOD_CYCLE_TIME": "2.5"}),
    (["--cache-capacity", "64"], {"HOROVOD_CACHE_CAPACITY": "64"}),
    (["--hierarchical-allreduce"], {"HOROVOD_HIERARCHICAL_ALLREDUCE": "1"}),
    (["--no-hierarchical-allreduce"], {"HOROVOD_HIERARCHICAL_ALLREDUCE": "0"}),
    (["--hierarchical-allgather"], {"HOROVOD_HIERARCHICAL_ALLGATHER": "1"}),
    (["--no-hierarchical-allgather"], {"HOROVOD_HIERARCHICAL_ALLGATHER": "0"}),
    (["--torus-allreduce"], {"HOROVOD_TORUS_ALLREDUCE": "1"}),
    (["--no-torus-allreduce"], {"HOROVOD_TORUS_ALLREDUCE": "0"}),
    (["--autotune"], {"HOROVOD_AUTOTUNE": "1"}),
    (["--no-autotune"], {"HOROVOD_AUTOTUNE": "0"}),
    (["--autotune-log-file", "a.csv"], {"HOROVOD_AUTOTUNE_LOG": "a.csv"}),
    (["--autotune-warmup-samples", "1"], {"HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "1"}),
    (["--autotune-steps-per-sample", "5"], {"HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "5"}),
    (["--autotune-bayes-opt-max-samples", "7"], {"HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "7"}),
    (["--autotune-gaussian-process-noise", "0.5"],
     {"HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "0.5"}),
    (["--timeline-filename", "t.json"], {"HOROVOD_TIMELINE": "t.json"}),
    (["--timeline-mark-cycles"], {"HOROVOD_TIMELINE_MARK_CYCLES": "1"}),
    (["--no-timeline-mark-cycles"], {"HOROVOD_TIMELINE_MARK_CYCLES": "0"}),
    (["--no-stall-check"], {"HOROVOD_STALL_CHECK_DISABLE": "1"}),
    (["--stall-check"], {"HOROVOD_STALL_CHECK_DISABLE": "0"}),
    (["--stall-check-warning-time-seconds", "20"], {"HOROVOD_STALL_CHECK_TIME_SECONDS": "20.0"}),
    (["--stall-check-shutdown-time-seconds", "40"],
     {"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "40.0"}),
    (["--mpi-threads-disable"], {"HOROVOD_MPI_THREADS_DISABLE": "1"}),
    (["--no-mpi-threads-disable"], {"HOROVOD_MPI_THREADS_DISABLE": "0"}),
    (["--num-nccl-streams", "2"], {"HOROVOD_NUM_NCCL_STREAMS": "2"}),
    (["--thread-affinity", "1"], {"HOROVOD_THREAD_AFFINITY": "1"}),
    (["--gloo-timeout-seconds", "45"], {"HOROVOD_GLOO_TIMEOUT_SECONDS": "45"}),
    (["--tcp"], {"NCCL_IB_DISABLE": "1"}),
    (["--log-level", "info"], {"HOROVOD_LOG_LEVEL": "INFO"}),
    (["--log-without-timestamp"], {"HOROVOD_LOG_HIDE_TIME": "1"}),
    (["--log-hide-timestamp"], {"HOROVOD_LOG_HIDE_TIME": "1"}),
    (["--log-with-timestamp"], {"HOROVOD_LOG_HIDE_TIME": "0"}),
    (["--no-log-hide-timestamp"], {"HOROVOD_LOG_HIDE_TIME": "0"}),
    ([], {}),
]


@pytest.mark.parametrize("flags, expected", KNOB_ENV, ids=lambda v: " ".join(v)
                         if isinstance(v, list) else None)
def test_knob_options_set_horovods_variables(flags: List[str],
                                             expected: Dict[str, str]) -> None:
    args = launch.parse_args(["-np", "1", *flags, "true"])
    assert options.knob_env(args) == expected


def test_last_switch_wins_and_aliases() -> None:
    args = launch.parse_args(["-np", "1", "--autotune", "--no-autotune",
                              "--stall-check-time-seconds", "5",
                              "--stall-shutdown-time-seconds", "9", "true"])
    env = options.knob_env(args)
    assert env == {"HOROVOD_AUTOTUNE": "0", "HOROVOD_STALL_CHECK_TIME_SECONDS": "5.0",
                   "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "9.0"}


def test_other_upstream_options_keep_their_meaning(files: Dict[str, str]) -> None:
    args = launch.parse_args(["-np", "2", "-p", "2200", "-i", files["key"], "-hostfile",
                              files["hostfile"], "--network-interface", "lo",
                              "--network-interfaces", "lo", "true"])
    assert (args.ssh_port, args.ssh_identity_file) == (2200, files["key"])
    assert [h.hostname for h in args.host_list] == ["localhost"]
    assert args.nic_list == ["lo"]
    args = launch.parse_args(["-np", "2", "--min-num-proc", "1", "--max-num-proc", "3",
                              "--slots-per-host", "2", "--host-discovery-script",
                              files["script"], "true"])
    assert (args.min_np, args.max_np, args.slots_per_host) == (1, 3, 2)
    args = launch.parse_args(["-cb"])
    assert args.check_build
    args = launch.parse_args(["-np", "1", "-prefix-timestamp", "--output-filename", "d",
                              "true"])
    assert args.prefix_timestamp and args.output_filename == "d"


@pytest.mark.parametrize("argv, notice", [
    (["--jsrun"], "horovodrun: --jsrun has no effect in horovod_torch: "),
    (["--disable-cache"], "horovodrun: --disable-cache has no effect in horovod_torch: "),
    (["--binding-args", "--bind-to core"], "horovodrun: --binding-args has no effect in "),
    (["--max-np", "4"], "horovodrun: --max-np has no effect in horovod_torch: "),
    (["--num-nccl-streams", "2"], "horovodrun: --num-nccl-streams has no effect in "),
])
def test_options_without_effect_say_so_once(argv: List[str], notice: str,
                                            capsys: pytest.CaptureFixture) -> None:
    args = launch.parse_args(["-np", "1", *argv, "true"])
    assert args.command == ["true"]
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(notice), err


@pytest.mark.parametrize("argv, error", [
    (["--min-np", "0"], "--min-np must be >= 1, got 0"),
    (["--min-np", "1", "--max-np", "0"], "--max-np must be >= 1, got 0"),
    (["--min-np", "1", "--reset-limit", "-1"], "--reset-limit must be >= 0, got -1"),
    (["--min-np", "1", "--elastic-timeout", "-5"], "--elastic-timeout must be > 0 seconds, got -5"),
])
def test_bad_elastic_values_are_errors(argv: List[str], error: str) -> None:
    """Before: accepted (--elastic-timeout -5 then said "only 0 slots were discovered")."""
    with pytest.raises(ValueError, match=re.escape(error)):
        launch.parse_args(["-np", "1", *argv, "true"], raise_errors=True)


def test_conflicting_controllers_are_an_error() -> None:
    with pytest.raises(ValueError, match="at most one of --gloo, --mpi and --jsrun"):
        launch.parse_args(["-np", "1", "--gloo", "--mpi", "true"], raise_errors=True)


# -- abbreviations --------------------------------------------------------------

def _unambiguous_prefixes() -> List[tuple]:
    """(prefix, option) for each prefix of one of Horovod's long options that no
    other option of Horovod's starts with (as Horovod's argparse accepts them)."""
    long_options = [o for o in UPSTREAM_OPTIONS if o.startswith("--")]
    cases = []
    for option in long_options:
        for end in range(3, len(option)):
            prefix = option[:end]
            if [o for o in long_options if o.startswith(prefix)] == [option]:
                cases.append((prefix, option))
    return cases


def test_abbreviations_of_upstream_options(files: Dict[str, str],
                                           capsys: pytest.CaptureFixture) -> None:
    cases = _unambiguous_prefixes()
    assert len(cases) > 500
    for prefix, option in cases:
        if option in ("--version",):
            continue
        values = _values(option, files)
        tail = ["python", "train.py"]
        full = vars(launch.parse_args(["-np", "2", option, *values, *tail]))
        short = vars(launch.parse_args(["-np", "2", prefix, *values, *tail]))
        assert short == full, (prefix, option)
    capsys.readouterr()


def test_abbreviations_that_would_clash_with_our_own_options() -> None:
    # --disable: Horovod's --disable-cache (ours also has --disable-prefix);
    # --min: --min-np and --min-num-proc are one option.
    args = launch.parse_args(["-np", "2", "--disable", "--min", "1", "--sl", "2", "true"])
    assert args.disable_cache and not args.disable_prefix
    assert args.min_np == 1 and args.slots_per_host == 2
    args = launch.parse_args(["-np", "1", "--disable-p", "true"])
    assert args.disable_prefix and not args.disable_cache
    with pytest.raises(ValueError, match="ambiguous option: --hier"):
        launch.parse_args(["-np", "1", "--hier", "true"], raise_errors=True)


def test_worker_options_are_never_ours() -> None:
    """After the command starts, nothing is parsed: not ambiguous abbreviations of
    our options (--hier, --timeline), nor our own options, nor --."""
    tail = ["python", "train.py", "--hier", "--timeline", "-np", "9", "--mpi", "--", "x"]
    args = launch.parse_args(["-np", "2", *tail])
    assert args.command == tail and args.num_proc == 2 and not args.use_mpi
    args = launch.parse_args(["-np", "2", "--", "-weird-program", "--min"])
    assert args.command == ["-weird-program", "--min"]
    args = launch.parse_args(["-np=2", "--fusion-threshold-mb=3", "--mpi-args=-x FOO", "true"])
    assert args.num_proc == 2 and args.mpi_args == "-x FOO" and args.command == ["true"]


# -- --config-file ----------------------------------------------------------------

CONFIG = """\
controller: gloo
params:
  fusion_threshold_mb: 32
  cycle_time_ms: 10
  cache_capacity: 2048
  hierarchical_allreduce: true
  hierarchical_allgather: false
autotune:
  enabled: true
  log_file: tune.csv
  warmup_samples: 5
  steps_per_sample: 20
  bayes_opt_max_samples: 50
  gaussian_process_noise: 0.9
timeline:
  filename: timeline.json
  mark_cycles: true
stall_check:
  enabled: false
  warning_time_seconds: 120
  shutdown_time_seconds: 240
library_options:
  mpi_threads_disable: true
  num_nccl_streams: 2
  thread_affinity: 1
  gloo_timeout_seconds: 60
logging:
  level: info
  with_timestamp: false
"""


def test_config_file(tmp_path: Path) -> None:
    path = tmp_path / "horovod.yaml"
    path.write_text(CONFIG)
    args = launch.parse_args(["-np", "1", "--config-file", str(path), "true"])
    assert args.use_gloo and not args.use_mpi
    assert options.knob_env(args) == {
        "HOROVOD_FUSION_THRESHOLD": str(32 * 1024 * 1024), "HOROVOD_CYCLE_TIME": "10.0",
        "HOROVOD_CACHE_CAPACITY": "2048", "HOROVOD_HIERARCHICAL_ALLREDUCE": "1",
        "HOROVOD_HIERARCHICAL_ALLGATHER": "0", "HOROVOD_AUTOTUNE": "1",
        "HOROVOD_AUTOTUNE_LOG": "tune.csv", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "5",
        "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "20",
        "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "50",
        "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "0.9", "HOROVOD_TIMELINE": "timeline.json",
        "HOROVOD_TIMELINE_MARK_CYCLES": "1", "HOROVOD_STALL_CHECK_DISABLE": "1",
        "HOROVOD_STALL_CHECK_TIME_SECONDS": "120.0",
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "240.0", "HOROVOD_MPI_THREADS_DISABLE": "1",
        "HOROVOD_NUM_NCCL_STREAMS": "2", "HOROVOD_THREAD_AFFINITY": "1",
        "HOROVOD_GLOO_TIMEOUT_SECONDS": "60", "HOROVOD_LOG_LEVEL": "INFO",
        "HOROVOD_LOG_HIDE_TIME": "1"}
    # Options on the command line win, before or after --config-file.
    args = launch.parse_args(["-np", "1", "--fusion-threshold-mb", "8", "--config-file",
                              str(path), "--stall-check", "--log-level", "error", "--mpi",
                              "true"])
    env = options.knob_env(args)
    assert env["HOROVOD_FUSION_THRESHOLD"] == str(8 * 1024 * 1024)
    assert env["HOROVOD_STALL_CHECK_DISABLE"] == "0"
    assert env["HOROVOD_LOG_LEVEL"] == "ERROR"
    assert args.use_mpi and not args.use_gloo


@pytest.mark.parametrize("text, needle", [
    ("controller: smoke\n", "no such controller"),
    ("params:\n  cache_capacity: many\n", "params.cache_capacity 'many' is not an integer"),
    ("params:\n  cycle_time_ms: -1\n", "--cycle-time-ms must be >= 0"),
    ("autotune:\n  gaussian_process_noise: 2\n", "must be in [0, 1]"),
    ("logging:\n  level: loud\n", "logging.level 'loud' is not one of"),
    ("params: [1, 2\n", "is not valid YAML"),
])
def test_config_file_errors(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        launch.parse_args(["-np", "1", "--config-file", str(path), "true"], raise_errors=True)
    assert needle in str(info.value)


def test_config_file_unknown_keys_and_missing_file(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "extra.yaml"
    path.write_text("params:\n  fusion_threshold_mb: 1\n  warp_speed: 9\nsurprise: {}\n")
    launch.parse_args(["-np", "1", "--config-file", str(path), "true"])
    assert "ignoring unknown setting(s): params.warp_speed, surprise" in capsys.readouterr().err
    with pytest.raises(ValueError, match="cannot read --config-file"):
        launch.parse_args(["-np", "1", "--config-file", str(tmp_path / "none.yaml"), "true"],
                          raise_errors=True)


def test_config_file_without_pyyaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("params:\n  cache_capacity: 1\n")
    monkeypatch.setitem(sys.modules, "yaml", None)  # import yaml raises ImportError
    with pytest.raises(ValueError, match=r"--config-file .* needs the pyyaml package, which "
                       r"is not installed: pip install 'horovod_torch\[config\]'"):
        launch.parse_args(["-np", "1", "--config-file", str(path), "true"], raise_errors=True)


ENV_DUMP = """
    import json, os
    print(json.dumps({k: v for k, v in os.environ.items()
                      if k.startswith(("HOROVOD_", "NCCL_"))}))
"""


def _env_by_rank(stdout: str) -> Dict[int, Dict[str, str]]:
    found = {}
    for line in stdout.splitlines():
        match = re.match(r"^\[(\d+)\]<stdout>:(\{.*\})$", line)
        if match:
            found[int(match.group(1))] = json.loads(match.group(2))
    return found


def test_config_file_and_upstream_options_reach_the_workers(tmp_path: Path) -> None:
    path = tmp_path / "horovod.yaml"
    path.write_text("params:\n  cache_capacity: 77\nlogging:\n  with_timestamp: false\n")
    result = _horovodrun("-np", "2", "--config-file", str(path), "--no-stall-check",
                         "--num-nccl-streams", "3", "--tcp", "--gloo",
                         *_worker(ENV_DUMP))
    assert result.returncode == 0, result.stderr
    envs = _env_by_rank(result.stdout)
    assert sorted(envs) == [0, 1], result.stdout
    for env in envs.values():
        assert env["HOROVOD_CACHE_CAPACITY"] == "77"
        assert env["HOROVOD_LOG_HIDE_TIME"] == "1"
        assert env["HOROVOD_STALL_CHECK_DISABLE"] == "1"
        assert env["HOROVOD_NUM_NCCL_STREAMS"] == "3"
        assert env["NCCL_IB_DISABLE"] == "1"
        assert env["HOROVOD_CONTROLLER"] == "tcp"


# -- output options -------------------------------------------------------------------

def test_output_filename_and_timestamps(tmp_path: Path) -> None:
    out = tmp_path / "logs"
    result = _horovodrun("-np", "2", "--output-filename", str(out),
                         "--prefix-output-with-timestamp", *_worker("""
        import os, sys
        print("out of", os.environ["HOROVOD_RANK"])
        print("err of", os.environ["HOROVOD_RANK"], file=sys.stderr)
    """))
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        assert (out / f"rank.{rank}" / "stdout").read_text() == f"out of {rank}\n"
        assert (out / f"rank.{rank}" / "stderr").read_text() == f"err of {rank}\n"
        # Horovod's format: time.asctime(), then the usual prefix.
        assert re.search(rf"^\w{{3}} \w{{3}} [ \d]\d \d\d:\d\d:\d\d \d{{4}}\[{rank}\]<stdout>:"
                         rf"out of {rank}$", result.stdout, re.M), result.stdout


# -- elastic: Horovod's variables and messages ----------------------------------------

def test_elastic_workers_see_their_starting_rank() -> None:
    result = _horovodrun("-np", "2", "--min-np", "2", "--max-np", "2", "-H",
                         "localhost:1,127.0.0.1:1", *_worker(ENV_DUMP + "\n    import time\n"
                                                             "    time.sleep(1)\n"))
    assert result.returncode == 0, result.stderr
    envs = _env_by_rank(result.stdout)
    assert sorted(envs) == [0, 1], result.stdout
    for rank, env in envs.items():
        assert env["HOROVOD_ELASTIC"] == "1"
        assert (env["HOROVOD_RANK"], env["HOROVOD_SIZE"]) == (str(rank), "2")
        assert (env["HOROVOD_LOCAL_RANK"], env["HOROVOD_LOCAL_SIZE"]) == ("0", "1")
        assert (env["HOROVOD_CROSS_RANK"], env["HOROVOD_CROSS_SIZE"]) == (str(rank), "2")
        assert env["HOROVOD_HOSTNAME"] == ["localhost", "127.0.0.1"][rank]


def test_elastic_worker_exit_and_reset_limit_messages(files: Dict[str, str]) -> None:
    # Rank 1 fails once the job has formed: re-forming it would be a reset, and
    # --reset-limit 0 allows none (Horovod's meaning of 0).
    result = _horovodrun("-np", "2", "--min-np", "1", "--reset-limit", "0",
                         "--host-discovery-script", files["script"], *_worker("""
        import sys, time
        import horovod.torch as hvd
        hvd.init()
        if hvd.rank() == 1:
            sys.exit(3)
        time.sleep(60)
    """))
    assert result.returncode == 1, result.stderr
    assert "Process 1 exit with status code 3.\n" in result.stdout
    assert ("horovodrun: Horovod was shutdown because number of resets during elastic job "
            "exceeded limit: 0") in result.stderr


def test_elastic_job_whose_hosts_all_failed() -> None:
    result = _horovodrun("-np", "1", "--min-np", "1", *_worker("import sys; sys.exit(5)"))
    assert result.returncode == 1
    assert "Process 0 exit with status code 5." in result.stdout
    assert ("Horovod detected that one or more processes exited with non-zero status, thus "
            "causing the job to be terminated. The first process to do so was:\n"
            "Process name: localhost[0]\nExit code: 5") in result.stderr


# -- horovod.run and python -m horovod.runner.launch ------------------------------------

RUN_SCRIPT = """
    import json, os, sys
    import horovod
    from horovod.runner import run

    def train(base, scale=1):
        import horovod.torch as hvd
        hvd.init()
        return {"rank": hvd.rank(), "size": hvd.size(), "value": (base + hvd.rank()) * scale}

    class TrainingError(Exception):
        pass

    def fail_in_rank_1():
        if os.environ["HOROVOD_RANK"] == "1":
            raise TrainingError("rank 1 gave up")
        import time
        time.sleep(60)

    def env_rank_and_size():
        import time
        if os.environ["HOROVOD_RANK"] == "1":  # the last to finish still returns its value
            time.sleep(2)
        return int(os.environ["HOROVOD_RANK"]), int(os.environ["HOROVOD_SIZE"])

    assert horovod.run is run
    print("STATIC", json.dumps(run(train, args=(10,), kwargs={"scale": 2}, num_proc=2)))
    print("ELASTIC", json.dumps(horovod.run(env_rank_and_size, num_proc=2, min_num_proc=2,
                                            max_num_proc=2, hosts="localhost:2,127.0.0.1:2")))
    try:
        run(fail_in_rank_1, np=2)
    except TrainingError as exc:
        print("RAISED", json.dumps([str(exc), str(exc.__cause__)]))
    try:
        run(train, args=(1,), num_proc=0)
    except ValueError as exc:
        print("INVALID", str(exc))
"""


def test_horovod_run(tmp_path: Path) -> None:
    script = tmp_path / "use_run.py"
    script.write_text(textwrap.dedent(RUN_SCRIPT))
    result = _run([PY, str(script)], timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = {line.split(" ", 1)[0]: line.split(" ", 1)[1]
             for line in result.stdout.splitlines() if " " in line}
    assert json.loads(lines["STATIC"]) == [{"rank": 0, "size": 2, "value": 20},
                                           {"rank": 1, "size": 2, "value": 22}]
    assert json.loads(lines["ELASTIC"]) == [[0, 2], [1, 2]]
    message, cause = json.loads(lines["RAISED"])
    assert message == "rank 1 gave up"
    assert "the function raised in rank 1" in cause and "in fail_in_rank_1" in cause, cause
    assert "TrainingError: rank 1 gave up" in cause, cause
    assert "-np/--num-proc must be >= 1" in lines["INVALID"]


class SavedError(Exception):
    """What a worker raised, in the test below."""


def test_run_raises_the_error_written_under_a_later_number() -> None:
    """A rank takes its error's number, then writes the error. If it is stopped in
    between (another rank's error stopped the job), run() raises the error that was
    written, not a bare RuntimeError (before, it read only the first number)."""
    import pickle

    from horovod_torch import _C
    from horovod_torch.runner import func

    job = launch.parse_args(["-np", "2", "true"], raise_errors=True)
    server = _C.StoreServer("127.0.0.1", 0, "secret")
    try:
        assert server.add(func.KEY_ERRORS, 1) == 1  # rank 1's number; it was stopped
        assert server.add(func.KEY_ERRORS, 1) == 2  # rank 0's, and its error
        server.set(func.KEY_ERROR.format(seq=2), pickle.dumps({
            "rank": 0, "traceback": "Traceback: ...", "summary": "SavedError: lost",
            "exception": pickle.dumps(SavedError("lost"))}))
        with pytest.raises(SavedError, match="lost") as raised:
            func._results(server, job, 1)  # pylint: disable=protected-access
        assert "the function raised in rank 0" in str(raised.value.__cause__)
    finally:
        server.stop()


def test_python_m_horovod_runner_launch() -> None:
    result = _run([PY, "-W", "error::RuntimeWarning", "-m", "horovod.runner.launch", "-np",
                   "2", *_worker("import os; print('hello from', os.environ['HOROVOD_RANK'])")])
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == ["[0]<stdout>:hello from 0",
                                                  "[1]<stdout>:hello from 1"]
    result = _run([PY, "-m", "horovod.runner.launch", "-np", "1", *_worker(
        "import sys; sys.exit(7)")])
    assert result.returncode == 7


# -- horovod.runner.util.threads ----------------------------------------------------------

def test_in_thread() -> None:
    from horovod.runner.util.threads import in_thread, on_event

    got = []
    thread = in_thread(lambda a, b: got.append(a + b), args=(1, 2), name="adder")
    thread.join(10)
    assert got == [3] and thread.name == "adder" and thread.daemon
    assert not in_thread(time.sleep, args=(0,), daemon=False).daemon
    with pytest.raises(ValueError, match="must be a tuple"):
        in_thread(print, args=[1])

    def fail() -> None:
        raise RuntimeError("quiet")
    seen = []
    old_hook = threading.excepthook
    threading.excepthook = lambda hook_args: seen.append(hook_args.exc_value)
    try:
        in_thread(fail, silent=True).join(10)
        assert seen == []
        in_thread(fail).join(10)
        assert [str(e) for e in seen] == ["quiet"]
    finally:
        threading.excepthook = old_hook

    event, stop = threading.Event(), threading.Event()
    waiter = on_event(event, got.append, args=("fired",), stop=stop,
                      check_stop_interval_s=0.01)
    event.set()
    waiter.join(10)
    assert got[-1] == "fired"
    stopped = on_event(threading.Event(), got.append, args=("never",), stop=stop,
                       check_stop_interval_s=0.01)
    stop.set()
    stopped.join(10)
    assert not stopped.is_alive() and got[-1] == "fired"
