"""horovod_torch.spark.run (``horovod.spark.run``) and pyspark's TorchDistributor on a
real local Spark (``local[2]``): one SparkSession for the module (it takes ~20 s to
start on 2 cores). Every test has a watchdog; the runs themselves are bounded by
start_timeout and the driver's error handling."""
import faulthandler
import io
import os
import sys
import time

import pytest

pyspark = pytest.importorskip("pyspark")

from tests import spark_workers  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def timeout(seconds):
    def mark(fn):
        fn.spark_timeout = seconds
        return fn
    return mark


@pytest.fixture(autouse=True)
def watchdog(request):
    faulthandler.dump_traceback_later(getattr(request.function, "spark_timeout", 120),
                                      exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="module")
def spark():
    # The executors' Python workers (and the ranks they start) import horovod_torch
    # and tests.spark_workers from this checkout.
    # Their Python is this one (pyspark's default is `python3` on PATH, which need not
    # be the virtual environment's).
    old_path, old_python = os.environ.get("PYTHONPATH"), os.environ.get("PYSPARK_PYTHON")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, old_path) if p)
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession
    faulthandler.dump_traceback_later(180, exit=True)
    session = (SparkSession.builder.master("local[2]").appName("horovod_torch-test")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.driver.host", "127.0.0.1")
               .config("spark.executorEnv.OMP_NUM_THREADS", "1")
               .getOrCreate())
    faulthandler.cancel_dump_traceback_later()
    yield session
    session.stop()
    for name, value in (("PYTHONPATH", old_path), ("PYSPARK_PYTHON", old_python)):
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _assert_params(got, want):
    import torch
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@timeout(150)
def test_run_returns_rank_order_topology_and_output(spark):
    import horovod.spark
    import horovod_torch.spark
    assert horovod.spark.run is horovod_torch.spark.run
    out = io.StringIO()
    results = horovod.spark.run(spark_workers.topology, args=("a",), num_proc=2,
                                env={"SPARK_TEST_VAR": "v"}, stdout=out, verbose=0,
                                start_timeout=60)
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert (r["size"], r["local_size"], r["cross_size"]) == (2, 2, 1)
        assert r["local_rank"] == r["rank"] and r["cross_rank"] == 0
        assert r["total"] == 3.0 and r["tag"] == "a" and r["env"] == "v"
    text = out.getvalue()
    assert "[0]<stdout>:hello from rank 0" in text
    assert "[1]<stdout>:hello from rank 1" in text


@timeout(150)
def test_training_matches_single_process_sgd(spark):
    import horovod_torch.spark
    results = horovod_torch.spark.run(spark_workers.train, kwargs={"steps": 5},
                                      num_proc=2, verbose=0, start_timeout=60)
    assert [(r, s) for r, s, _ in results] == [(0, 2), (1, 2)]
    want = spark_workers.sgd_reference(5)
    for _, _, params in results:
        _assert_params(params, want)


def _pids(pid_dir):
    pids = {}
    for name in os.listdir(pid_dir):
        with open(os.path.join(pid_dir, name)) as f:
            pids[name] = int(f.read())
    return pids


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _assert_all_gone(pid_dir, within=15.0):
    pids = _pids(pid_dir)
    assert len(pids) == 2, pids
    deadline = time.monotonic() + within
    while any(_alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [n for n, p in pids.items() if _alive(p)], "a rank outlived the job"


@timeout(150)
@pytest.mark.parametrize("others", ["collective", "sleep"])
def test_an_exception_in_one_rank_is_raised_naming_it_and_stops_the_others(
        spark, tmp_path, others):
    import horovod_torch.spark
    from horovod_torch.runner.func import RemoteTraceback
    err = io.StringIO()
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="boom in rank 1") as info:
        horovod_torch.spark.run(spark_workers.fail, args=(1, "raise", others, str(tmp_path)),
                                num_proc=2, verbose=0, start_timeout=60, stderr=err)
    assert time.monotonic() - t0 < 90
    assert isinstance(info.value.__cause__, RemoteTraceback)
    assert info.value.__cause__.rank == 1
    assert "rank 1" in str(info.value.__cause__)
    assert "[1]<stderr>:" in err.getvalue()
    _assert_all_gone(str(tmp_path))


@timeout(150)
def test_a_crashing_rank_is_named_not_the_peers_it_broke(spark, tmp_path):
    import horovod_torch.spark
    with pytest.raises(RuntimeError, match=r"rank 1 exited with code 3"):
        horovod_torch.spark.run(spark_workers.fail, args=(1, "exit", "collective",
                                                          str(tmp_path)),
                                num_proc=2, verbose=0, start_timeout=60,
                                stderr=io.StringIO())
    _assert_all_gone(str(tmp_path))


@timeout(150)
def test_a_dead_spark_task_fails_the_job_and_stops_its_rank(spark, tmp_path):
    import horovod_torch.spark
    with pytest.raises(RuntimeError, match="Spark job of horovod_torch.spark.run failed"):
        horovod_torch.spark.run(spark_workers.fail, args=(1, "kill_task", "collective",
                                                          str(tmp_path)),
                                num_proc=2, verbose=0, start_timeout=60,
                                stderr=io.StringIO())
    _assert_all_gone(str(tmp_path))
    assert spark.sparkContext.parallelize(range(4), 2).sum() == 6


@timeout(120)
def test_more_ranks_than_task_slots_times_out_clearly(spark):
    import horovod_torch.spark
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="0 of 3 started within 5 s"):
        horovod_torch.spark.run(spark_workers.topology, args=("x",), num_proc=3, verbose=0,
                                start_timeout=5)
    assert time.monotonic() - t0 < 60
    # The session still works afterwards.
    assert spark.sparkContext.parallelize(range(4), 2).sum() == 6


def test_run_elastic_and_mpi_are_refused_clearly():
    import horovod_torch.spark
    with pytest.raises(NotImplementedError, match="horovodrun"):
        horovod_torch.spark.run_elastic(spark_workers.topology)
    with pytest.raises(ValueError, match="use_mpi"):
        horovod_torch.spark.run(spark_workers.topology, use_mpi=True)


@timeout(150)
def test_torch_distributor_runs_an_unchanged_horovod_script(spark):
    from pyspark.ml.torch.distributor import TorchDistributor
    rank, size, params = TorchDistributor(num_processes=2, local_mode=True,
                                          use_gpu=False).run(spark_workers.train, 5)
    # pyspark (4.x) has every local process write its value to the same file, so the
    # value is that of whichever rank wrote last; the ranks' parameters are the same.
    assert rank in (0, 1) and size == 2
    _assert_params(params, spark_workers.sgd_reference(5))
