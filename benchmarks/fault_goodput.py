"""`python -m benchmarks fault-goodput`: DiLoCo replicas that survive failures ([diloco] fault_tolerant) on the
emulated cluster, one replica per node. An undisturbed run, then the same run with a fault on replica 1 every
--every seconds, the kinds of --faults in turn:
- kill: its worker SIGKILLed, and restarted by its torchrun agent;
- cut: its node's link down (the cable pulled) while the node sends, i.e. mid-transfer, for --outage-s, then up;
- stall: its worker stopped (SIGSTOP) while its node sends, for --outage-s, then continued (the kernel still
  sends what the worker had written to its sockets).
Reports the survivor's speed against the undisturbed run's (goodput), the tokens merged per second, the survivor's
longest waits, each heal's copy against the state's bytes over the link, and the final losses. Needs root.

    sudo .venv/bin/python -m benchmarks fault-goodput --updates 23000 --every 300 --faults kill,cut,stall
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import time
from itertools import accumulate
from pathlib import Path

from benchmarks import common
from benchmarks.cluster import ClusterPlan, host, preflight
from benchmarks.cluster.launch import node_env, read_records
from benchmarks.cluster.namespaces import Cluster
from benchmarks.common import DDP, QUIET, bare_parser, meta, panels, recipe, save_figure, update_s, write_report
from torchacco.errors import run_cli
from torchacco.fault_tolerance import ENV_LIGHTHOUSE, ENV_REPLICA

LIGHTHOUSE_PORT, RDZV_PORT = 29510, 29400
HEALED = re.compile(r"healed from a live replica in ([\d.]+) s \(the copy: ([\d.]+) MiB in ([\d.]+) s\)")
KINDS = ("kill", "cut", "stall")
ROUND_TIMEOUT_S = 10.0  # ~40x the pseudo-gradient's time over the link (3.4 MB at 114 Mbit/s)


def train_args(updates: int, seed: int) -> list[str]:
    """The yardstick's recipe as 2 fault-tolerant replicas of DDP on one rank each, H = 10, plain fp32 averaging."""
    diloco = ["--parallelism.replicas", "2", "--parallelism.data_parallel", DDP, "--diloco.fault_tolerant", "true",
              "--diloco.sync_every", "10", "--diloco.outer_lr", "1", "--diloco.outer_momentum", "0",
              "--diloco.round_timeout_s", str(ROUND_TIMEOUT_S), "--training.num_threads", "1"]  # fmt: skip
    return recipe(updates, 3e-3, seed, [*QUIET, *diloco])


def agent(plan: ClusterPlan, i: int, args: list[str]) -> list[str]:
    """Replica i's torchrun agent on node i: its own rendezvous there, and restarts without end."""
    address = plan.address(i)
    rendezvous = ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"{address}:{RDZV_PORT}", "--rdzv_id", f"replica{i}",
                  "--rdzv_conf", "is_host=1", "--local_addr", address]  # fmt: skip
    return [sys.executable, "-m", "torchacco.launch", "--nnodes", "1", "--nproc_per_node", "1", *rendezvous,
            "--max_restarts", "1000", "--monitor_interval", "0.5", "-m", "torchacco.train", *args]  # fmt: skip


def worker(replica: int) -> int | None:
    """The pid of `replica`'s training process (not its agent)."""
    for pid, cmd, env, _ in common.trainers():
        if b"torchacco.launch" not in cmd.split(b"\0") and env.get(ENV_REPLICA.encode()) == str(replica).encode():
            return pid
    return None


def sent_bytes(pid: int) -> int:
    """The bytes its node has sent (its network namespace's eth0, as the process sees it)."""
    for line in Path(f"/proc/{pid}/net/dev").read_text().splitlines():
        name, _, fields = line.partition(":")
        if name.strip() == "eth0":
            return int(fields.split()[8])
    return 0


def wait_for_transfer(pid: int, wait_s: float = 60.0) -> bool:
    """Until its node sends more than 20 kB in 20 ms (an outer step's exchange on the wire): True; False after
    `wait_s` without one."""
    deadline, before = time.monotonic() + wait_s, sent_bytes(pid)
    while time.monotonic() < deadline:
        time.sleep(0.02)
        now = sent_bytes(pid)
        if now - before > 20_000:
            return True
        before = now
    return False


