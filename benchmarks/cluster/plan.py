"""What to build: the emulated cluster as pure data, and the `ip`/`tc`/cgroup commands it turns into (nothing here
touches the machine, so plans are unit-testable without root)."""

from __future__ import annotations

import dataclasses
import math
import os
import re
from pathlib import Path

from torchacco.errors import UserError
from torchacco.planning.cost_model import format_rate, parse_rate  # noqa: F401  (the link rates' units, re-exported)

CGROUP_V1_CPU = Path("/sys/fs/cgroup/cpu")
CGROUP_V2 = Path("/sys/fs/cgroup")
CFS_PERIOD_US = 100_000


class ClusterError(UserError):
    """The machine cannot host the emulated cluster, or setting it up failed (one line)."""


def add_node_options(parser) -> None:
    """The options of the nodes that `speed` and `cluster` both take (their plans' fields: node_options)."""
    parser.add_argument("--node-rate", default="unshaped", help="with several ranks per node: the link inside each "
                        "node, its ranks' traffic together (e.g. 2gbit)")  # fmt: skip
    parser.add_argument("--no-slow-start-after-idle", action="store_true", help="set net.ipv4."
                        "tcp_slow_start_after_idle = 0 on every node (Linux's default is 1)")  # fmt: skip
    parser.add_argument("--cpu-period-ms", type=float, default=CFS_PERIOD_US / 1000, help="the CFS period of the "
                        "nodes' CPU quotas (a throttled node freezes for the rest of it)")  # fmt: skip


def node_options(args) -> dict:
    """add_node_options' arguments as ClusterPlan's fields (the period's range is ClusterPlan's to check)."""
    if not math.isfinite(args.cpu_period_ms):
        raise ClusterError(f"--cpu-period-ms must be a finite number of milliseconds, got {args.cpu_period_ms}")
    return {"node_rate_bps": parse_rate(args.node_rate), "cpu_period_us": round(args.cpu_period_ms * 1000),
            "tcp_slow_start_after_idle": not args.no_slow_start_after_idle}  # fmt: skip


