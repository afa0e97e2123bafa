"""An emulated multi-node cluster on one Linux machine: network namespaces, shaped links, slow workers.

    sudo .venv/bin/python -m torchacco.bench.cluster --nodes 2 --rate 200mbit --slow-node 1 --slow-factor 4 \\
        -- --config train_configs/default.toml --training.steps 10 --parallelism.data_parallel acco

Each "node" is a network namespace `<prefix>n<i>` with one interface `eth0` (address 10.77.0.<i+1>/24)
joined to a bridge that lives in its own namespace `<prefix>sw`, so nothing is added to the host's
network namespace and only addresses inside the namespaces created here are used. Each link is shaped
in both directions with `tc tbf` (rate); a latency needs `tc netem`, which many kernels lack — the
preflight says so and the cost model (`torchacco.bench.cost_model`) models latency instead. A node can
be put under a CPU quota (cgroup v1 `cpu.cfs_quota_us` or v2 `cpu.max`) to make it a slow worker.

One torchrun agent (`torchacco.launch`) runs per node inside its namespace; they rendezvous (c10d) at
node 0's address and the ranks talk gloo over the namespaces' links (`GLOO_SOCKET_IFNAME=eth0`).

`ClusterPlan` is pure data and turns into the list of `ip`/`tc`/cgroup commands (unit-testable without
root); `Cluster` runs them and tears everything down in `finally`, on SIGINT/SIGTERM and at exit.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from torchacco.errors import UserError, run_cli

ROOT = Path(__file__).resolve().parents[2]
CGROUP_V1_CPU = Path("/sys/fs/cgroup/cpu")
CGROUP_V2 = Path("/sys/fs/cgroup")
CFS_PERIOD_US = 100_000
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


class ClusterError(UserError):
    """The machine cannot host the emulated cluster, or setting it up failed (one line)."""


def parse_rate(rate: str | float | None) -> float | None:
    """'200mbit' / '1gbit' / '1.5Gbit' / 2e8 -> bits per second; None, '', 'none', 'unshaped' -> None."""
    if rate is None:
        return None
    if isinstance(rate, (int, float)):
        if rate <= 0:
            raise ClusterError(f"link rate must be positive, got {rate}")
        return float(rate)
    text = rate.strip().lower()
    if text in ("", "none", "unshaped", "inf"):
        return None
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]?)(bit|bps|b/s)?", text)
    if not m or float(m.group(1)) <= 0:
        raise ClusterError(f"cannot read link rate {rate!r}; write e.g. 50mbit, 1gbit, 10gbit or 'unshaped'")
    return float(m.group(1)) * _UNITS[m.group(2)]


def format_rate(bps: float | None) -> str:
    if bps is None:
        return "unshaped"
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bps >= scale:
            value = bps / scale
            return f"{value:g}{unit}" if value == round(value, 3) else f"{value:.3f}{unit}"
    return f"{bps:g}bit"


@dataclasses.dataclass
class ClusterPlan:
    """What to build: pure data. `setup_commands()` / `teardown_commands()` are the shell commands."""

    nodes: int = 2
    rate_bps: float | None = None  # per link and direction; None: unshaped veth
    latency_ms: float = 0.0  # one-way, needs netem
    slow_node: int | None = None  # index of the node made slow
    slow_factor: float = 1.0  # the slow node gets cpu_per_node / slow_factor cores
    cpu_per_node: float | None = None  # cores per node (a CFS quota on every node); None: no quota
    prefix: str = ""  # namespace and cgroup names; unique per run
    subnet: str = "10.77.0"  # /24 inside the namespaces
    cgroup: str = "v1"  # v1 (cpu controller at /sys/fs/cgroup/cpu) or v2

    def __post_init__(self):
        if not self.prefix:
            self.prefix = f"tacc{os.getpid() % 100000}"
        if not re.fullmatch(r"[a-z][a-z0-9]{0,10}", self.prefix):
            raise ClusterError(f"cluster prefix {self.prefix!r} must be 1-11 lowercase letters/digits")
        if not 1 <= self.nodes <= 200:
            raise ClusterError(f"--nodes must be between 1 and 200, got {self.nodes}")
        if not re.fullmatch(r"10\.\d{1,3}\.\d{1,3}", self.subnet):
            raise ClusterError(f"subnet {self.subnet!r} must be the first three octets of a 10.x.y.0/24")
        if self.slow_node is not None and not 0 <= self.slow_node < self.nodes:
            raise ClusterError(f"--slow-node {self.slow_node} is not a node (0..{self.nodes - 1})")
        if self.slow_factor < 1:
            raise ClusterError(f"--slow-factor must be >= 1, got {self.slow_factor}")
        if self.cpu_per_node is not None and self.cpu_per_node <= 0:
            raise ClusterError(f"--cpu-per-node must be positive, got {self.cpu_per_node}")
        if self.latency_ms < 0:
            raise ClusterError(f"--latency-ms must be >= 0, got {self.latency_ms}")
        if self.cgroup not in ("v1", "v2"):
            raise ClusterError(f"cgroup must be v1 or v2, got {self.cgroup!r}")

    # names ---------------------------------------------------------------------------------
    @property
    def switch(self) -> str:
        return f"{self.prefix}sw"

    def namespace(self, i: int) -> str:
        return f"{self.prefix}n{i}"

    def address(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def cores(self, i: int) -> float | None:
        """The CPU quota of node i in cores, or None when it runs unthrottled."""
        base = self.cpu_per_node
        if i == self.slow_node and self.slow_factor > 1:
            return (base if base is not None else 1.0) / self.slow_factor
        return base

    def cgroup_dir(self, i: int) -> Path:
        root = CGROUP_V1_CPU if self.cgroup == "v1" else CGROUP_V2
        return root / self.namespace(i)

    # commands ------------------------------------------------------------------------------
    def shaping_commands(self, ns: str, dev: str) -> list[list[str]]:
        if self.rate_bps is None and not self.latency_ms:
            return []
        add_qdisc = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev]
        cmds = []
        parent = ["root"]
        if self.latency_ms:
            cmds.append([*add_qdisc, "root", "handle", "1:", "netem", "delay", f"{self.latency_ms:g}ms"])
            parent = ["parent", "1:1"]
        if self.rate_bps is not None:
            rate_bytes = self.rate_bps / 8
            # burst: >= rate / HZ and a few MTUs. Queue: the burst plus ~5 ms of traffic, as a switch's shallow
            # buffer: gloo sends both directions of a pair over one TCP connection, so a deep queue holds each
            # side's ACKs behind its own data and the two directions end up taking turns.
            burst = int(max(16_000, rate_bytes / 250))
            limit = int(burst + max(16_000, rate_bytes * 0.005))
            tbf = ["tbf", "rate", f"{int(self.rate_bps)}bit", "burst", str(burst), "limit", str(limit)]
            cmds.append([*add_qdisc, *parent, "handle", "10:", *tbf])
        return cmds

    def setup_commands(self) -> list[list[str]]:
        sw = self.switch
        cmds = [
            ["ip", "netns", "add", sw],
            ["ip", "-n", sw, "link", "add", "br0", "type", "bridge"],
            ["ip", "-n", sw, "link", "set", "br0", "up"],
            ["ip", "-n", sw, "link", "set", "lo", "up"],
        ]
        for i in range(self.nodes):
            ns = self.namespace(i)
            cmds += [
                ["ip", "netns", "add", ns],
                ["ip", "-n", sw, "link", "add", f"p{i}", "type", "veth", "peer", "name", "eth0", "netns", ns],
                ["ip", "-n", sw, "link", "set", f"p{i}", "master", "br0"],
                ["ip", "-n", sw, "link", "set", f"p{i}", "up"],
                ["ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0"],
                ["ip", "-n", ns, "link", "set", "eth0", "up"],
                ["ip", "-n", ns, "link", "set", "lo", "up"],
            ]
            # node -> switch (the node's upload) and switch -> node (its download)
            cmds += self.shaping_commands(ns, "eth0")
            cmds += self.shaping_commands(sw, f"p{i}")
        for i in range(self.nodes):
            cores = self.cores(i)
            if cores is None:
                continue
            quota = max(1000, int(cores * CFS_PERIOD_US))
            d = self.cgroup_dir(i)
            cmds.append(["mkdir", "-p", str(d)])
            if self.cgroup == "v1":
                cmds += [
                    ["write", str(d / "cpu.cfs_period_us"), str(CFS_PERIOD_US)],
                    ["write", str(d / "cpu.cfs_quota_us"), str(quota)],
                ]
            else:
                cmds.append(["write", str(d / "cpu.max"), f"{quota} {CFS_PERIOD_US}"])
        return cmds

    def teardown_commands(self) -> list[list[str]]:
        """Idempotent: each may fail harmlessly when its object is already gone."""
        cmds = [["ip", "netns", "del", self.namespace(i)] for i in range(self.nodes)]
        cmds.append(["ip", "netns", "del", self.switch])  # deleting namespaces deletes their veths and bridge
        cmds += [["rmdir", str(self.cgroup_dir(i))] for i in range(self.nodes) if self.cores(i) is not None]
        return cmds

    def node_command(self, i: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace(i), *argv]

    def describe(self) -> str:
        link = format_rate(self.rate_bps) + (f", +{self.latency_ms:g} ms" if self.latency_ms else "")
        cpu = ", ".join(f"node{i} {self.cores(i):g} cores" for i in range(self.nodes) if self.cores(i) is not None)
        return f"{self.nodes} nodes on {self.subnet}.0/24, links {link}" + (f", {cpu}" if cpu else "")


# preflight -----------------------------------------------------------------------------------


def detect_cgroup() -> str | None:
    """'v1' when the v1 cpu controller is mounted, 'v2' when the unified hierarchy offers cpu, else None."""
    if (CGROUP_V1_CPU / "cpu.cfs_quota_us").exists():
        return "v1"
    controllers = CGROUP_V2 / "cgroup.controllers"
    if controllers.exists() and "cpu" in controllers.read_text().split():
        return "v2"
    return None


def preflight(need_cgroup: bool = False, need_netem: bool = False) -> str | None:
    """Check root, ip/tc, network namespaces (and tc tbf, netem, cgroups when needed). Returns the cgroup kind.

    Raises ClusterError naming what is missing."""
    if sys.platform != "linux":
        raise ClusterError("the emulated cluster needs Linux (network namespaces, tc, cgroups)")
    if os.geteuid() != 0:
        raise ClusterError(
            "the emulated cluster needs root (network namespaces, tc and cgroups); "
            "run it with sudo, e.g. sudo .venv/bin/python -m torchacco.bench ..."
        )
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise ClusterError(f"`{tool}` not found; install iproute2")
    probe = f"taccprobe{os.getpid() % 100000}"
    try:
        _run(["ip", "netns", "add", probe], "network namespaces are not available (ip netns add failed)")
        _run(
            ["ip", "-n", probe, "link", "add", "a0", "type", "veth", "peer", "name", "b0"],
            "veth pairs are not available in this kernel",
        )
        _run(
            [
                "ip",
                "netns",
                "exec",
                probe,
                "tc",
                "qdisc",
                "add",
                "dev",
                "a0",
                "root",
                "tbf",
                "rate",
                "1mbit",
                "burst",
                "32000",
                "limit",
                "100000",
            ],
            "tc tbf (the sch_tbf qdisc) is not available in this kernel",
        )
        if need_netem:
            _run(
                ["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "b0", "root", "netem", "delay", "1ms"],
                "tc netem (sch_netem) is not available in this kernel, so link latency cannot be emulated; "
                "drop --latency-ms (the cost model, `python -m torchacco.bench predict`, models latency)",
            )
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    kind = detect_cgroup()
    if need_cgroup and kind is None:
        raise ClusterError(
            "no cgroup cpu controller (v1 /sys/fs/cgroup/cpu or v2 with 'cpu' in cgroup.controllers); "
            "a slow worker / CPU quota cannot be emulated"
        )
    return kind


def _run(cmd: list[str], what: str | None = None) -> None:
    if cmd[0] == "write":
        try:
            Path(cmd[1]).write_text(cmd[2])
        except OSError as e:
            raise ClusterError(f"{what or 'cannot write'} {cmd[1]}: {e.strerror}") from None
        return
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        detail = (proc.stderr or proc.stdout).strip().splitlines()
        raise ClusterError(f"{what or 'setup failed'}: `{' '.join(cmd)}`: {detail[-1] if detail else 'failed'}")


def _run_quietly(cmd: list[str]) -> None:
    try:
        if cmd[0] == "rmdir":
            os.rmdir(cmd[1])
        elif cmd[0] == "write":
            Path(cmd[1]).write_text(cmd[2])
        else:
            subprocess.run(cmd, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        pass


def stale_namespaces(prefix_re: str = r"tacc(\d+)(sw|n\d+)") -> list[str]:
    """Namespaces left by an emulator run whose process is gone (a SIGKILL)."""
    proc = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    stale = []
    for line in proc.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.fullmatch(prefix_re, name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            stale.append(name)
    return stale


# the cluster ---------------------------------------------------------------------------------


class Cluster:
    """Context manager: builds the plan, launches per-node commands, always tears down."""

    def __init__(self, plan: ClusterPlan, verbose: bool = False):
        self.plan, self.verbose = plan, verbose
        self.procs: list[subprocess.Popen] = []
        self._built = False
        self._old_handlers = {}

    def __enter__(self) -> Cluster:
        kind = preflight(
            need_cgroup=any(self.plan.cores(i) is not None for i in range(self.plan.nodes)),
            need_netem=bool(self.plan.latency_ms),
        )
        if kind:
            self.plan.cgroup = kind
        for name in stale_namespaces():
            _run_quietly(["ip", "netns", "del", name])
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        atexit.register(self.teardown)
        self._built = True
        try:
            for cmd in self.plan.setup_commands():
                if self.verbose:
                    print("+", " ".join(cmd), file=sys.stderr)
                _run(cmd)
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def _on_signal(self, signum, frame):
        self.teardown()
        raise KeyboardInterrupt if signum == signal.SIGINT else SystemExit(128 + signum)

    def launch(self, i: int, argv: list[str], env: dict | None = None, log: Path | None = None) -> subprocess.Popen:
        """Run argv inside node i's namespace (and CPU cgroup); a new session so it is killed as a group."""
        cores = self.plan.cores(i)
        procs_file = str(self.plan.cgroup_dir(i) / "cgroup.procs") if cores is not None else None

        def enter_cgroup():  # runs in the child before exec: everything it starts inherits the quota
            if procs_file:
                with open(procs_file, "w") as f:
                    f.write(str(os.getpid()))

        out = open(log, "w") if log else subprocess.DEVNULL
        try:
            proc = subprocess.Popen(
                self.plan.node_command(i, argv),
                env=env,
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=enter_cgroup,
            )
        finally:
            if log:
                out.close()
        self.procs.append(proc)
        return proc

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        self.procs = []

    def teardown(self) -> None:
        if not self._built:
            return
        self._built = False
        self.kill_all()
        for cmd in self.plan.teardown_commands():
            _run_quietly(cmd)
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers = {}
        atexit.unregister(self.teardown)