class Injector:
    """Replica 1's faults, one every `every` seconds, the kinds in turn; each cut or stall ends `outage_s` later."""

    def __init__(self, plan: ClusterPlan, kinds: list[str], every: float, outage_s: float):
        self.plan, self.kinds, self.every, self.outage_s = plan, kinds, every, outage_s
        self.events: list[dict] = []
        self._undo = None  # (when, what) of the outage in progress

    def poll(self, started: float) -> None:
        """Ends the outage in progress when due, else starts the next fault when due (seconds since `started`)."""
        if self._undo and time.monotonic() - started >= self._undo[0]:
            self._undo[1]()
            self._undo = None
        if not self.every or self._undo or time.monotonic() - started < self.every * (len(self.events) + 1):
            return
        kind, pid = self.kinds[len(self.events) % len(self.kinds)], worker(1)
        if pid is None:  # (restarting: try again at the next poll)
            return
        event = {"kind": kind}
        if kind == "kill":
            os.kill(pid, signal.SIGKILL)
        else:  # a cut or a stall: begun mid-transfer, ended `outage_s` later
            port = ["ip", "-n", self.plan.switch, "link", "set", "p1"]
            up = {"cut": lambda on: host.run([*port, "up" if on else "down"]),
                  "stall": lambda on: os.kill(pid, signal.SIGCONT if on else signal.SIGSTOP)}[kind]  # fmt: skip
            event["mid_transfer"] = wait_for_transfer(pid)
            up(False)
            self._undo = (time.monotonic() - started + self.outage_s, lambda: up(True))
        event["at_s"] = round(time.monotonic() - started, 1)
        self.events.append(event)


def survivor_waits(records: list[dict], over_s: float = 1.0) -> list[float]:
    """The survivor's updates that took longer than `over_s` (its share of each fault: failed rounds and waits)."""
    return [round(update_s(r), 1) for r in records if update_s(r) > over_s]


def run(plan: ClusterPlan, args: list[str], folder: Path, injector: Injector, timeout_s: float) -> dict:
    """One run until replica 0 finishes, with the injector's faults on replica 1."""
    folder.mkdir(parents=True, exist_ok=True)
    args = [*args, "--job.dump_folder", str(folder), "--job.overwrite", "true"]
    env = node_env(1, {ENV_LIGHTHOUSE: f"http://{plan.address(0)}:{LIGHTHOUSE_PORT}"})
    started = time.monotonic()
    with Cluster(plan) as cluster:
        lighthouse = [sys.executable, "-m", "torchacco", "lighthouse", "--bind", f"[::]:{LIGHTHOUSE_PORT}"]
        cluster.launch(0, lighthouse, env, folder / "lighthouse.log")
        time.sleep(2.0)
        agents = [cluster.launch(i, agent(plan, i, args), {**env, ENV_REPLICA: str(i)}, folder / f"node{i}.log")
                  for i in range(2)]  # fmt: skip
        while agents[0].poll() is None:
            if time.monotonic() - started > timeout_s:
                raise SystemExit(f"torchacco: error: the run did not finish in {timeout_s:.0f} s ({folder}/node*.log)")
            injector.poll(started)
            time.sleep(0.5)
        wall = time.monotonic() - started
        if agents[0].returncode:
            raise SystemExit(f"torchacco: error: replica 0 failed ({folder}/node0.log)")
    records = read_records(folder)
    outer = [r for r in records if "outer_step" in r]
    heals = [tuple(map(float, m)) for m in HEALED.findall((folder / "node1.log").read_text())]
    # train_s: the survivor's updates, evaluation left out
    return {"wall_s": wall, "train_s": sum(map(update_s, records)), "updates": len(records),
            "merged_tokens": sum(r["outer_merged_tokens"] for r in outer),
            "replicas_per_outer_step": [r["outer_replicas"] for r in outer],
            "final_val_loss": next(r["val_loss"] for r in reversed(records) if "val_loss" in r),
            "faults": injector.events, "survivor_waits_s": survivor_waits(records),
            "heals": [{"wait_and_copy_s": a, "mib": b, "copy_s": c} for a, b, c in heals]}  # fmt: skip


