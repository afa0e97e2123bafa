"""`python -m benchmarks fault-goodput`: DiLoCo replicas that survive failures ([diloco] fault_tolerant) on the
emulated cluster, one replica per node. An undisturbed run, then the same run with replica 1's worker SIGKILLed
every --kill-every seconds and restarted by its torchrun agent. Reports the survivor's speed against the undisturbed
run's (goodput), the tokens merged per second, each heal's copy against the state's bytes over the link, and the
final losses. Needs root.

    sudo .venv/bin/python -m benchmarks fault-goodput --updates 6000 --kill-every 300
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import time
from pathlib import Path

from benchmarks.cluster import ClusterPlan, preflight
from benchmarks.cluster.launch import node_env, read_records
from benchmarks.cluster.namespaces import Cluster
from benchmarks.common import DDP, QUIET, meta, panels, recipe, save_figure, update_s, write_report
from torchacco.errors import run_cli
from torchacco.fault_tolerance import ENV_LIGHTHOUSE, ENV_REPLICA

LIGHTHOUSE_PORT, RDZV_PORT = 29510, 29400
HEALED = re.compile(r"healed from a live replica in ([\d.]+) s \(the copy: ([\d.]+) MiB in ([\d.]+) s\)")


def train_args(updates: int, seed: int) -> list[str]:
    """The yardstick's recipe as 2 fault-tolerant replicas of DDP on one rank each, H = 10, plain fp32 averaging."""
    diloco = ["--parallelism.replicas", "2", "--parallelism.data_parallel", DDP, "--diloco.fault_tolerant", "true",
              "--diloco.sync_every", "10", "--diloco.outer_lr", "1", "--diloco.outer_momentum", "0",
              "--training.num_threads", "1"]  # fmt: skip
    return recipe(updates, 3e-3, seed, [*QUIET, *diloco])


def agent(plan: ClusterPlan, i: int, args: list[str]) -> list[str]:
    """Replica i's torchrun agent on node i: its own rendezvous there, and restarts without end."""
    address = plan.address(i)
    rendezvous = ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"{address}:{RDZV_PORT}", "--rdzv_id", f"replica{i}",
                  "--rdzv_conf", "is_host=1", "--local_addr", address]  # fmt: skip
    return [sys.executable, "-m", "torchacco.launch", "--nnodes", "1", "--nproc_per_node", "1", *rendezvous,
            "--max_restarts", "1000", "--monitor_interval", "0.5", "-m", "torchacco.train", *args]  # fmt: skip