# training on the cluster ---------------------------------------------------------------------


def train_argv(
    plan: ClusterPlan,
    i: int,
    train_args: list[str],
    port: int,
    module: str = "torchacco.bench.node_train",
    python: str = sys.executable,
    run_id: str = "tacc",
) -> list[str]:
    """The per-node torchrun command: one process per node, c10d rendezvous at node 0."""
    return [
        python,
        "-m",
        "torchacco.launch",
        "--nnodes",
        str(plan.nodes),
        "--node_rank",
        str(i),
        "--nproc_per_node",
        "1",
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        f"{plan.address(0)}:{port}",
        "--rdzv_id",
        run_id,
        "--rdzv_conf",
        f"is_host={int(i == 0)}",
        "--local_addr",
        plan.address(i),
        "--max_restarts",
        "0",
        "--monitor_interval",
        "0.5",
        "-m",
        module,
        *train_args,
    ]


def node_env(threads: int = 1, extra: dict | None = None) -> dict:
    env = {
        **os.environ,
        "GLOO_SOCKET_IFNAME": "eth0",
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "PYTHONUNBUFFERED": "1",
    }
    for key in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC_ERROR_FILE"):
        env.pop(key, None)
    return {**env, **(extra or {})}


def run_training(
    plan: ClusterPlan,
    train_args: list[str],
    folder: Path,
    timeout_s: float = 900,
    port: int = 29400,
    threads: int = 1,
    verbose: bool = False,
    env: dict | None = None,
) -> dict:
    """Train on the emulated cluster; returns {'records': metrics.jsonl, 'ranks': per-rank reports, 'wall_s'}.

    Raises ClusterError (one line, the tail of the failing node's log) when a node fails or times out."""
    folder.mkdir(parents=True, exist_ok=True)
    args = [
        *train_args,
        "--job.dump_folder",
        str(folder),
        "--job.overwrite",
        "true",  # it holds the node logs
        "--training.num_threads",
        str(threads),
    ]
    validate = subprocess.run(
        [sys.executable, "-m", "torchacco.validate", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "WORLD_SIZE": str(plan.nodes), "LOCAL_WORLD_SIZE": "1"},
    )
    if validate.returncode:
        last = validate.stderr.strip().splitlines()[-1] if validate.stderr.strip() else "invalid config"
        raise ClusterError(last.removeprefix("torchacco: error: "))
    wall = run_nodes(plan, "torchacco.bench.node_train", args, folder, timeout_s, port, threads, verbose, env)
    return {"records": read_records(folder), "ranks": read_rank_reports(folder), "wall_s": wall}


