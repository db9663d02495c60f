"""Workers for test_sharded.py: DistributedOptimizer(shard_optimizer_state=...)
against the unsharded optimizer, trained side by side in the same processes."""
import copy
import io

import torch
import torch.nn as nn

import horovod_torch as hvd
from tests.workers import expect_raises

B = 12  # global batch


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 3))


def _make_opt(name, model):
    """Two param groups with their own hyper-parameters."""
    first, rest = list(model[0].parameters()), [p for m in model[1:] for p in m.parameters()]
    groups = [{"params": first, "lr": 0.05}, {"params": rest}]
    if name == "sgd":
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9, weight_decay=0.01)
    if name == "adam":
        return torch.optim.Adam(groups, lr=0.01)
    return torch.optim.AdamW(groups, lr=0.01, weight_decay=0.1)


def _batch(step, r, n):
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(B, 5, generator=g), torch.randn(B, 3, generator=g)
    per = B // n
    return x[r * per:(r + 1) * per], y[r * per:(r + 1) * per]


class _Trainer:
    def __init__(self, opt_name, stage, extras, dev=torch.device("cpu")):
        self.dev = dev
        self.model = _model().to(dev)
        kwargs = {"backward_passes_per_step": 2 if "bpps2" in extras else 1}
        if "fp16" in extras:
            kwargs["compression"] = hvd.Compression.fp16
        if "rs" in extras and stage:
            kwargs["reduce_scatter_gradients"] = True
        self.opt = hvd.DistributedOptimizer(_make_opt(opt_name, self.model),
                                            named_parameters=self.model.named_parameters(),
                                            shard_optimizer_state=stage, **kwargs)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=2, gamma=0.5)
        self.scaler = (torch.amp.GradScaler(dev.type, init_scale=1024.0) if "amp" in extras
                       else None)
        self.extras = extras

    def step(self, step):
        r, n = hvd.rank(), hvd.size()
        passes = 2 if "bpps2" in self.extras else 1
        self.opt.zero_grad()
        for k in range(passes):
            x, y = (t.to(self.dev) for t in _batch(step * passes + k, r, n))
            loss = ((self.model(x) - y) ** 2).mean() / passes
            (self.scaler.scale(loss) if self.scaler else loss).backward()
        self.opt.synchronize()
        # what synchronize() left in .grad (reduce_scatter_gradients: the owned only)
        self.held = [i for i, p in enumerate(self.opt._all_params()) if p.grad is not None] \
            if hasattr(self.opt, "_all_params") else None
        if self.scaler:
            self.scaler.unscale_(self.opt)
        norm = None
        if "clip" in self.extras:
            norm = self.opt.clip_grad_norm_(0.05) if hasattr(self.opt, "clip_grad_norm_") else \
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), 0.05)
        with self.opt.skip_synchronize():
            if self.scaler:
                self.scaler.step(self.opt)
                self.scaler.update()
            else:
                self.opt.step()
        self.sched.step()
        return norm


def exactness(opt_name="adamw", stage="1", extra="none", device="cpu"):
    """Sharded and unsharded training reach the same parameters and state."""
    hvd.init()
    extras = set(extra.split("+"))
    stage = int(stage)
    dev = torch.device("cpu")
    if device == "cuda":
        torch.cuda.set_device(hvd.local_rank())
        dev = torch.device("cuda", hvd.local_rank())
    plain, sharded = _Trainer(opt_name, 0, extras, dev), _Trainer(opt_name, stage, extras, dev)
    # Reduce-scattered gradients are summed in another order on 3 ranks, and their norm
    # is combined across ranks: equal within float rounding, else bitwise.
    if "rs" in extras:
        same = lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    else:
        same = torch.equal
    for step in range(5):
        n1, n2 = plain.step(step), sharded.step(step)
        if n1 is not None:
            assert same(n1, n2), (n1, n2)
        if "rs" in extras and hvd.size() > 1:  # only the owned gradients were kept
            shard = sharded.opt._shard()
            # by the C++ hooks, which know each gradient's owner
            assert sharded.opt._native is not None or not hvd._C.native_grad_hooks()
            held = [i for i, p in enumerate(shard.params) if p.grad is not None]
            assert held == shard.owned, (step, held, shard.owned)
            assert sharded.held == shard.owned, (step, sharded.held, shard.owned)
    for (name, p), q in zip(plain.model.named_parameters(), sharded.model.parameters()):
        assert same(p, q), (name, (p - q).abs().max())
    # each rank holds state for its own parameters only; together, all of it
    owned = torch.tensor([sum(1 for _ in sharded.opt.state)])
    total = int(hvd.allreduce(owned, op=hvd.Sum, name="owned").item())
    assert total == len(plain.opt.state) == 6, (total, len(plain.opt.state))
    if hvd.size() > 1:
        assert len(sharded.opt.state) < len(plain.opt.state)
    # the consolidated state dict is the unsharded optimizer's
    sharded.opt.consolidate_state_dict(root_rank=None)
    full, ref = sharded.opt.state_dict(), plain.opt.state_dict()
    assert full["param_groups"] == ref["param_groups"]
    assert sorted(full["state"]) == sorted(ref["state"])
    for k, st in ref["state"].items():
        for key, v in st.items():
            v, w = torch.as_tensor(v).cpu(), torch.as_tensor(full["state"][k][key])
            assert same(v, w), (k, key)
    # stage 2: only the owned gradients are kept after step()
    if stage == 2 and hvd.size() > 1:
        shard = sharded.opt._shard()
        kept = [i for i, p in enumerate(shard.params) if p.grad is not None]
        assert kept and set(kept) <= set(shard.owned), (kept, shard.owned)
    hvd.shutdown()