def markdown(result: dict) -> str:
    calm, hit, link = result["undisturbed"], result["faulted"], result["link_mbit_s"]
    heals, faults = hit["heals"], hit["faults"]
    wire = [h["mib"] * 8 * 2**20 / (link * 1e6) for h in heals]  # the state's bytes over the link
    said = {"kill": "SIGKILLed", "cut": f"link cut mid-transfer for {result['outage_s']:.0f} s",
            "stall": f"stopped mid-transfer for {result['outage_s']:.0f} s"}  # fmt: skip
    listed = "; ".join(f"{f['at_s']:.0f} s: {said[f['kind']]}" + ("" if f.get("mid_transfer", True) else
                       " (no transfer seen within 60 s)") for f in faults)  # fmt: skip
    reused = f" The undisturbed run is from {calm['from']}." if "from" in calm else ""
    merged = [run["merged_tokens"] / run["wall_s"] for run in (calm, hit)]
    waits = [", ".join(f"{w:g}" for w in run["survivor_waits_s"]) or "none" for run in (hit, calm)]
    lines = [f"# Fault-tolerant DiLoCo under faults ({result['meta']['date']})", "",
             f"{result['meta']['machine']}; `{result['meta']['command']}`. Two replicas (one node each, "
             f"{link:.0f} Mbit/s), {calm['updates']} updates; a fault on replica 1 every {result['every_s']:.0f} s "
             f"({len(faults)} faults: {listed}).{reused}", "",
             "| | undisturbed | faulted | ratio |", "|---|---:|---:|---:|",
             f"| the survivor's training seconds | {calm['train_s']:.1f} | {hit['train_s']:.1f} | "
             f"goodput **{calm['train_s'] / hit['train_s']:.3f}** |",
             f"| wall seconds | {calm['wall_s']:.1f} | {hit['wall_s']:.1f} | {calm['wall_s'] / hit['wall_s']:.3f} |",
             f"| loss tokens merged per wall second | {merged[0]:,.0f} | {merged[1]:,.0f} | "
             f"{merged[1] / merged[0]:.3f} |",
             f"| final validation loss (replica 0) | {calm['final_val_loss']:.4f} | {hit['final_val_loss']:.4f} | "
             f"{hit['final_val_loss'] / calm['final_val_loss'] - 1:+.2%} |",
             f"| outer steps with one replica | {hit['replicas_per_outer_step'].count(1)} of "
             f"{len(hit['replicas_per_outer_step'])} | | |", "",
             f"The survivor's updates over 1 s: {waits[0]} s (undisturbed: {waits[1]}).", "",
             "| heal | wait for the round and copy (s) | copy alone (s) | state (MiB) | its bytes over the link (s) | "
             "copy ÷ link |", "|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
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
    for name in ("undisturbed", "faulted"):
        records = read_records(folder / name)
        seconds = list(accumulate((update_s(r) for r in records[1:]), initial=0.0))
        loss.plot(seconds[::10], [r["loss"] for r in records][::10], label=name, lw=0.8)
        outer = [r for r in records if "outer_step" in r]
        present.step([r["step"] for r in outer], [r["outer_replicas"] for r in outer], label=name, where="post")
    loss.set(xlabel="replica 0's training seconds", ylabel="training loss", title="the survivor")
    present.set(xlabel="update", ylabel="replicas in the outer step", ylim=(0, 2.5))
    for ax in (loss, present):
        ax.legend()
    save_figure(fig, path)


def earlier_undisturbed(report: Path, args, folder: Path) -> dict:
    """The undisturbed run of an earlier report, if it ran this recipe over this link; its records copied beside."""
    earlier = json.loads(report.read_text())
    calm = earlier["undisturbed"]
    if (calm["updates"], earlier["link_mbit_s"], earlier.get("seed", 0)) != (args.updates, args.rate, args.seed):
        raise SystemExit(f"torchacco: error: {report} ran another recipe (--updates, --rate or --seed differ)")
    if folder.resolve() != (report.parent / "fault_goodput_runs" / "undisturbed").resolve():
        shutil.copytree(report.parent / "fault_goodput_runs" / "undisturbed", folder, dirs_exist_ok=True)
    return {**calm, "from": f"{report} ({earlier['meta']['date']})"}


def main(argv: list[str] | None = None) -> int:
    parser = bare_parser("fault-goodput", __doc__)
    parser.add_argument("--updates", type=int, default=6000, help="updates of each run")
    parser.add_argument("--every", type=float, default=300.0, help="seconds between faults on replica 1")
    parser.add_argument("--faults", default="kill,cut,stall", help=f"kinds, in turn: {', '.join(KINDS)}")
    parser.add_argument("--outage-s", type=float, default=60.0, help="how long a cut or a stall lasts")
    parser.add_argument("--rate", type=float, default=114.0, help="the link between the nodes, Mbit/s")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench_results"))
    parser.add_argument("--timeout-s", type=float, default=5400.0, help="for each run")
    parser.add_argument("--undisturbed-from", type=Path, help="an earlier report's JSON whose undisturbed run (same "
                        "updates, link and seed; its runs folder beside it) stands in for a new one")  # fmt: skip
    args = parser.parse_args(argv)
    kinds = [k.strip() for k in args.faults.split(",") if k.strip()]
    if not kinds or not set(kinds) <= set(KINDS):
        parser.error(f"--faults {args.faults}: use some of {', '.join(KINDS)}")
    if args.undisturbed_from and not args.undisturbed_from.is_file():
        parser.error(f"--undisturbed-from {args.undisturbed_from}: no such report; give an earlier fault_goodput.json")
    if args.every and args.outage_s >= args.every:
        parser.error(f"--outage-s {args.outage_s:g} must be shorter than --every {args.every:g}")

    def measure() -> None:
        preflight()  # root, ip and tc, or one line (ClusterError)
        plan = ClusterPlan(nodes=2, rate_bps=args.rate * 1e6)
        train = train_args(args.updates, args.seed)
        folder = args.out / "fault_goodput_runs"
        result = {"meta": meta("fault-goodput", argv), "link_mbit_s": args.rate, "seed": args.seed,
                  "every_s": args.every, "outage_s": args.outage_s}  # fmt: skip
        runs = lambda name, every, outage_s: run(plan, train, folder / name, Injector(plan, kinds, every, outage_s),
                                                 args.timeout_s)  # fmt: skip
        calm = args.undisturbed_from and earlier_undisturbed(args.undisturbed_from, args, folder / "undisturbed")
        result["undisturbed"] = calm or runs("undisturbed", 0, 0)  # (no faults)
        result["faulted"] = runs("faulted", args.every, args.outage_s)
        write_report(args.out, "fault_goodput", result, markdown(result), lambda path: draw(folder, result, path))

    return run_cli(measure)


if __name__ == "__main__":
    sys.exit(main())
