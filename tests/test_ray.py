"""horovod_torch.ray (``from horovod.ray import RayExecutor``) on a real local Ray:
static jobs (run, execute, execute_single, errors) and elastic ones (an actor killed
mid-training, a node of a ray.cluster_utils.Cluster removed and another added).

Ray starts once per module (about 10-15 s on 2 cores); every test has a watchdog
(faulthandler: a hung test prints its stacks and ends the run). Ray is told to use
127.0.0.1 (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0), so all traffic stays on loopback.
"""
import contextlib
import faulthandler
import glob
import os
import threading
import time

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before ray is imported
ray = pytest.importorskip("ray")

from horovod.ray import ElasticRayExecutor, RayExecutor  # noqa: E402
from tests import ray_workers  # noqa: E402

NUM_CPUS = 3


def timeout(seconds):
    """The test's time limit (the watchdog fixture enforces it)."""
    def mark(fn):
        fn.ray_timeout = seconds
        return fn
    return mark


@pytest.fixture(autouse=True)
def watchdog(request):
    """A test still running after its limit prints every thread's stack and ends
    the test run (exit 1) rather than hanging it."""
    faulthandler.dump_traceback_later(getattr(request.function, "ray_timeout", 120), exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="module")
def local_ray():
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=NUM_CPUS, include_dashboard=False)
    yield
    ray.shutdown()


def _local_sgd(steps):
    """What every worker's weights must be after `steps` averaged identical steps."""
    import torch
    model, x, y = ray_workers._model_and_data()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(steps):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    return [p.detach().flatten().tolist() for p in model.parameters()]


def _assert_weights(got, want):
    for g, w in zip(got, want):
        assert g == pytest.approx(w, rel=1e-5, abs=1e-6)


# -- static ---------------------------------------------------------------------------

