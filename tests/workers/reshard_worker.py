"""Load a run's checkpoint into its strategy on this many ranks and save it again, untouched.

torchrun --nproc_per_node N tests/workers/reshard_worker.py RUN_DIR CHECKPOINT OUT_FOLDER
"""

import sys
from pathlib import Path

import torch

from torchacco.build import build_data, build_model, build_strategy
from torchacco.checkpoint import Checkpointer, TrainState
from torchacco.config import load_config
from torchacco.device import Device
from torchacco.lr import TokenSchedule
from torchacco.parallel.process_groups import destroy, init_distributed
from torchacco.parallel.strategy import UpdatePlan
from torchacco.spec import get_model_spec


def main(run_dir: str, checkpoint: str, out: str) -> None:
    cfg = load_config(["--config", str(Path(run_dir) / "config.toml")])
    device = Device("cpu")
    dims = init_distributed(device)
    tokenizer, _, _ = build_data(cfg.data, cfg.tokenizer, cfg.training.seq_len, cfg.training.seed, dims)
    model = build_model(get_model_spec(cfg.model.name), cfg.model, tokenizer.vocab_size, cfg.training.seed, device)
    plan = UpdatePlan(2, TokenSchedule(1e-3, 0, 1000), cfg.training.max_norm, torch.float32)
    dp = build_strategy(model, cfg, dims, plan, device)
    checkpointer = Checkpointer(Path(out), dims.rank, keep=0, async_save=False)
    state = TrainState(dims.dp_size)
    checkpointer.load(Path(checkpoint), {"train": state, "dp": dp})
    checkpointer.save(state.step, {"train": state, "dp": dp})
    checkpointer.close()
    dp.close()
    destroy()


if __name__ == "__main__":
    main(*sys.argv[1:])
