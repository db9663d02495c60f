"""A Lightning 2.x training run on HorovodStrategy, started by tests/test_lightning.py
as ``horovodrun -np 2 python -m tests.lightning_workers OUT_DIR``. Every rank fits the
same tiny regression model in several configurations and saves what it ended with
(parameters, synced metrics, what it saw of the strategy) to OUT_DIR."""
import os
import sys
import warnings

import torch

DIM, ROWS, EPOCHS, LR = 4, 16, 2, 0.1
COMBINED_BATCH = 8


def data(rows=ROWS, seed=1234):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, DIM, generator=g)
    y = x @ torch.arange(1.0, DIM + 1).unsqueeze(1) + 0.5
    return x, y


def reference(lr=LR, epochs=EPOCHS, world=2, per_rank=COMBINED_BATCH // 2, clip=None):
    """One process, plain torch: each step on the combined batch of all ranks, the
    rows Lightning's DistributedSampler (shuffled, seed 0, set_epoch per epoch) gives
    each rank."""
    from torch.utils.data import DistributedSampler
    x, y = data()
    torch.manual_seed(0)
    model = torch.nn.Linear(DIM, 1)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    samplers = [DistributedSampler(range(ROWS), num_replicas=world, rank=r, shuffle=True,
                                   seed=0) for r in range(world)]
    for epoch in range(epochs):
        rows_per_step = per_rank[epoch] if isinstance(per_rank, (list, tuple)) else per_rank
        shards = []
        for sampler in samplers:
            sampler.set_epoch(epoch)
            shards.append(list(sampler))
        for i in range(0, ROWS // world, rows_per_step):
            rows = [j for shard in shards for j in shard[i:i + rows_per_step]]
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
    return [p.detach().clone() for p in model.parameters()]


CONFIGS = {
    # name: (per-rank batch, accumulate_grad_batches, strategy kwargs, lr, clip norm)
    "plain": (4, 1, {}, LR, None),
    "accumulate": (2, 2, {}, LR, None),
    "fp16": (4, 1, {"compression": "fp16"}, LR, None),
    "scale_lr": (4, 1, {"scale_lr": True}, LR / 2, None),
    # clipping must see the averaged gradient (the clip norm bites on every step)
    "clip": (4, 1, {}, LR, 0.5),
    # GradientAccumulationScheduler({0: 1, 1: 2}) with batches of 2: 2 rows per rank
    # and step in epoch 0, 4 in epoch 1
    "acc_schedule": (2, "schedule", {}, LR, None),
}
REFERENCE_ROWS = {"accumulate": 4, "acc_schedule": [2, 4]}


def main(out_dir: str) -> None:
    import lightning as L
    from lightning.fabric.plugins import TorchCheckpointIO
    from lightning.pytorch.callbacks import GradientAccumulationScheduler, ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    import horovod_torch as hvd
    from horovod_torch.lightning import HorovodStrategy

    warnings.filterwarnings("ignore")
    hvd.init()
    rank = hvd.rank()

    class RecordingIO(TorchCheckpointIO):
        def save_checkpoint(self, checkpoint, path, storage_options=None):
            with open(os.path.join(out_dir, "saves.log"), "a") as f:
                f.write(f"{hvd.rank()} {path}\n")
            super().save_checkpoint(checkpoint, path, storage_options=storage_options)

    class Model(L.LightningModule):
        def __init__(self, lr):
            super().__init__()
            torch.manual_seed(rank)  # rank 1 starts elsewhere: the strategy broadcasts
            self.layer = torch.nn.Linear(DIM, 1)
            self.lr = lr
            self.checks = {}

        def training_step(self, batch, batch_idx):
            x, y = batch
            if not self.checks:
                sampler = self.trainer.train_dataloader.sampler
                self.checks = dict(
                    global_rank=self.trainer.global_rank, world_size=self.trainer.world_size,
                    is_global_zero=self.trainer.is_global_zero,
                    sampler=type(sampler).__name__,
                    sampler_replicas=getattr(sampler, "num_replicas", None),
                    sampler_rank=getattr(sampler, "rank", None),
                    broadcast=self.trainer.strategy.broadcast(f"from {rank}"),
                    gathered=self.all_gather(torch.tensor([float(rank)])).tolist(),
                    any_rank1=self.trainer.strategy.reduce_boolean_decision(rank == 1,
                                                                            all=False),
                    all_rank1=self.trainer.strategy.reduce_boolean_decision(rank == 1))
                self.trainer.strategy.barrier("check")
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
            self.log("train_loss", loss, sync_dist=True)
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y),
                     sync_dist=True)
            self.log("rank_mean", float(rank), sync_dist=True)
            self.log("rank_sum", float(rank), sync_dist=True, reduce_fx="sum")
            self.log("rank_max", float(rank), sync_dist=True, reduce_fx="max")

        def test_step(self, batch, batch_idx):  # runs under torch.inference_mode()
            x, y = batch
            self.log("test_loss", torch.nn.functional.mse_loss(self.layer(x), y),
                     sync_dist=True)
            self.log("test_rank_mean", float(rank), sync_dist=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.lr)

    x, y = data()
    vx, vy = data(8, seed=99)
    for name, (batch, accumulate, kwargs, lr, clip) in CONFIGS.items():
        model = Model(lr)
        callbacks, io = [], None
        if accumulate == "schedule":
            callbacks, accumulate = [GradientAccumulationScheduler({0: 1, 1: 2})], 1
        if name == "plain":
            callbacks = [ModelCheckpoint(dirpath=os.path.join(out_dir, "ckpt"),
                                         save_last=True, save_top_k=-1)]
            io = RecordingIO()
        trainer = L.Trainer(
            strategy=HorovodStrategy(checkpoint_io=io, **kwargs), accelerator="cpu",
            devices=1, max_epochs=EPOCHS, accumulate_grad_batches=accumulate,
            gradient_clip_val=clip,
            logger=False, enable_progress_bar=False, enable_model_summary=False,
            enable_checkpointing=name == "plain", callbacks=callbacks,
            default_root_dir=os.path.join(out_dir, name), num_sanity_val_steps=0)
        trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=batch),
                    DataLoader(TensorDataset(vx, vy), batch_size=2))
        passes = [getattr(o, "backward_passes_per_step", None) for o in trainer.optimizers]
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        tested = {}
        if name == "plain":
            tested = trainer.test(model, DataLoader(TensorDataset(vx, vy), batch_size=2),
                                  verbose=False)[0]
        torch.save(dict(
            params=[p.detach().clone() for p in model.layer.parameters()],
            metrics=metrics,
            checks=model.checks, passes=passes, tested=tested,
            optimizer_class=[type(o).__module__ for o in trainer.optimizers]),
            os.path.join(out_dir, f"{name}.rank{rank}.pt"))
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
