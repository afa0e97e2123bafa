"""Probes of the cluster's links: the collectives' times (the cost model's inputs) and one TCP stream's goodput."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.cluster.launch import run_nodes
from benchmarks.cluster.namespaces import Cluster
from benchmarks.cluster.plan import ClusterError, ClusterPlan


def probe_collectives(plan: ClusterPlan, folder: Path, numel: int, port: int = 29400, timeout_s: float = 600,
                      extra: list[str] = ()) -> dict:  # fmt: skip
    """Seconds of each collective of `numel` fp32 over the cluster (`extra`: more collective_probe.py options)."""
    run_nodes(plan, "benchmarks.workers.collective_probe", ["--numel", str(numel), *extra], folder, timeout_s, port)
    return json.loads((folder / "collectives.json").read_text())


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
    sink = subprocess.Popen(plan.node_command(dst, [sys.executable, "-c", _SINK, plan.address(dst), str(port)]),
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        sink.stdout.readline()
        source = [sys.executable, "-c", _SOURCE, plan.address(dst), str(port), str(megabytes)]
        out = subprocess.run(plan.node_command(src, source), capture_output=True, text=True, timeout=300)
        if out.returncode:
            raise ClusterError(f"node {src} cannot reach node {dst} at {plan.address(dst)}:{port}: "
                               f"{(out.stderr.strip().splitlines() or ['?'])[-1]}")  # fmt: skip
        return float(out.stdout.strip())
    finally:
        sink.kill()
        sink.wait()
