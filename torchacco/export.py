"""`torchacco export RUN_DIR [--checkpoint STEP_DIR] [--out DIR] [--dtype fp32|bf16]`

Writes the committed parameters θ of a training checkpoint as a Hugging Face folder
(safetensors with HF names, config.json, tokenizer.json) that `transformers` loads and
`[model] init_from` / `torchacco generate` read. RUN_DIR is the run's dump folder (its
config.toml says how it was trained); the checkpoint defaults to its latest.

It rebuilds the run's strategy and model layout on CPU and reads the checkpoint under the trainer's keys
(`checkpoint.checkpoint_state`): in one process when the model was not split, else on one process per
(pp, tp) coordinate (it starts them itself), whose parts are saved apart. DCP reshards any data-parallel size.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import torch

from torchacco import hf_io, user_model
from torchacco.blocks import unwrap
from torchacco.build import ModelKind, build_data, build_model, build_strategy
from torchacco.checkpoint import Checkpointer
from torchacco.config import load_config
from torchacco.device import DTYPES, Device
from torchacco.errors import UserError, run_cli
from torchacco.lr import TokenSchedule
from torchacco.parallel.diloco import has_outer_step
from torchacco.parallel.model_parallel import apply_model_parallel, gather_stages
from torchacco.parallel.process_groups import destroy, init_distributed
from torchacco.parallel.strategy import UpdatePlan
from torchacco.spec import get_model_spec


def export_hf(model_name: str, kind, strategy, dims, folder: Path, dtype: str, tokenizer) -> Path | None:
    """θ (fp32 from the strategy's committed state) as a Hugging Face folder; rank 0 writes. A collective:
    every rank takes part. `kind`: the run's build.ModelKind."""
    torch_dtype = DTYPES[dtype]
    weights = gather_stages(strategy.theta.full_state_dict(), dims)
    if not dims.is_main:
        return None
    unwrapped = unwrap(strategy.model)
    if kind.foreign:  # a Hugging Face model passed to train(): its own save_pretrained
        return user_model.export(unwrapped, weights, folder, torch_dtype, tokenizer)
    path = str(tokenizer.path) if tokenizer and tokenizer.path else None  # none when the tokenizer is held in memory
    eos = tokenizer.eos_id if tokenizer else None
    return hf_io.save_hf(folder, model_name, unwrapped.args, weights, torch_dtype, tokenizer_path=path, eos_id=eos)


def export(cfg, run_dir: Path, checkpoint: Path | None, out: Path | None) -> Path | None:
    p = cfg.parallelism
    device = Device("cpu")
    dims = init_distributed(device, tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree)
    try:
        checkpointer = Checkpointer(run_dir / cfg.checkpoint.folder, dims.rank, keep=0, async_save=False)
        checkpoint = checkpoint or checkpointer.latest()
        if checkpoint is None:
            raise UserError(f"no checkpoint in {run_dir / cfg.checkpoint.folder}; "
                            "train with [checkpoint] enable = true")  # fmt: skip
        tokenizer, _, _ = build_data(cfg.data, cfg.tokenizer, cfg.training.seq_len, cfg.training.seed, dims)
        spec = get_model_spec(cfg.model.name)
        model = build_model(spec, cfg.model, tokenizer.vocab_size, cfg.training.seed, device)
        model, _ = apply_model_parallel(model, spec, cfg.parallelism, cfg.model, cfg.training, dims, device)
        plan = UpdatePlan(2, TokenSchedule(0.0, 0, 1), 0.0, torch.float32)  # 2: every strategy accepts it
        strategy = build_strategy(model, cfg, dims, plan, device)
        checkpointer.load(checkpoint, {strategy.checkpoint_key(dims): strategy.theta.weights_state_dict()})
        checkpointer.close()
        kind, dtype = ModelKind.of(None, cfg.model), cfg.checkpoint.export_dtype
        path = export_hf(cfg.model.name, kind, strategy, dims, out or run_dir / "hf", dtype, tokenizer)
        strategy.close()
        return path
    finally:
        destroy(barrier=False)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="torchacco export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dir", type=Path, help="the run's dump folder")
    parser.add_argument("--checkpoint", type=Path, help="a step-N folder (default: the latest)")
    parser.add_argument("--out", type=Path, help="output folder (default: RUN_DIR/hf)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    opts = parser.parse_args(argv)

    def run() -> None:
        if not (opts.run_dir / "config.toml").is_file():
            raise UserError(f"{opts.run_dir} is not a torchacco run folder (no "
                            "config.toml); pass the run's --job.dump_folder")  # fmt: skip
        cfg = load_config(["--config", str(opts.run_dir / "config.toml"), "--checkpoint.export_dtype", opts.dtype])
        p = cfg.parallelism
        if has_outer_step(p.replicas, cfg.diloco):
            raise UserError(f"{opts.run_dir} trained with DiLoCo's outer step ({p.replicas} replicas), whose "
                            "checkpoints are not exported offline yet; the run itself exports θ_global at "
                            "its end with [checkpoint] export_hf = true (docs/diloco.md)")  # fmt: skip
        ranks = p.tensor_parallel_degree * p.pipeline_parallel_degree
        if ranks > 1 and "RANK" not in os.environ:  # again, on one CPU process per (pp, tp) coordinate
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
            command += ["-m", "torchacco", "export", *argv]
            if subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}).returncode:
                raise UserError(f"the export on {ranks} processes failed; see the messages above")
            print(f"torchacco: exported {opts.out or opts.run_dir / 'hf'}")
            return
        path = export(cfg, opts.run_dir, opts.checkpoint, opts.out)
        if path is not None:
            print(f"torchacco: exported {path}")

    return run_cli(run, print_errors=int(os.environ.get("RANK", 0)) == 0)