def run_nodes(
    plan: ClusterPlan,
    module: str,
    args: list[str],
    folder: Path,
    timeout_s: float = 900,
    port: int = 29400,
    threads: int = 1,
    verbose: bool = False,
    extra_env: dict | None = None,
) -> float:
    """Build the cluster, run `module args` under one torchrun agent per node, tear down. Returns wall seconds.

    Raises ClusterError (one line: the failing node's last error) when a node fails or the run times out."""
    folder.mkdir(parents=True, exist_ok=True)
    env = node_env(threads, {"TORCHACCO_NODE_REPORT_DIR": str(folder), **(extra_env or {})})
    started = time.perf_counter()
    with Cluster(plan, verbose=verbose) as cluster:
        procs = [
            cluster.launch(
                i,
                train_argv(plan, i, args, port, module=module, run_id=plan.prefix),
                {**env, "TORCHACCO_NODE_ADDR": plan.address(i), "TORCHACCO_NODE_INDEX": str(i)},
                folder / f"node{i}.log",
            )
            for i in range(plan.nodes)
        ]
        deadline = time.monotonic() + timeout_s
        failed = None
        while any(p.poll() is None for p in procs):
            bad = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
            if bad:
                failed = bad[0]
                break
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"the cluster run did not finish within {timeout_s:.0f} s (logs: {folder}/node*.log)"
                )
            time.sleep(0.2)
        if failed is None:
            failed = next((i for i, p in enumerate(procs) if p.returncode), None)
        if failed is not None:
            raise ClusterError(
                f"node {failed} failed: {_last_error(folder / f'node{failed}.log')} (logs: {folder}/node*.log)"
            )
    return time.perf_counter() - started


