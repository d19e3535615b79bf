"""Train the density example (``examples/density.py``) with the strategy, devices and accelerator given as flags.

One script for every launcher (the README's "Launching" section); by default ``mgpu_ddp`` on 2 CPU processes (gloo),
2 short epochs::

    python examples/train.py                                                  # Lightning starts the 2 processes
    torchrun --nproc_per_node 2 examples/train.py                             # torchrun starts them
    python -m torch.distributed.launch --nproc_per_node 2 examples/train.py   # the legacy launcher (--local-rank=N)
    python examples/train.py --strategy mgpu_dp                               # 2 virtual CPU replicas in one process
    python examples/train.py --accelerator gpu --devices 4 --max-epochs 15    # 4 GPUs

Everything it writes goes under ``--out`` (default ``runs/train``, relative to the current directory): rank 0 writes
``version_<n>/`` with ``metrics.csv``, ``checkpoints/`` and ``density.png``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lightning as L
from lightning.pytorch.loggers import CSVLogger

import lightning_mgpu

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the examples package must import
    sys.path.insert(0, str(ROOT))

from examples.density import DensityModel, GaussianMixtureData  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", default="mgpu_ddp", help="a registered strategy name (default: mgpu_ddp)")
    parser.add_argument("--accelerator", default="cpu", help="cpu or gpu (default: cpu)")
    parser.add_argument("--devices", type=int, default=2, help="devices (processes under DDP) per node (default: 2)")
    parser.add_argument("--num-nodes", type=int, default=1, help="machines (default: 1)")
    parser.add_argument("--max-epochs", type=int, default=2, help="epochs (default: 2)")
    parser.add_argument("--num-samples", type=int, default=2000, help="training samples (default: 2000)")
    parser.add_argument("--batch-size", type=int, default=250, help="rows per step, per process under DDP")
    parser.add_argument("--out", type=Path, default=Path("runs/train"), help="run folder (default: runs/train)")
    lightning_mgpu.add_local_rank_argument(parser)  # torch.distributed.launch passes --local-rank=N
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    L.seed_everything(0, verbose=False)
    logger = CSVLogger(args.out, name="")
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=args.strategy,
        max_epochs=args.max_epochs,
        default_root_dir=args.out,
        logger=logger,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = GaussianMixtureData(
        num_samples=args.num_samples, num_val_samples=500, num_test_samples=500, batch_size=args.batch_size
    )
    trainer.fit(DensityModel(), datamodule=data)
    if trainer.is_global_zero:
        devices, processes = plural(trainer.num_devices, "device"), plural(trainer.world_size, "process")
        print(f"examples/train.py: {args.strategy}, {devices} in {processes}, {trainer.global_step} training steps")
        print(f"  val_nll:    {trainer.callback_metrics['val_nll'].item():.3f} bits")
        print(f"  run folder: {logger.log_dir}")


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "es" if noun.endswith("s") else "s")


if __name__ == "__main__":
    main()
