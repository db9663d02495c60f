"""A small elastic training script used by test_elastic.py (run under horovodrun).

Environment knobs: STEPS, KILL_RANK/KILL_STEP (that rank dies once at that step,
marker file MARKER; KILL_HOW: exit (status 3, the default), kill (SIGKILL) or stop
(SIGSTOP: it hangs); with DEVICE=cuda and KILL_INSIDE=1 it does so while the others
are inside the step's NCCL allreduces: its GPU is kept busy so its share never
starts), BIG_MB (a parameter of that many MB, gradient 1 everywhere, checked at the
end against the momentum SGD it must have had), EDIT_STEP/EDIT_FILE/EDIT_TEXT (rank 0
rewrites the discovery file at that step, to add or remove hosts), WAIT_STEP/WAIT_SIZE (see
tests.workers.edit_hosts_and_wait), LATE_INIT_S (a worker started after the
kill waits that long before hvd.init(), as a slow start would), DIE_IN_INIT (the first
worker started after the kill dies inside hvd.init()), SLOW_HOST/SLOW_S (the workers
on that host, by its horovodrun name, sleep that long in every step: a straggler),
MIN_SIZE_CHANGES (the training goes on past STEPS, up to 10 times as many, until the
world's size has changed that many times: a test of repeated host changes cannot end
before them however slowly a returning worker starts),
STEP_LOG (rank 0 prints `STEP step=N size=S at=T` every 10 steps, for bench/straggler_evict.py),
FAIL_AFTER_RANK (that rank exits with status 4 once the other ranks' processes have
ended, as a failed save would), AFTER_TEXT (after the training rank 0 rewrites the discovery file
with it; the worker the driver then starts says so in MARKER.late and waits in
hvd.init() for a generation that never forms, while the training's workers go on for
4 s (rank 0) or 8 s, as a save would, and then print `SAVED rank=R`; with LATE_FAILS=1
that new worker exits with status 3 once rank 0's process has ended, as a rendezvous
that timed out would; with LATE_SLOW_S it sleeps that long inside hvd.init(), before the
rendezvous, as a slow start would), REMOVE_TEXT (after the training rank 0 rewrites the
discovery file with it, to remove another worker's host; every worker waits until the driver has
published the generation without it, then rank 0 ends at once and the others print
`SAVED rank=R` SAVE_S (default 4) s later, as a save would)."""
import os
import signal
import time

import torch
import torch.nn as nn

import horovod.torch as hvd
from tests.workers import edit_hosts_and_wait, report_recovery_once, write_hosts

if os.environ.get("AFTER_TEXT") and os.path.exists(os.environ["EDIT_FILE"] + ".after"):
    open(os.environ["MARKER"] + ".late", "w").close()
    if os.environ.get("LATE_SLOW_S"):
        # Inside hvd.init(), after the driver made it a member of the new generation,
        # before it reaches the rendezvous: a slow start.
        from horovod_torch import _C

        def _slow_init(*args, _init=_C.init):
            time.sleep(float(os.environ["LATE_SLOW_S"]))
            return _init(*args)
        _C.init = _slow_init
    if os.environ.get("LATE_FAILS") == "1":
        import threading

        def _fail_once_rank_0_ended():
            with open(os.environ["EDIT_FILE"] + ".pid0") as f:
                pid = int(f.read())
            while True:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    os._exit(3)
                time.sleep(0.05)
        threading.Thread(target=_fail_once_rank_0_ended, daemon=True).start()
if (os.environ.get("DIE_IN_INIT") and os.path.exists(os.environ.get("MARKER", ""))
        and not os.path.exists(os.environ["MARKER"] + ".init")):
    # The first replacement dies inside hvd.init(), after the driver assigned it a
    # generation and before it reached the rendezvous.
    from horovod_torch import _C

    def _die_in_init(*args):
        open(os.environ["MARKER"] + ".init", "w").close()
        os._exit(5)
    _C.init = _die_in_init
if os.environ.get("LATE_INIT_S") and os.path.exists(os.environ.get("MARKER", "")):
    time.sleep(float(os.environ["LATE_INIT_S"]))
    print(f"LATE_READY at={time.time():.3f}", flush=True)
hvd.init()
DEVICE_INDEX = hvd.local_rank()  # the GPU a script takes once, at start
torch.manual_seed(0)
STEPS = int(os.environ.get("STEPS", "40"))
dev = torch.device("cpu")
if os.environ.get("DEVICE") == "cuda":
    torch.cuda.set_device(DEVICE_INDEX)
    dev = torch.device("cuda", DEVICE_INDEX)
model = nn.Linear(8, 1).to(dev)
BIG = int(os.environ.get("BIG_MB", "0")) * (1 << 18)  # float32 elements
if BIG:
    model.big = nn.Parameter(torch.zeros(BIG, device=dev))
LR, MOMENTUM = 0.05, 0.9
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM),
                               named_parameters=model.named_parameters())
data = torch.randn(256, 8).to(dev)
target = data.sum(1, keepdim=True)
sampler = hvd.elastic.ElasticSampler(list(range(256)), shuffle=True, seed=1)
state = hvd.elastic.TorchState(model, opt, sampler=sampler, step=0, epoch=0, batch=0,
                               size=0, size_changes=0)
