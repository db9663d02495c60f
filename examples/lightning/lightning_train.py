"""Lightning 2.x on horovod_torch: a LightningModule trained with HorovodStrategy.
On a laptop (synthetic data, CPU):

    horovodrun -np 2 python examples/lightning/lightning_train.py
    python examples/lightning/lightning_train.py          # one process works too

Each rank gets its part of the data from Lightning's DistributedSampler, gradients are
averaged by ``hvd.DistributedOptimizer`` (``--fp16`` compresses them on the wire),
``self.log(..., sync_dist=True)`` averages metrics over the ranks, and checkpoints are
written by rank 0 only.
"""
import argparse
import glob
import os
import sys

# Run from a checkout: use it when its extension is built in place (`make build`); an
# unbuilt one would hide an installed horovod_torch.
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if glob.glob(os.path.join(_REPO, "horovod_torch", "_C*.so")):
    sys.path.insert(0, _REPO)

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from horovod_torch.lightning import HorovodStrategy  # noqa: E402


class Classifier(L.LightningModule):
    def __init__(self, lr):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(),
                                       torch.nn.Linear(64, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.log("val_loss", torch.nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(dim=1) == y).float().mean(), sync_dist=True,
                 prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def synthetic(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 20, generator=g)
    y = (x[:, :4] * torch.tensor([1.0, 2.0, 3.0, 4.0])).argmax(dim=1)
    return TensorDataset(x, y)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--fp16", action="store_true", help="fp16 gradient compression")
    parser.add_argument("--out", default="lightning_logs_horovod")
    args = parser.parse_args()

    L.seed_everything(42)
    strategy = HorovodStrategy(compression="fp16" if args.fp16 else None)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1,
                        max_epochs=args.epochs, accumulate_grad_batches=args.accumulate,
                        default_root_dir=args.out, logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
    model = Classifier(args.lr)
    trainer.fit(model, DataLoader(synthetic(2048, 0), batch_size=args.batch_size),
                DataLoader(synthetic(512, 1), batch_size=args.batch_size))
    if trainer.is_global_zero:
        metrics = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items()}
        print(f"world size {trainer.world_size}: {metrics}")
        print("checkpoints:", trainer.checkpoint_callback.best_model_path)


if __name__ == "__main__":
    main()
