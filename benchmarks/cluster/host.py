"""The host: can it run the emulated cluster (root, iproute2, namespaces, tc, cgroups); its commands run loudly for
setup and quietly for teardown."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from benchmarks.cluster.plan import CGROUP_V1_CPU, CGROUP_V2, ClusterError


def preflight(need_cgroup: bool = False, need_netem: bool = False) -> str | None:
    """Check root, ip/tc, network namespaces (and tc tbf, netem, cgroups when needed): the cgroup kind ('v1', 'v2' or
    None), or a ClusterError naming what is missing."""
    if sys.platform != "linux":
        raise ClusterError("the emulated cluster needs Linux (network namespaces, tc, cgroups)")
    if os.geteuid() != 0:
        raise ClusterError("the emulated cluster needs root (network namespaces, tc and cgroups); run it with sudo, "
                           "e.g. sudo .venv/bin/python -m benchmarks ...")  # fmt: skip
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise ClusterError(f"`{tool}` not found; install iproute2")
    _probe_kernel(need_netem)
    controllers = CGROUP_V2 / "cgroup.controllers"
    if (CGROUP_V1_CPU / "cpu.cfs_quota_us").exists():  # the v1 cpu controller is mounted
        kind = "v1"
    else:  # the unified hierarchy, if it offers cpu
        kind = "v2" if controllers.exists() and "cpu" in controllers.read_text().split() else None
    if need_cgroup and kind is None:
        raise ClusterError("no cgroup cpu controller (v1 /sys/fs/cgroup/cpu or v2 with 'cpu' in cgroup.controllers); "
                           "a slow worker / CPU quota cannot be emulated")  # fmt: skip
    return kind


def _probe_kernel(need_netem: bool) -> None:
    """Build a throwaway namespace with a veth pair and the qdiscs the cluster uses, then remove it."""
    probe = f"taccprobe{os.getpid() % 100000}"
    qdisc = f"ip netns exec {probe} tc qdisc add dev"
    try:
        run(["ip", "netns", "add", probe], "network namespaces are not available (ip netns add failed)")
        run(f"ip -n {probe} link add a0 type veth peer name b0".split(), "veth pairs are not available in this kernel")
        run(f"{qdisc} a0 root tbf rate 1mbit burst 32000 limit 100000".split(),
            "tc tbf (the sch_tbf qdisc) is not available in this kernel")  # fmt: skip
        if need_netem:
            run(f"{qdisc} b0 root netem delay 1ms".split(), "tc netem (sch_netem) is not available in this kernel, so "
                "link latency cannot be emulated; drop --latency-ms (the cost model, `python -m torchacco predict`, "
                "models latency)")  # fmt: skip
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)


def run(cmd: list[str], what: str | None = None) -> None:
    """Run one setup command (`write PATH TEXT` writes a file); a failure is a one-line ClusterError."""
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


def run_quietly(cmd: list[str]) -> None:
    """Run one teardown command (`rmdir`, `write` or a process); whatever fails is ignored."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        if cmd[0] == "rmdir":
            os.rmdir(cmd[1])
        elif cmd[0] == "write":
            Path(cmd[1]).write_text(cmd[2])
        else:
            subprocess.run(cmd, capture_output=True, timeout=30)


def stale_namespaces() -> list[str]:
    """Namespaces left by an emulator run whose process is gone (a SIGKILL)."""
    proc = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    found = (re.fullmatch(r"tacc(\d+)(sw|n\d+)", line.split()[0]) for line in proc.stdout.splitlines() if line.split())
    return [m.group(0) for m in found if m and not Path(f"/proc/{m.group(1)}").exists()]