def probe_collectives(plan: ClusterPlan, folder: Path, numel: int, port: int = 29400, timeout_s: float = 600) -> dict:
    """Median seconds of a gloo reduce-scatter, all-gather and all-reduce of `numel` fp32 over the cluster."""
    run_nodes(plan, "torchacco.bench.collective_probe", ["--numel", str(numel)], folder, timeout_s, port)
    return json.loads((folder / "collectives.json").read_text())


def _last_error(log: Path) -> str:
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "no log"
    for line in reversed(lines):
        if line.startswith("torchacco: error: "):
            return line.removeprefix("torchacco: error: ")
    return lines[-1] if lines else "no output"


def read_records(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    if not path.exists():
        raise ClusterError(f"no metrics.jsonl in {folder}: the run logged nothing")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_rank_reports(folder: Path) -> list[dict]:
    reports = []
    for path in sorted(folder.glob("rank*.json"), key=lambda p: int(re.sub(r"\D", "", p.stem) or 0)):
        try:
            reports.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            pass
    return reports


def plan_from_args(args) -> ClusterPlan:
    return ClusterPlan(
        nodes=args.nodes,
        rate_bps=parse_rate(args.rate),
        latency_ms=args.latency_ms,
        slow_node=args.slow_node,
        slow_factor=args.slow_factor,
        cpu_per_node=args.cpu_per_node,
    )


def add_cluster_args(parser: argparse.ArgumentParser, nodes: int = 2) -> None:
    parser.add_argument("--nodes", type=int, default=nodes)
    parser.add_argument("--rate", default="unshaped", help="per-link rate each way, e.g. 200mbit, 1gbit, unshaped")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="one-way link latency (needs tc netem)")
    parser.add_argument("--slow-node", type=int, default=None, help="index of a node made slow by a CPU quota")
    parser.add_argument("--slow-factor", type=float, default=4.0)
    parser.add_argument("--cpu-per-node", type=float, default=None, help="CPU quota of every node, in cores")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cluster_args(parser)
    parser.add_argument("--out", default="bench_results/runs/cluster")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per node")
    parser.add_argument("--port", type=int, default=29400)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--dry-run", action="store_true", help="print the setup and teardown commands only")
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then torchacco.train arguments")
    args = parser.parse_args(argv)
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args

    def run():
        plan = plan_from_args(args)
        if args.slow_node is None:
            plan.slow_factor = 1.0
        if args.dry_run:
            for cmd in plan.setup_commands() + [["# teardown"]] + plan.teardown_commands():
                print(" ".join(cmd))
            return 0
        if not train_args:
            raise ClusterError("give the training arguments after `--`, e.g. -- --config train_configs/default.toml")
        print(f"cluster: {plan.describe()}", flush=True)
        result = run_training(plan, train_args, Path(args.out), args.timeout, args.port, args.threads, args.verbose)
        from torchacco.bench.compare import summarize

        summary = summarize(result["records"], min(2, len(result["records"]) - 1))
        print(
            json.dumps(
                {"plan": plan.describe(), "wall_s": round(result["wall_s"], 1), **summary, "ranks": result["ranks"]},
                indent=2,
            )
        )
        return 0

    return run_cli(run)


