"""`python -m torchacco.export RUN_DIR [--checkpoint STEP_DIR] [--out DIR] [--dtype fp32|bf16]`

Writes the committed parameters θ of a training checkpoint as a Hugging Face folder
(safetensors with HF names, config.json, tokenizer.json) that `transformers` loads and
`[model] init_from` / `torchacco.generate` read. Runs in one process: DCP reshards the
checkpoint of any number of ranks onto it. RUN_DIR is the run's dump folder (its
config.toml says how it was trained); the checkpoint defaults to its latest.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from torchacco.errors import UserError, run_cli


def export(run_dir: Path, checkpoint: Path | None, out: Path | None, dtype: str) -> Path:
    import torch

    from torchacco.checkpoint import Checkpointer
    from torchacco.config import load_config
    from torchacco.device import Device
    from torchacco.lr import TokenSchedule
    from torchacco.parallel.data_parallel import build_data_parallel
    from torchacco.parallel.dims import destroy, init_distributed
    from torchacco.trainer import build_data, build_model, export_hf

    if not (run_dir / "config.toml").is_file():
        raise UserError(f"{run_dir} is not a torchacco run folder (no config.toml); pass the run's --job.dump_folder")
    cfg = load_config(["--config", str(run_dir / "config.toml"), "--checkpoint.export_dtype", dtype])
    device = Device("cpu")
    dims = init_distributed(device)
    try:
        tokenizer, _, _ = build_data(cfg, dims)
        model = build_model(cfg, tokenizer.vocab_size, device)
        dp = build_data_parallel(model, cfg, dims, 2, TokenSchedule(0.0, 0, 1), torch.float32, device)
        checkpointer = Checkpointer(run_dir / cfg.checkpoint.folder, 0, keep=0, async_save=False)
        checkpoint = checkpoint or checkpointer.latest()
        if checkpoint is None:
            raise UserError(f"no checkpoint in {run_dir / cfg.checkpoint.folder}; train with [checkpoint] enable = true")
        checkpointer.load(checkpoint, {"dp": dp.weights_state_dict()})
        checkpointer.close()
        path = export_hf(cfg, dp, dims, out or run_dir / "hf", tokenizer)
        dp.close()
        return path
    finally:
        destroy(barrier=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchacco.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="the run's dump folder")
    parser.add_argument("--checkpoint", type=Path, help="a step-N folder (default: the latest)")
    parser.add_argument("--out", type=Path, help="output folder (default: RUN_DIR/hf)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    opts = parser.parse_args(argv)
    return run_cli(lambda: print(f"torchacco: exported {export(opts.run_dir, opts.checkpoint, opts.out, opts.dtype)}"))


if __name__ == "__main__":
    sys.exit(main())
