"""horovod_torch.launch_env: what each launcher's variables mean, read from a given
mapping (no processes; the launchers themselves run in test_foreign_launchers.py)."""
import pytest

from horovod_torch import launch_env


def test_no_launcher_is_a_world_of_one_with_defaults():
    env = launch_env.read({})
    assert env.placement is None and not env.has_store and not env.elastic
    assert (env.rendezvous_prefix, env.elastic_timeout_s) == ("job", 600)
    assert env.controller == "" and env.mpirun_size is None and not env.under_horovodrun


def test_horovodrun_wins_over_the_others_and_carries_its_store():
    env = launch_env.read({
        "HOROVOD_RANK": "3", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1",
        "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_CROSS_RANK": "1", "HOROVOD_CROSS_SIZE": "2",
        "HOROVOD_STORE_ADDR": "10.0.0.1", "HOROVOD_STORE_PORT": "4000", "HOROVOD_SECRET": "s",
        "RANK": "0", "WORLD_SIZE": "8", "OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "6",
        "HOROVOD_CONTROLLER": "GLOO"})
    p = env.placement
    assert (p.launcher, p.rank, p.size, p.local_rank, p.local_size, p.cross_rank,
            p.cross_size) == ("horovodrun", 3, 4, 1, 2, 1, 2)
    assert env.has_store and (env.store_host, env.store_port, env.secret) == ("10.0.0.1", 4000, "s")
    assert env.under_horovodrun and env.mpirun_size == 6 and env.controller == "gloo"


@pytest.mark.parametrize("variables, want", [
    ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
      "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"},
     ("mpirun", 5, 8, 1, 4, 1, 2)),
    ({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
      "GROUP_RANK": "1"}, ("torchrun", 5, 8, 1, 4, 1, 2)),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_NNODES": "2", "SLURM_LOCALID": "1",
      "SLURM_NODEID": "1"}, ("srun", 5, 8, 1, 4, 1, 2)),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_JOB_NUM_NODES": "2"},
     ("srun", 5, 8, 1, 4, 1, 2)),  # local rank and node derived
])
def test_each_launcher_gives_the_same_placement(variables, want):
    p = launch_env.read(variables).placement
    assert (p.launcher, p.rank, p.size, p.local_rank, p.local_size, p.cross_rank,
            p.cross_size) == want


def test_torchrun_without_world_size_is_no_launcher():
    assert launch_env.read({"RANK": "0"}).placement is None


@pytest.mark.parametrize("variables, name", [
    ({"HOROVOD_RANK": "x", "HOROVOD_SIZE": "2"}, "HOROVOD_RANK"),
    ({"HOROVOD_STORE_PORT": "80a"}, "HOROVOD_STORE_PORT"),
    ({"MASTER_PORT": "port"}, "MASTER_PORT"),
    ({"HOROVOD_ELASTIC_TIMEOUT": "soon"}, "HOROVOD_ELASTIC_TIMEOUT"),
])
def test_a_malformed_number_names_its_variable(variables, name):
    with pytest.raises(ValueError, match=name):
        launch_env.read(variables)


def test_horovod_rank_without_size_is_refused():
    with pytest.raises(ValueError, match="HOROVOD_SIZE is not"):
        launch_env.read({"HOROVOD_RANK": "0"})


def test_elastic_and_torchrun_settings():
    env = launch_env.read({
        "HOROVOD_ELASTIC": "1", "HOROVOD_ELASTIC_WORKER_ID": "h/2",
        "HOROVOD_ELASTIC_TIMEOUT": "12.5",
        "HOROVOD_RENDEZVOUS_PREFIX": "ray/call4", "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "2", "SLURM_JOB_ID": "77", "MASTER_ADDR": "m",
        "MASTER_PORT": "29500"})
    assert env.elastic and env.elastic_worker_id == "h/2"
    assert env.elastic_timeout_s == 12.5
    assert env.rendezvous_prefix == "ray/call4"
    assert env.torchrun_agent_store and env.torchrun_restart_count == "2"
    assert env.job_ids[0] == "77" and (env.master_addr, env.master_port) == ("m", 29500)


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), ("0", False),
                                       ("", False), ("False", False)])
def test_dynamic_process_sets(value, on):
    assert launch_env.dynamic_process_sets({"HOROVOD_DYNAMIC_PROCESS_SETS": value}) is on
    assert launch_env.dynamic_process_sets({}) is False