class TestStatic:
    """Static jobs. Their executor (all the CPUs) is stopped before the elastic tests."""

    @pytest.fixture(scope="class")
    @classmethod
    def executor(cls, local_ray):
        """Three static workers (Counter executables), shared by the static tests."""
        ex = RayExecutor(RayExecutor.create_settings(timeout_s=120), num_workers=NUM_CPUS,
                         cpus_per_worker=1)
        ex.start(executable_cls=ray_workers.Counter, executable_args=[10])
        yield ex
        ex.shutdown()

    @timeout(150)
    def test_run_returns_rank_order_and_allreduce_is_correct(self, executor):
        results = executor.run(ray_workers.rank_size_sum, args=[2.0])
        assert [r[:2] for r in results] == [(0, 3), (1, 3), (2, 3)]
        assert [r[2:4] for r in results] == [(0, 3), (1, 3), (2, 3)]  # one node
        assert [r[4] for r in results] == [2.0 * (1 + 2 + 3)] * 3
        # kwargs too, and the same job again (the engine stays up between calls)
        again = executor.run(ray_workers.rank_size_sum, kwargs={"scale": 1})
        assert [r[4] for r in again] == [6.0] * 3
        # the actors have exactly what horovodrun gives a worker, secret included
        envs = executor.execute(lambda _: {k: v for k, v in os.environ.items()
                                           if k.startswith("HOROVOD_")})
        assert [e["HOROVOD_RANK"] for e in envs] == ["0", "1", "2"]
        assert {e["HOROVOD_SECRET"] for e in envs} != {""} and len({e["HOROVOD_SECRET"]
                                                                    for e in envs}) == 1
        assert {e["HOROVOD_STORE_ADDR"] for e in envs} == {"127.0.0.1"}

    @timeout(90)
    def test_execute_and_execute_single_use_the_workers_state(self, executor):
        # Counter(10) in every worker; add(n) allreduces the counts (Sum)
        assert executor.execute(lambda w: w.rank) == [0, 1, 2]
        assert executor.execute(lambda w: w.add(1)) == [33.0] * 3
        assert executor.execute(lambda w: w.add(2)) == [39.0] * 3
        assert executor.execute_single(lambda w: (w.rank, w.count)) == (0, 13)
        refs = executor.run_remote(lambda: os.environ["HOROVOD_RANK"])
        assert ray.get(refs, timeout=30) == ["0", "1", "2"]

    @timeout(90)
    def test_the_straggler_report_names_a_slow_worker(self, executor):
        results = executor.run(ray_workers.straggler, args=[2, 0.04, 60])
        # Every worker's report names rank 2, on its Ray node (this machine).
        assert [r[0] for r in results] == [2, 2, 2], results
        assert all(r[1] and r[2] >= 16 for r in results), results

    @timeout(90)
    def test_static_training_matches_single_process_sgd(self, executor):
        results = executor.run(ray_workers.train, kwargs=dict(steps=20, elastic=False))
        for r in results:
            _assert_weights(r["weights"], _local_sgd(20))

    @timeout(90)
    @pytest.mark.parametrize("others_wait_s", [0.0, 2.0])
    def test_a_raising_worker_fails_the_call_and_its_peers_do_not_hang(self, executor,
                                                                       others_wait_s):
        # others_wait_s=2: the peers' engines (up since start()) were stopped by rank 1
        # before their hvd.init(); that init must fail at once rather than wait the
        # 30 s start timeout for a new job nobody else joins.
        start = time.monotonic()
        with pytest.raises(ValueError, match="rank 1 refuses"):
            executor.run(ray_workers.fail_on_rank, args=[1, others_wait_s])
        assert time.monotonic() - start < 15
        # the executor is still usable: a fresh init forms the job again, twice
        for _ in range(2):
            assert [r[4] for r in executor.run(ray_workers.rank_size_sum, args=[1])] == [6.0] * 3

    @timeout(60)
    def test_more_workers_than_the_cluster_holds_is_a_clear_error(self, local_ray):
        settings = RayExecutor.create_settings(timeout_s=5, placement_group_timeout_s=5)
        start = time.monotonic()
        with pytest.raises(ValueError, match=r"needs room for 4 of \{1 CPU\}.* has 3 CPU"):
            RayExecutor(settings, num_workers=4, cpus_per_worker=1).start()
        with pytest.raises(ValueError, match="2 GPU"):
            RayExecutor(settings, num_workers=1, use_gpu=True, gpus_per_worker=2).start()
        with pytest.raises(ValueError, match="STRICT_SPREAD"):
            RayExecutor(settings, num_hosts=2, num_workers_per_host=1).start()
        assert time.monotonic() - start < 5  # at once: no placement group was waited for
        with pytest.raises(ValueError, match="num_workers"):
            RayExecutor(settings)
        with pytest.raises(ValueError, match="placement_strategy"):
            RayExecutor(settings, num_workers=1, placement_strategy="NEAR")
        with pytest.raises(ValueError, match="min_workers"):
            RayExecutor(settings, num_workers=2, min_workers=2)
        with pytest.raises(RuntimeError, match="not started"):
            RayExecutor(settings, num_workers=1).run(lambda: 1)

    @timeout(60)
    def test_callbacks_get_what_workers_log(self, executor):
        seen = []
        executor.execute(ray_workers.log_rank, callbacks=[seen.append])
        assert sorted(d["rank"] for d in seen) == [0, 1, 2]


# -- elastic ----------------------------------------------------------------------------

def _read_logs(out_dir):
    """{actor name: [(kind, rank, size, step, t)]}: kind is "step" (a committed step
    was done) or "reset" (the state after a reset: the step the worker resumes from)."""
    logs = {}
    for path in glob.glob(os.path.join(out_dir, "*.log")):
        rows = []
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) == 5:
                    rows.append((parts[0], int(parts[1]), int(parts[2]), int(parts[3]),
                                 float(parts[4])))
        logs[os.path.basename(path)[:-4]] = rows
    return logs


def _wait_for(cond, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def _recovery(logs, survivors, t_event):
    """For each survivor, around its first reset after t_event: (last step done before
    that reset, step resumed from, first step done after it, seconds from t_event to
    that step). Steps done between t_event and the reset (the failure takes a moment
    to reach the survivors) count as before it."""
    out = {}
    for name in survivors:
        rows = logs[name]
        resets = [r for r in rows if r[0] == "reset" and r[4] > t_event]
        t_reset = resets[0][4] if resets else t_event
        before = [r for r in rows if r[0] == "step" and r[4] <= t_reset]
        after = [r for r in rows if r[0] == "step" and r[4] > t_reset]
        out[name] = (before[-1][3], resets[0][3] if resets else None, after[0][3],
                     after[0][4] - t_event)
    return out


@contextlib.contextmanager
def _two_node_cluster():
    """A ray.cluster_utils.Cluster: a head of 0 CPU (the driver), node A of 2 CPUs and
    node B of 1 CPU, with this process connected; yields (cluster, node B)."""
    from ray.cluster_utils import Cluster
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True,
                      head_node_args=dict(num_cpus=0, include_dashboard=False))
    try:
        cluster.add_node(num_cpus=2)
        node_b = cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address)
        cluster.wait_for_nodes()
        yield cluster, node_b
    finally:
        ray.shutdown()
        cluster.shutdown()