MIN_SIZE_CHANGES = int(os.environ.get("MIN_SIZE_CHANGES", "0"))
resets = []
reported = []
KILL_HOW = os.environ.get("KILL_HOW", "exit")
INSIDE = os.environ.get("KILL_INSIDE") == "1" and dev.type == "cuda"


def die():
    with open(os.environ["MARKER"], "w") as f:
        f.write(str(time.time()))
    if KILL_HOW == "exit":
        os._exit(3)
    os.kill(os.getpid(), signal.SIGKILL if KILL_HOW == "kill" else signal.SIGSTOP)


state.register_reset_callbacks([
    lambda: resets.append(hvd.size()),
    lambda: print(f"RESET size={hvd.size()} step={state.step} at={time.time():.3f}", flush=True)])


@hvd.elastic.run
def train(state):
    while state.step < STEPS or (state.size_changes < MIN_SIZE_CHANGES
                                 and state.step < 10 * STEPS):
        if hvd.size() != state.size:  # the same on every rank: the state is synced
            state.size_changes += state.size != 0
            state.size = hvd.size()
        idx = state.sampler.indices[state.batch * 8:(state.batch + 1) * 8]
        if len(idx) < 8:
            state.epoch += 1
            state.batch = 0
            state.sampler.set_epoch(state.epoch)
            continue
        dying = (hvd.rank() == int(os.environ.get("KILL_RANK", "-1"))
                 and state.step == int(os.environ.get("KILL_STEP", "-1"))
                 and (os.environ.get("KILL_ALWAYS") or not os.path.exists(os.environ["MARKER"])))
        if dying and not INSIDE:
            die()
        if dying:
            torch.cuda._sleep(100_000_000_000)  # about a minute: its allreduces wait behind it
        edit_hosts_and_wait(state)
        if os.environ.get("HOROVOD_HOSTNAME") == os.environ.get("SLOW_HOST", "-"):
            time.sleep(float(os.environ.get("SLOW_S", "0.05")))
        opt.zero_grad()
        loss = ((state.model(data[idx]) - target[idx]) ** 2).mean()
        if BIG:
            loss = loss + state.model.big.sum()  # its gradient: 1 everywhere
        loss.backward()
        opt.step()
        if dying:
            time.sleep(2)  # the others' kernels of this step's allreduces wait for it
            die()
        state.sampler.record_batch(state.batch, 8)
        state.batch += 1
        state.step += 1
        report_recovery_once(resets, reported)
        if os.environ.get("STEP_LOG") and hvd.rank() == 0 and state.step % 10 == 0:
            print(f"STEP step={state.step} size={hvd.size()} at={time.time():.3f}", flush=True)
        time.sleep(float(os.environ.get("STEP_SLEEP", "0.02")))
        state.commit()


train(state)
w = torch.cat([p.detach().flatten() for p in model.parameters()])
all_w = hvd.allgather(w.unsqueeze(0), name="final_weights")
same = all(torch.allclose(all_w[0], all_w[q]) for q in range(hvd.size()))
if BIG:  # STEPS steps of momentum SGD with gradient 1, none lost or torn by a failure
    v = p = 0.0
    for _ in range(STEPS):
        v = MOMENTUM * v + 1.0
        p -= LR * v
    big = model.big.detach()
    same = same and bool(torch.allclose(big, torch.full_like(big, p), rtol=1e-4))
print(f"FINAL rank={hvd.rank()} size={hvd.size()} step={state.step} same={same} "
      f"resets={resets} device={DEVICE_INDEX} local_rank={hvd.local_rank()} at={time.time():.3f}",
      flush=True)
if os.environ.get("FAIL_AFTER_RANK"):
    pids = hvd.allgather(torch.tensor([os.getpid()]), name="pids").tolist()
    if hvd.rank() == int(os.environ["FAIL_AFTER_RANK"]):
        deadline = time.monotonic() + 60
        for pid in pids:
            while pid != os.getpid() and time.monotonic() < deadline:
                try:
                    os.kill(pid, 0)  # gone once the driver has reaped it, and seen it done
                except ProcessLookupError:
                    break
                time.sleep(0.05)
        os._exit(4)
if os.environ.get("AFTER_TEXT"):
    if hvd.rank() == 0:
        with open(os.environ["EDIT_FILE"] + ".pid0", "w") as f:
            f.write(str(os.getpid()))
        open(os.environ["EDIT_FILE"] + ".after", "w").close()
        write_hosts(os.environ["AFTER_TEXT"])
    deadline = time.monotonic() + 60
    while not os.path.exists(os.environ["MARKER"] + ".late") and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(4 if hvd.rank() == 0 else 8)
    print(f"SAVED rank={hvd.rank()}", flush=True)
if os.environ.get("REMOVE_TEXT"):
    from horovod_torch.common import elastic_worker
    if hvd.rank() == 0:
        write_hosts(os.environ["REMOVE_TEXT"])
    deadline = time.monotonic() + 60
    while elastic_worker.current_generation() < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    if hvd.rank() > 0:
        time.sleep(float(os.environ.get("SAVE_S", "4")))
    print(f"SAVED rank={hvd.rank()}", flush=True)