def state_dicts():
    """Checkpoints: consolidated <-> unsharded, sharded files, broadcast after a
    load on one rank, and the errors."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    plain, sharded = _Trainer("adamw", 0, set()), _Trainer("adamw", 1, set())
    for step in range(3):
        plain.step(step)
        sharded.step(step)
    expect_raises(RuntimeError, sharded.opt.state_dict, "consolidate_state_dict")
    sharded.opt.consolidate_state_dict(root_rank=0)
    if r == 0:
        full = sharded.opt.state_dict()
    else:
        expect_raises(RuntimeError, sharded.opt.state_dict, "consolidate_state_dict")
        full = None
    # the consolidated dict loads into a fresh unsharded optimizer, which then trains
    # exactly like the one that never was sharded
    buf = io.BytesIO()
    torch.save(hvd.broadcast_object(full, 0, name="full"), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    fresh = _Trainer("adamw", 0, set())
    fresh.model.load_state_dict(sharded.model.state_dict())
    fresh.opt.load_state_dict(loaded)
    fresh.sched.load_state_dict(plain.sched.state_dict())
    # an unsharded optimizer's dict loads into a sharded one loaded on rank 0 only,
    # then broadcast (Horovod's checkpoint idiom)
    resumed = _Trainer("adamw", 1, set())
    resumed.model.load_state_dict(sharded.model.state_dict())
    resumed.sched.load_state_dict(plain.sched.state_dict())
    if r == 0:
        # a copy: torch's load_state_dict keeps the tensors it is given
        resumed.opt.load_state_dict(copy.deepcopy(plain.opt.state_dict()))
    hvd.broadcast_optimizer_state(resumed.opt, root_rank=0)
    # per-rank files
    part = io.BytesIO()
    torch.save(sharded.opt.sharded_state_dict(), part)
    part.seek(0)
    again = _Trainer("adamw", 1, set())
    again.model.load_state_dict(sharded.model.state_dict())
    again.sched.load_state_dict(plain.sched.state_dict())
    again.opt.load_sharded_state_dict(torch.load(part, weights_only=False))
    if n > 1:
        other = sharded.opt.sharded_state_dict()
        other["shard"] = dict(other["shard"], rank=(r + 1) % n)
        expect_raises(ValueError, lambda: again.opt.load_sharded_state_dict(other),
                      "saved by rank")
    for step in range(3, 6):
        for t in (plain, fresh, resumed, again):
            t.step(step)
    for what, t in (("consolidated into unsharded", fresh), ("broadcast", resumed),
                    ("sharded files", again)):
        for p, q in zip(plain.model.parameters(), t.model.parameters()):
            assert torch.equal(p, q), (what, (p - q).abs().max())
    hvd.shutdown()


def errors():
    hvd.init()
    model = _model()
    expect_raises(ValueError, lambda: hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum,
        shard_optimizer_state=True), "Adasum")
    expect_raises(ValueError, lambda: hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), shard_optimizer_state=3),
        "shard_optimizer_state must be")
    expect_raises(ValueError, lambda: hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), reduce_scatter_gradients=True),
        "reduce_scatter_gradients needs shard_optimizer_state")
    expect_raises(ValueError, lambda: hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), shard_optimizer_state=True,
        reduce_scatter_gradients=True, num_groups=2), "groups")
    hvd.shutdown()


def param_order(scatter="0"):
    """Param groups built from a set of names come out in another order on each rank
    (every process has its own PYTHONHASHSEED; here rank 1 reverses them): the first
    step raises ValueError on every rank, naming the cause, instead of exchanging one
    parameter's values into another (before: silently wrong parameters), with or
    without reduce_scatter_gradients."""
    hvd.init()
    r = hvd.rank()
    model = _model()
    named = dict(model.named_parameters())
    decay = sorted(n for n in named if n.endswith("weight"))
    rest = sorted(n for n in named if n not in decay)
    if r == 1:
        decay, rest = decay[::-1], rest[::-1]
    opt = hvd.DistributedOptimizer(
        torch.optim.AdamW([{"params": [named[n] for n in decay], "weight_decay": 0.1},
                           {"params": [named[n] for n in rest], "weight_decay": 0.0}],
                          lr=0.01),
        named_parameters=model.named_parameters(), shard_optimizer_state=True,
        reduce_scatter_gradients=scatter == "1")
    x, y = _batch(0, r, hvd.size())

    def step():
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    expect_raises(ValueError, step, "different orders", "PYTHONHASHSEED")
    hvd.shutdown()
    print("param order refused", flush=True)


def process_set():
    """Sharded over the process set {0, 2} of 3 ranks: those two train as one job
    (their own partition of 2) and equal the unsharded optimizer on the same set;
    rank 1, outside it, trains alone on its own gradients, unsharded."""
    ps = hvd.ProcessSet([0, 2])
    hvd.init(process_sets=[ps])
    r = hvd.rank()

    def trainer(stage):
        model = _model()
        opt = hvd.DistributedOptimizer(_make_opt("adamw", model),
                                       named_parameters=model.named_parameters(),
                                       shard_optimizer_state=stage, process_set=ps)
        return model, opt

    plain, sharded = trainer(0), trainer(1)
    local_rank = {0: 0, 2: 1}.get(r, 0)
    size = 2 if r in (0, 2) else 1
    for step in range(4):
        for model, opt in (plain, sharded):
            x, y = _batch(step, local_rank, size)
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
    for p, q in zip(plain[0].parameters(), sharded[0].parameters()):
        assert torch.equal(p, q), (r, (p - q).abs().max())
    if r in (0, 2):
        assert 0 < len(sharded[1].state) < len(plain[1].state) == 6, len(sharded[1].state)
    else:
        assert len(sharded[1].state) == 6  # outside the set: all of it, unsharded
    hvd.barrier()  # rank 1 ends first: its shutdown would end the set's steps
    hvd.shutdown()


def amp_overflow(stage="2", extra="amp"):
    """A non-finite gradient in one parameter (on one rank, before the reduction):
    GradScaler skips the step and backs off the scale on every rank alike, sharded
    as unsharded, whichever rank owns that parameter."""
    hvd.init()
    r = hvd.rank()
    extras = set(extra.split("+"))
    trainers = [_Trainer("adamw", 0, extras), _Trainer("adamw", int(stage), extras)]
    for t in trainers:  # the first layer's bias overflows on rank 1 at step 1
        bias = t.model[0].bias
        t.overflow = False
        bias.register_hook(lambda g, t=t: g * float("inf") if (t.overflow and r == 1) else g)
    for step in range(4):
        for t in trainers:
            t.overflow = step == 1
            t.step(step)
    plain, sharded = trainers
    scales = hvd.allgather(torch.tensor([[plain.scaler.get_scale(),
                                          sharded.scaler.get_scale()]]), name="scales")
    assert torch.equal(scales[0], scales[-1]), scales  # the same on every rank
    assert scales[0, 0] == scales[0, 1] == 1024.0 * 0.5 * 1, scales  # one backoff, no growth
    for (name, p), q in zip(plain.model.named_parameters(), sharded.model.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6) if "rs" in extras else \
            torch.equal(p, q), (name, (p - q).abs().max())
    hvd.shutdown()


def synchronize_then_step(extra="rs"):
    """synchronize(), then step() without skip_synchronize() (Horovod warns, and the
    second reduction changes nothing): with reduce-scattered gradients the owned
    gradients are not reduced a second time (with the other ranks' absent ones as
    zeros, which would divide them by the set's size)."""
    import warnings
    hvd.init()
    extras = set(extra.split("+"))
    plain, sharded = _Trainer("sgd", 0, extras), _Trainer("sgd", 2, extras)
    r, n = hvd.rank(), hvd.size()
    for step in range(3):
        for t in (plain, sharded):
            t.opt.zero_grad()
            x, y = _batch(step, r, n)
            ((t.model(x) - y) ** 2).mean().backward()
            t.opt.synchronize()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                t.opt.step()
    for (name, p), q in zip(plain.model.named_parameters(), sharded.model.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), (name, (p - q).abs().max())
    hvd.shutdown()


def amp_overflow_sparse():
    """reduce_scatter_gradients with a sparse embedding gradient (allreduced, then kept
    by its owner only) that overflows on one rank: GradScaler skips the step and backs
    off on every rank, whichever rank owns the embedding."""
    hvd.init()
    r = hvd.rank()
    torch.manual_seed(0)
    emb, head = nn.Embedding(10, 4, sparse=True), nn.Linear(4, 1)
    params = list(emb.parameters()) + list(head.parameters())
    named = [("emb.weight", emb.weight), ("head.weight", head.weight), ("head.bias", head.bias)]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), named_parameters=named,
                                   shard_optimizer_state=2, reduce_scatter_gradients=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    overflow = [False]
    emb.weight.register_hook(lambda g: g * float("inf") if (overflow[0] and r == 1) else g)
    for step in range(3):
        overflow[0] = step == 1
        opt.zero_grad()
        loss = head(emb(torch.tensor([step % 10, (step + 3) % 10]))).sum()
        scaler.scale(loss).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
    scales = hvd.allgather(torch.tensor([scaler.get_scale()]), name="scales")
    assert torch.equal(scales, torch.full_like(scales, 512.0)), scales
    hvd.shutdown()