@timeout(240)
def test_elastic_actor_killed_survivors_continue_from_last_commit(local_ray, tmp_path):
    steps = 60
    settings = ElasticRayExecutor.create_settings(min_num_proc=2, max_num_proc=3,
                                                  timeout_s=120, elastic_timeout=120)
    ex = ElasticRayExecutor(settings, cpus_per_slot=1)
    ex.start()
    killed = {}

    def kill_rank_2_at_step_10():
        def rank2():
            for name, rows in _read_logs(str(tmp_path)).items():
                if rows and rows[-1][1] == 2 and rows[-1][3] >= 10:
                    return name
            return None
        try:
            name = _wait_for(rank2, 120, "rank 2 at step 10")
        except AssertionError:
            return
        killed["t"] = time.time()
        ray.kill(ray.get_actor(name))
        killed["name"] = name

    killer = threading.Thread(target=kill_rank_2_at_step_10, daemon=True)
    killer.start()
    results = ex.run(ray_workers.train,
                     kwargs=dict(steps=steps, out_dir=str(tmp_path), step_sleep=0.05))
    killer.join(timeout=5)
    assert killed.get("name"), "the kill did not happen"
    # two survivors finished, at size 2, every step done once: the weights are those
    # of plain SGD (and of the static run, test_static_training_matches_...)
    assert [(r["rank"], r["size"], r["step"]) for r in results] == [(0, 2, steps), (1, 2, steps)]
    for r in results:
        _assert_weights(r["weights"], _local_sgd(steps))
    logs = _read_logs(str(tmp_path))
    survivors = [n for n in logs if n != killed["name"]]
    assert len(survivors) == 2
    for name, (last, resumed, first_after, secs) in _recovery(logs, survivors,
                                                              killed["t"]).items():
        # no committed step lost: the survivors resume from at least the last step
        # they had completed (and committed) before the kill, and go on from there
        assert resumed is not None and resumed >= last, (name, last, resumed)
        assert first_after == resumed + 1, (name, resumed, first_after)
        print(f"[recovery] {name}: kill -> next completed step {first_after} in "
              f"{secs:.3f} s (resumed from commit {resumed}, last step before {last})")
        assert secs < 15


@timeout(90)
def test_elastic_min_workers_more_than_the_cluster_offers_times_out_clearly(local_ray):
    ex = ElasticRayExecutor(ElasticRayExecutor.create_settings(min_num_proc=5,
                                                               elastic_timeout=1))
    with pytest.raises(TimeoutError, match="offered 3 worker slots.*min_workers=5"):
        ex.start()
    with pytest.raises(ValueError, match="max_workers"):
        ElasticRayExecutor(min_workers=3, max_workers=2)
    # Before: accepted, and the driver then never formed a generation.
    with pytest.raises(ValueError, match="reset_limit must be >= 0"):
        ElasticRayExecutor(reset_limit=-1)


@timeout(90)
def test_elastic_function_raising_fails_the_run_with_its_exception(local_ray):
    ex = ElasticRayExecutor(ElasticRayExecutor.create_settings(
        min_num_proc=2, max_num_proc=2, elastic_timeout=20))
    with pytest.raises(ValueError, match="rank 1 refuses"):
        ex.run(ray_workers.fail_on_rank, args=[1])


