"""A torchrun worker that trains several configs in one process group, one after the other
(a launch costs more than a tiny run on a small machine).

    torchrun --nproc_per_node N tests/workers/model_parallel_worker.py RUNS.json

RUNS.json holds a list of argument lists, each as for ./run_train.sh; rank 0 writes
<dump_folder>/stdout.txt with what the run logged, or the `torchacco: error:` line it stopped with.
"""

import contextlib
import io
import json
import sys

import torch.distributed as dist

from torchacco.config import load_config
from torchacco.errors import UserError
from torchacco.trainer import train


def main() -> None:
    dist.init_process_group("gloo")
    for argv in json.loads(open(sys.argv[1]).read()):
        cfg = load_config(argv)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            try:
                train(cfg)
            except UserError as e:  # an expected error (every rank raises it): recorded, then the next run
                out.write(f"torchacco: error: {e}\n")
        if dist.get_rank() == 0:
            with open(f"{cfg.job.dump_folder}/stdout.txt", "w") as f:
                f.write(out.getvalue())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