def kill_worker(replica: int) -> bool:
    """SIGKILL the training process of `replica` (not its agent), as a lost machine would end it."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"torchacco.train" in cmdline and b"torchacco.launch" not in cmdline:
            if f"{ENV_REPLICA}={replica}".encode() in environ:
                os.kill(int(pid), signal.SIGKILL)
                return True
    return False


def run(plan: ClusterPlan, args: list[str], folder: Path, kill_every: float, timeout_s: float) -> dict:
    """One run until replica 0 finishes; replica 1 killed every `kill_every` seconds (0: never)."""
    folder.mkdir(parents=True, exist_ok=True)
    args = [*args, "--job.dump_folder", str(folder), "--job.overwrite", "true"]
    env = node_env(1, {ENV_LIGHTHOUSE: f"http://{plan.address(0)}:{LIGHTHOUSE_PORT}"})
    kills, started = [], time.monotonic()
    with Cluster(plan) as cluster:
        lighthouse = [sys.executable, "-m", "torchacco.fault_tolerance", "--bind", f"[::]:{LIGHTHOUSE_PORT}"]
        cluster.launch(0, lighthouse, env, folder / "lighthouse.log")
        time.sleep(2.0)
        agents = [cluster.launch(i, agent(plan, i, args), {**env, ENV_REPLICA: str(i)}, folder / f"node{i}.log")
                  for i in range(2)]  # fmt: skip
        while agents[0].poll() is None:
            elapsed = time.monotonic() - started
            if elapsed > timeout_s:
                raise SystemExit(f"torchacco: error: the run did not finish in {timeout_s:.0f} s ({folder}/node*.log)")
            if kill_every and elapsed > kill_every * (len(kills) + 1) and kill_worker(1):
                kills.append(round(elapsed, 1))
            time.sleep(0.5)
        wall = time.monotonic() - started
        if agents[0].returncode:
            raise SystemExit(f"torchacco: error: replica 0 failed ({folder}/node0.log)")
    records = read_records(folder)
    outer = [r for r in records if "outer_step" in r]
    heals = [tuple(map(float, m)) for m in HEALED.findall((folder / "node1.log").read_text())]
    return {
        "wall_s": wall,
        "train_s": sum(update_s(r) for r in records),  # the survivor's updates, evaluation left out
        "updates": len(records),
        "merged_tokens": sum(r["outer_merged_tokens"] for r in outer),
        "replicas_per_outer_step": [r["outer_replicas"] for r in outer],
        "final_val_loss": next(r["val_loss"] for r in reversed(records) if "val_loss" in r),
        "kills_s": kills,
        "heals": [{"wait_and_copy_s": a, "mib": b, "copy_s": c} for a, b, c in heals],
    }


def markdown(result: dict) -> str:
    calm, hit, link = result["undisturbed"], result["killed"], result["link_mbit_s"]
    heals = hit["heals"]
    wire = [h["mib"] * 8 * 2**20 / (link * 1e6) for h in heals]  # the state's bytes over the link
    lines = [
        f"# Fault-tolerant DiLoCo under kills ({result['meta']['date']})",
        "",
        f"{result['meta']['machine']}; `{result['meta']['command']}`. Two replicas (one node each, "
        f"{link:.0f} Mbit/s), {calm['updates']} updates; replica 1 SIGKILLed every {result['kill_every_s']:.0f} s "
        f"({len(hit['kills_s'])} kills) and restarted by its agent.",
        "",
        "| | undisturbed | killed | ratio |",
        "|---|---:|---:|---:|",
        f"| the survivor's training seconds | {calm['train_s']:.1f} | {hit['train_s']:.1f} | "
        f"goodput **{calm['train_s'] / hit['train_s']:.3f}** |",
        f"| wall seconds | {calm['wall_s']:.1f} | {hit['wall_s']:.1f} | {calm['wall_s'] / hit['wall_s']:.3f} |",
        f"| loss tokens merged per wall second | {calm['merged_tokens'] / calm['wall_s']:,.0f} | "
        f"{hit['merged_tokens'] / hit['wall_s']:,.0f} | "
        f"{hit['merged_tokens'] / hit['wall_s'] / (calm['merged_tokens'] / calm['wall_s']):.3f} |",
        f"| final validation loss (replica 0) | {calm['final_val_loss']:.4f} | {hit['final_val_loss']:.4f} | "
        f"{hit['final_val_loss'] / calm['final_val_loss'] - 1:+.2%} |",
        "",
        "| heal | wait for the round and copy (s) | copy alone (s) | state (MiB) | its bytes over the link (s) | "
        "copy ÷ link |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for i, (h, w) in enumerate(zip(heals, wire), 1):
        lines.append(f"| {i} | {h['wait_and_copy_s']:.1f} | {h['copy_s']:.2f} | {h['mib']:.1f} | {w:.2f} | "
                     f"{h['copy_s'] / w:.2f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def draw(folder: Path, result: dict, path: Path) -> None:
    """The survivor's loss against its training seconds, both runs, and the replicas of each outer step."""
    found = panels(2, width=6.0)
    if found is None:
        return
    fig, (loss, present) = found
    for name in ("undisturbed", "killed"):
        records = read_records(folder / name)
        seconds = [0.0]
        for r in records[1:]:
            seconds.append(seconds[-1] + update_s(r))
        loss.plot(seconds[::10], [r["loss"] for r in records][::10], label=name, lw=0.8)
        outer = [r for r in records if "outer_step" in r]
        present.step([r["step"] for r in outer], [r["outer_replicas"] for r in outer], label=name, where="post")
    loss.set(xlabel="replica 0's training seconds", ylabel="training loss", title="the survivor")
    present.set(xlabel="update", ylabel="replicas in the outer step", ylim=(0, 2.5))
    loss.legend()
    present.legend()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks fault-goodput", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--updates", type=int, default=6000, help="updates of each run")
    parser.add_argument("--kill-every", type=float, default=300.0, help="seconds between kills of replica 1")
    parser.add_argument("--rate", type=float, default=114.0, help="the link between the nodes, Mbit/s")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench_results"))
    parser.add_argument("--timeout-s", type=float, default=5400.0, help="for each run")
    args = parser.parse_args(argv)

    def measure() -> None:
        preflight()  # root, ip and tc, or one line (ClusterError)
        plan = ClusterPlan(nodes=2, rate_bps=args.rate * 1e6)
        train = train_args(args.updates, args.seed)
        folder = args.out / "fault_goodput_runs"
        result = {"meta": meta("fault-goodput", argv), "link_mbit_s": args.rate, "kill_every_s": args.kill_every}
        result["undisturbed"] = run(plan, train, folder / "undisturbed", 0, args.timeout_s)
        result["killed"] = run(plan, train, folder / "killed", args.kill_every, args.timeout_s)
        write_report(args.out, "fault_goodput", result, markdown(result), lambda path: draw(folder, result, path))
        print(markdown(result))

    return run_cli(measure)


if __name__ == "__main__":
    sys.exit(main())