@timeout(300)
def test_elastic_cluster_node_removed_and_another_added(tmp_path):
    """Cluster: head (0 CPU, the driver) + node A (2 CPU) + node B (1 CPU): three
    workers. B is removed mid-training: A's two workers go on from the last commit.
    Node C (1 CPU) is added: a new worker joins at the next commit and gets the
    state. Training stops (on every rank at once) when the stop file appears."""
    with _two_node_cluster() as (cluster, node_b):
        stop_file = tmp_path / "stop"
        out_dir = tmp_path / "logs"
        out_dir.mkdir()
        events = {}
        outcome = {}
        ex = ElasticRayExecutor(ElasticRayExecutor.create_settings(
            min_num_proc=2, max_num_proc=3, timeout_s=60, elastic_timeout=120))
        ex.start()

        def train():  # in a thread: Cluster.add_node must run in the main thread
            try:
                outcome["results"] = ex.run(ray_workers.train, kwargs=dict(
                    steps=100000, out_dir=str(out_dir), step_sleep=0.05,
                    stop_file=str(stop_file)))
            except BaseException as exc:  # pylint: disable=broad-except
                outcome["error"] = exc

        def at(cond):
            return lambda: any(cond(rows[-1]) for rows in _read_logs(str(out_dir)).values()
                               if rows)

        trainer = threading.Thread(target=train, daemon=True)
        trainer.start()
        try:
            _wait_for(at(lambda r: r[2] == 3 and r[3] >= 8), 150, "3 workers at step 8")
            events["removed"] = time.time()
            cluster.remove_node(node_b)
            _wait_for(at(lambda r: r[0] == "step" and r[2] == 2 and r[4] > events["removed"]),
                      60, "a step at size 2")
            events["add"] = time.time()
            cluster.add_node(num_cpus=1)
            events["added"] = time.time()
            _wait_for(at(lambda r: r[0] == "step" and r[2] == 3 and r[4] > events["added"]),
                      120, "a step at size 3 again")
            events["grown"] = time.time()
            time.sleep(0.5)
        finally:
            stop_file.write_text("stop")
            trainer.join(timeout=120)
        if "error" in outcome:
            raise outcome["error"]
        results = outcome["results"]
        assert set(events) == {"removed", "add", "added", "grown"}, events
        assert [(r["rank"], r["size"]) for r in results] == [(0, 3), (1, 3), (2, 3)]
        final = results[0]["step"]
        assert {r["step"] for r in results} == {final}
        for r in results:  # the newcomer got the state: same weights, every step once
            _assert_weights(r["weights"], _local_sgd(final))
        logs = _read_logs(str(out_dir))
        survivors = [n for n, rows in logs.items()
                     if any(r[4] > events["removed"] and r[2] == 2 for r in rows)]
        assert len(survivors) == 2
        for name, (last, resumed, first_after, secs) in _recovery(
                logs, survivors, events["removed"]).items():
            assert resumed is not None and resumed >= last, (name, last, resumed)
            assert first_after == resumed + 1
            print(f"[recovery] node removed: {name} next completed step {first_after} "
                  f"{secs:.3f} s later")
        newcomer = [n for n, rows in logs.items() if rows and rows[0][4] > events["added"]]
        assert len(newcomer) == 1
        print(f"[recovery] node added: add_node took {events['added'] - events['add']:.1f} s; "
              f"first step at size 3 {events['grown'] - events['added']:.1f} s after it")


@timeout(240)
def test_elastic_straggler_policy_evict_removes_the_slow_node(tmp_path, capfd):
    """Cluster: head (0 CPU) + node A (2 CPU) + node B (1 CPU); the worker on B is 100 ms
    slower per step. With straggler_policy="evict" its node leaves the job; A's two
    workers finish from the last commit, every step once (the weights of plain SGD)."""
    with _two_node_cluster() as (cluster, node_b):
        out_dir = tmp_path / "logs"
        out_dir.mkdir()
        ex = ElasticRayExecutor(ElasticRayExecutor.create_settings(
            min_num_proc=2, max_num_proc=3, timeout_s=60, elastic_timeout=120),
            straggler_policy="evict", straggler_evict_after=2)
        ex.start()
        steps = 200
        results = ex.run(ray_workers.train, kwargs=dict(
            steps=steps, out_dir=str(out_dir), step_sleep=0.02, slow_node=node_b.node_id,
            slow_s=0.1))
        assert [(r["rank"], r["size"]) for r in results] == [(0, 2), (1, 2)], results
        for r in results:
            assert r["step"] == steps
            _assert_weights(r["weights"], _local_sgd(steps))
        logs = _read_logs(str(out_dir))
        at_3 = [r[3] for rows in logs.values() for r in rows if r[0] == "step" and r[2] == 3]
        assert at_3 and max(at_3) < steps, "the job did not run at 3 workers, then at 2"
        out = capfd.readouterr()
        assert f"evicting host {node_b.node_id}" in out.out + out.err, out.err[-3000:]


def test_elastic_straggler_options_are_validated():
    with pytest.raises(ValueError, match="straggler_policy"):
        ElasticRayExecutor(straggler_policy="kick")
    with pytest.raises(ValueError, match="straggler_evict_after"):
        ElasticRayExecutor(straggler_policy="evict", straggler_evict_after=0)