@dataclasses.dataclass
class ClusterPlan:
    nodes: int = 2
    # a node's ranks share its namespace, quota and link; their traffic to one another stays on its loopback
    ranks_per_node: int = 1
    rate_bps: float | None = None  # per link and direction; None: unshaped veth
    node_rate_bps: float | None = None  # the node's loopback, both directions together (NVLink, PCIe); None: unshaped
    latency_ms: float = 0.0  # one-way, needs netem
    slow_node: int | None = None  # index of the node made slow
    slow_factor: float = 1.0  # the slow node gets cpu_per_node / slow_factor cores
    cpu_per_node: float | None = None  # cores per node (a CFS quota on every node); None: no quota
    prefix: str = ""  # namespace and cgroup names; unique per run
    subnet: str = "10.77.0"  # /24 inside the namespaces
    cgroup: str = "v1"  # v1 (cpu controller at /sys/fs/cgroup/cpu) or v2
    # Linux's default: a connection idle past its retransmission timeout restarts slow (a collective after compute)
    tcp_slow_start_after_idle: bool = True
    # a throttled node freezes for the rest of the period (inside a collective too): short, it is slow throughout
    cpu_period_us: int = CFS_PERIOD_US

    def __post_init__(self):
        if not self.prefix:
            self.prefix = f"tacc{os.getpid() % 100000}"
        if not re.fullmatch(r"[a-z][a-z0-9]{0,10}", self.prefix):
            raise ClusterError(f"cluster prefix {self.prefix!r} must be 1-11 lowercase letters/digits")
        for flag, value, most in (("--nodes", self.nodes, 200), ("--ranks-per-node", self.ranks_per_node, 16)):
            if not 1 <= value <= most:
                raise ClusterError(f"{flag} must be between 1 and {most}, got {value}")
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
        if not 1000 <= self.cpu_period_us <= 1_000_000:
            raise ClusterError(f"--cpu-period-ms must be between 1 and 1000, got {self.cpu_period_us / 1000:g}")
        for i in range(self.nodes):
            cores = self.cores(i)
            if cores is not None and round(cores * self.cpu_period_us) < 1000:
                raise ClusterError(f"node {i}'s {cores:g} cores are under the kernel's 1 ms quota in a period of "
                                   f"{self.cpu_period_us / 1000:g} ms; give a longer --cpu-period-ms")  # fmt: skip

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

    def shaping_commands(self, ns: str, dev: str) -> list[list[str]]:
        inside = dev == "lo"  # the node's own traffic: its loopback, whose packets are up to 64 KiB
        rate_bps, latency_ms = (self.node_rate_bps, 0.0) if inside else (self.rate_bps, self.latency_ms)
        if rate_bps is None and not latency_ms:
            return []
        add_qdisc = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev]
        cmds, parent = [], ["root"]
        if latency_ms:
            cmds.append([*add_qdisc, "root", "handle", "1:", "netem", "delay", f"{latency_ms:g}ms"])
            parent = ["parent", "1:1"]
        if rate_bps is not None:
            rate_bytes = rate_bps / 8
            # burst: >= rate / HZ and a few MTUs. Queue: the burst plus ~5 ms of traffic, as a switch's shallow
            # buffer: gloo sends both directions of a pair over one TCP connection, so a deep queue holds each
            # side's ACKs behind its own data and the two directions end up taking turns.
            burst = int(max(2 * 65_536 if inside else 16_000, rate_bytes / 250))  # tbf drops packets over it
            limit = int(burst + max(16_000, rate_bytes * 0.005))
            tbf = ["tbf", "rate", f"{int(rate_bps)}bit", "burst", str(burst), "limit", str(limit)]
            cmds.append([*add_qdisc, *parent, "handle", "10:", *tbf])
        return cmds

    def setup_commands(self) -> list[list[str]]:
        sw = self.switch
        lines = [f"ip netns add {sw}", f"ip -n {sw} link add br0 type bridge", f"ip -n {sw} link set br0 up",
                 f"ip -n {sw} link set lo up"]  # fmt: skip
        cmds = [line.split() for line in lines]
        for i in range(self.nodes):
            ns = self.namespace(i)
            lines = [f"ip netns add {ns}", f"ip -n {sw} link add p{i} type veth peer name eth0 netns {ns}",
                     f"ip -n {sw} link set p{i} master br0", f"ip -n {sw} link set p{i} up",
                     f"ip -n {ns} addr add {self.address(i)}/24 dev eth0", f"ip -n {ns} link set eth0 up",
                     f"ip -n {ns} link set lo up"]  # fmt: skip
            cmds += [line.split() for line in lines]
            if not self.tcp_slow_start_after_idle:
                cmds.append(self.node_command(i, ["sysctl", "-q", "-w", "net.ipv4.tcp_slow_start_after_idle=0"]))
            # node -> switch (the node's upload) and switch -> node (its download)
            cmds += self.shaping_commands(ns, "eth0") + self.shaping_commands(sw, f"p{i}")
            if self.ranks_per_node > 1:
                cmds += self.shaping_commands(ns, "lo")
        for i in (i for i in range(self.nodes) if self.cores(i) is not None):
            quota, period, d = round(self.cores(i) * self.cpu_period_us), self.cpu_period_us, self.cgroup_dir(i)
            cmds.append(["mkdir", "-p", str(d)])
            if self.cgroup == "v1":
                cmds += [["write", str(d / "cpu.cfs_period_us"), str(period)],
                         ["write", str(d / "cpu.cfs_quota_us"), str(quota)]]  # fmt: skip
            else:
                cmds.append(["write", str(d / "cpu.max"), f"{quota} {period}"])
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
        ranks = f" of {self.ranks_per_node} ranks" if self.ranks_per_node > 1 else ""
        if self.ranks_per_node > 1 and self.node_rate_bps is not None:
            ranks += f" ({format_rate(self.node_rate_bps)} inside)"
        tcp = "" if self.tcp_slow_start_after_idle else ", no TCP slow start after idle"
        if cpu and self.cpu_period_us != CFS_PERIOD_US:
            cpu += f" per {self.cpu_period_us / 1000:g} ms"
        return f"{self.nodes} nodes{ranks} on {self.subnet}.0/24, links {link}{tcp}" + (f", {cpu}" if cpu else "")

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node
