"""Load a run's checkpoint into its strategy on this many ranks and save it again, untouched.

    torchrun --nproc_per_node N tests/reshard_worker.py RUN_DIR CHECKPOINT OUT_FOLDER
"""

import sys
from pathlib import Path

import torch

from torchacco.checkpoint import Checkpointer, TrainState
from torchacco.config import load_config
from torchacco.device import Device
from torchacco.lr import TokenSchedule
from torchacco.parallel.data_parallel import build_data_parallel
from torchacco.parallel.dims import destroy, init_distributed
from torchacco.trainer import build_data, build_model


def main(run_dir: str, checkpoint: str, out: str) -> None:
    cfg = load_config(["--config", str(Path(run_dir) / "config.toml")])
    device = Device("cpu")
    dims = init_distributed(device)
    tokenizer, _, _ = build_data(cfg, dims)
    model = build_model(cfg, tokenizer.vocab_size, device)
    dp = build_data_parallel(model, cfg, dims, 2, TokenSchedule(1e-3, 0, 1000), torch.float32, device)
    checkpointer = Checkpointer(Path(out), dims.rank, keep=0, async_save=False)
    state = TrainState(dims.dp_size)
    checkpointer.load(Path(checkpoint), {"train": state, "dp": dp})
    checkpointer.save(state.step, {"train": state, "dp": dp})
    checkpointer.close()
    dp.close()
    destroy()


if __name__ == "__main__":
    main(*sys.argv[1:])
