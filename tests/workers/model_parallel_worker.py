"""A torchrun worker that trains several configs in one process group, one after the other
(a launch costs more than a tiny run on a small machine).

    torchrun --nproc_per_node N tests/workers/model_parallel_worker.py RUNS.json

RUNS.json holds a list of argument lists, each as for ./run_train.sh; rank 0 writes
<dump_folder>/stdout.txt with what the run logged, or the `torchacco: error:` line it stopped with.

With TORCH_FR_BUFFER_SIZE set, every rank also writes <dump_folder>/collectives_rank<r>.json: each
collective of the run with its group, operation and issuing thread (torch's flight recorder sees
every gloo collective, those DTensor issues from C++ included; the ring's point-to-point messages,
which it does not record, are logged here), and when each communication job was in flight.
"""

import contextlib
import io
import json
import os
import pickle
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.distributed.distributed_c10d import _resolve_process_group

from torchacco import runners
from torchacco.config import load_config
from torchacco.errors import UserError
from torchacco.parallel import collectives
from torchacco.trainer import train


class CollectiveLog:
    """Job intervals and ring messages, in the flight recorder's clock (ns since the epoch)."""

    def __init__(self):
        self.jobs: list[list[int]] = []  # [launched, waited for]
        self.p2p: list[dict] = []
        self.comm_threads: set[int] = set()
        launch, wait, exchange = runners.ThreadRunner.launch, runners.ThreadRunner.wait, collectives._exchange

        def logged_launch(runner, job):
            self.comm_threads.add(runner._thread.ident)
            self.jobs.append([time.time_ns(), None])
            return launch(runner, job)

        def logged_wait(runner, timeout_s=None):
            in_flight = runner.in_flight()
            try:
                return wait(runner, timeout_s)
            finally:
                if in_flight:
                    self.jobs[-1][1] = time.time_ns()

        def logged_exchange(send, dst, recv, src, group, rank):
            group = group or dist.group.WORLD
            self.p2p.append(
                {"t": time.time_ns(), "group": group.group_name, "op": "ring_exchange", "thread": threading.get_ident()}
            )
            return exchange(send, dst, recv, src, group, rank)

        self.destroyed: dict[str, list[int]] = {}  # the ranks of groups a run destroyed (preemption, checkpoint)
        destroy = dist.destroy_process_group

        def logged_destroy(group=None):
            if group is not None:
                self.destroyed[group.group_name] = dist.get_process_group_ranks(group)
            return destroy(group)

        dist.destroy_process_group = logged_destroy
        runners.ThreadRunner.launch, runners.ThreadRunner.wait = logged_launch, logged_wait
        collectives._exchange = logged_exchange

    def write(self, path: str, start_ns: int) -> None:
        trace = pickle.loads(torch._C._distributed_c10d._dump_fr_trace(True, True, False))
        recorded = [
            {
                "t": e["time_created_ns"],
                "group": e["process_group"][0],
                "seq": e["collective_seq_id"],
                "op": e["profiling_name"],
                "thread": int(e["thread_id"]),
                "timeout_ms": e["timeout_ms"],
            }
            for e in trace["entries"]
            if e["time_created_ns"] >= start_ns
        ]
        collectives = sorted(recorded + [p for p in self.p2p if p["t"] >= start_ns], key=lambda c: c["t"])
        names = {c["group"] for c in collectives}
        record = {
            "collectives": collectives,
            "jobs": [j for j in self.jobs if j[0] >= start_ns],
            "comm_threads": sorted(self.comm_threads),
            "main_thread": threading.main_thread().ident,
            "group_ranks": {name: self.destroyed.get(name) or _ranks(name) for name in names},
        }
        with open(path, "w") as f:
            json.dump(record, f)


def _ranks(group_name: str) -> list[int] | None:
    """The global ranks of a group, None once it was destroyed (a checkpoint's group, at the run's end)."""
    try:
        return dist.get_process_group_ranks(_resolve_process_group(group_name))
    except RuntimeError:
        return None


def main() -> None:
    log = CollectiveLog() if os.environ.get("TORCH_FR_BUFFER_SIZE") else None
    dist.init_process_group("gloo")
    for argv in json.loads(open(sys.argv[1]).read()):
        cfg = load_config(argv)
        out = io.StringIO()
        torch._dynamo.reset()  # each run compiles its own (a block compiled for an earlier run would be reused)
        counters.clear()
        start = time.time_ns()
        with contextlib.redirect_stdout(out):
            try:
                train(cfg)
            except UserError as e:  # an expected error (every rank raises it): recorded, then the next run
                out.write(f"torchacco: error: {e}\n")
        if log is not None:
            log.write(f"{cfg.job.dump_folder}/collectives_rank{dist.get_rank()}.json", start)
        if dist.get_rank() == 0:
            with open(f"{cfg.job.dump_folder}/stdout.txt", "w") as f:
                f.write(out.getvalue())
            with open(f"{cfg.job.dump_folder}/compiled_frames.txt", "w") as f:  # what torch.compile compiled
                f.write(str(counters["frames"]["ok"]))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
