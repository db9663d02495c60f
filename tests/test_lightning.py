"""horovod_torch.lightning.HorovodStrategy with a real Lightning 2.x Trainer under
``horovodrun -np 2`` (tests/lightning_workers.py): the ranks reach the parameters of a
single-process run on the combined batch (plain, with gradient accumulation, with
scale_lr, with gradient clipping, with GradientAccumulationScheduler), fp16 compression stays close, ranks/world size/sampler/synced metrics are
right, and checkpoints are written by rank 0 only."""
import os
import signal
import subprocess
import sys

import pytest

pytest.importorskip("lightning")

from tests import lightning_workers as workers  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("lightning")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "horovod_torch.runner", "-np", "2", "--start-timeout", "60",
         sys.executable, "-m", "tests.lightning_workers", str(out)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"horovodrun did not finish within {JOB_TIMEOUT_S} s:\n{output[-4000:]}")
    assert proc.returncode == 0, output[-4000:]
    return out, output


def _load(out, name, rank):
    import torch
    return torch.load(os.path.join(out, f"{name}.rank{rank}.pt"), weights_only=False)


def _assert_params(got, want, atol):
    import torch
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=atol)


@pytest.mark.parametrize("name,atol", [("plain", 1e-5), ("accumulate", 1e-5),
                                       ("scale_lr", 1e-5), ("fp16", 2e-3), ("clip", 1e-5),
                                       ("acc_schedule", 1e-5)])
def test_two_ranks_match_single_process_sgd_on_the_combined_batch(job, name, atol):
    out, _ = job
    want = workers.reference(clip=workers.CONFIGS[name][4],
                             per_rank=workers.REFERENCE_ROWS.get(name, 4))
    got = [_load(out, name, r) for r in (0, 1)]
    _assert_params(got[0]["params"], got[1]["params"], 0)  # ranks agree exactly
    _assert_params(got[0]["params"], want, atol)
    # DistributedOptimizer with backward_passes_per_step = accumulate_grad_batches
    assert got[0]["optimizer_class"] == ["horovod_torch.training.optimizer"]
    passes = {"acc_schedule": 2}.get(name, workers.CONFIGS[name][1])  # the last epoch's
    assert got[0]["passes"] == [passes]


def test_fp16_compression_is_applied(job):
    out, _ = job
    plain, fp16 = _load(out, "plain", 0)["params"], _load(out, "fp16", 0)["params"]
    assert any(not bool((a == b).all()) for a, b in zip(plain, fp16))


def test_ranks_sampler_collectives_and_synced_metrics(job):
    out, output = job
    for rank in (0, 1):
        d = _load(out, "plain", rank)
        assert d["checks"] == dict(
            global_rank=rank, world_size=2, is_global_zero=rank == 0,
            sampler="DistributedSampler", sampler_replicas=2, sampler_rank=rank,
            broadcast="from 0", gathered=[[0.0], [1.0]], any_rank1=True, all_rank1=False)
        m = d["metrics"]
        assert m["rank_mean"] == 0.5 and m["rank_max"] == 1.0
        assert m["rank_sum"] == 2.0  # per rank: 2 validation steps, summed, then over ranks
    # Metrics synced with sync_dist are the same on both ranks, also from
    # trainer.test() (which runs under torch.inference_mode()).
    assert _load(out, "plain", 0)["metrics"] == _load(out, "plain", 1)["metrics"]
    tested = [_load(out, "plain", r)["tested"] for r in (0, 1)]
    assert tested[0] == tested[1] and tested[0]["test_rank_mean"] == 0.5
    # Lightning's rank-zero messages come from rank 0 only.
    assert "[0]<stderr>:`Trainer.fit` stopped" in output
    assert "[1]<stderr>:`Trainer.fit` stopped" not in output


def test_checkpoints_are_written_once_by_rank_zero(job):
    import torch
    out, _ = job
    with open(os.path.join(out, "saves.log")) as f:
        saves = [line.split(" ", 1) for line in f.read().splitlines()]
    assert saves and all(rank == "0" for rank, _ in saves), saves
    paths = [p for _, p in saves]
    assert len(paths) == len(set(paths)) + paths.count(paths[-1]) - 1  # only last.ckpt repeats
    files = sorted(os.listdir(os.path.join(out, "ckpt")))
    assert files == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "last.ckpt"]
    state = torch.load(os.path.join(out, "ckpt", "last.ckpt"), weights_only=False)
    _assert_params(list(state["state_dict"].values()), _load(out, "plain", 0)["params"], 0)


def test_strategy_registry_and_reduce_ops():
    from lightning.pytorch.strategies import StrategyRegistry
    from horovod_torch.lightning import HorovodStrategy
    from horovod_torch.lightning.strategy import _reduce_op
    import horovod_torch as hvd
    import torch.distributed as dist
    assert StrategyRegistry["horovod"]["strategy"] is HorovodStrategy
    assert _reduce_op(None) == _reduce_op("mean") == _reduce_op("avg") == hvd.Average
    assert _reduce_op("sum") == _reduce_op(dist.ReduceOp.SUM) == hvd.Sum
    assert _reduce_op(dist.ReduceOp.MAX) == hvd.Max and _reduce_op("min") == hvd.Min
    with pytest.raises(ValueError, match="unsupported reduce_op"):
        _reduce_op("median")