if __name__ == "__main__":
    sys.exit(main())


_SINK = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); print('ready', flush=True)
c, _ = s.accept(); n = 0
while True:
    b = c.recv(1 << 20)
    if not b: break
    n += len(b)
c.sendall(b'k'); print(n, flush=True)
"""
_SOURCE = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
buf = b'x' * (1 << 20); total = int(float(sys.argv[3]) * 2**20); t = time.perf_counter(); sent = 0
while sent < total:
    c.sendall(buf); sent += len(buf)
c.shutdown(socket.SHUT_WR); c.recv(1); print(sent * 8 / (time.perf_counter() - t), flush=True)
"""


def measure_link(cluster: Cluster, src: int = 1, dst: int = 0, megabytes: float = 8, port: int = 29399) -> float:
    """Bits per second of one TCP stream from node src to node dst (checks the shaping)."""
    plan = cluster.plan
    sink = subprocess.Popen(
        plan.node_command(dst, [sys.executable, "-c", _SINK, plan.address(dst), str(port)]),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        sink.stdout.readline()
        out = subprocess.run(
            plan.node_command(src, [sys.executable, "-c", _SOURCE, plan.address(dst), str(port), str(megabytes)]),
            capture_output=True,
            text=True,
            timeout=300,
        )
        if out.returncode:
            raise ClusterError(
                f"node {src} cannot reach node {dst} at {plan.address(dst)}:{port}: "
                f"{(out.stderr.strip().splitlines() or ['?'])[-1]}"
            )
        return float(out.stdout.strip())
    finally:
        sink.kill()
        sink.wait()
