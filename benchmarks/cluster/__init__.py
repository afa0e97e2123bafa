"""An emulated multi-node cluster on one Linux machine: network namespaces, shaped links, slow workers.

    sudo .venv/bin/python -m benchmarks.cluster --nodes 2 --rate 200mbit --slow-node 1 --slow-factor 4 \\
        -- --config train_configs/default.toml --training.steps 10 --parallelism.data_parallel acco

Each "node" is a network namespace `<prefix>n<i>` with one interface `eth0` (address 10.77.0.<i+1>/24)
joined to a bridge that lives in its own namespace `<prefix>sw`, so nothing is added to the host's
network namespace and only addresses inside the namespaces created here are used. Each link is shaped
in both directions with `tc tbf` (rate); a latency needs `tc netem`, which many kernels lack — the
preflight says so and the cost model (`torchacco.cost_model`) models latency instead. A node can
be put under a CPU quota (cgroup v1 `cpu.cfs_quota_us` or v2 `cpu.max`) to make it a slow worker.

One torchrun agent (`torchacco.launch`) runs per node inside its namespace; they rendezvous (c10d) at
node 0's address and the ranks talk gloo over the namespaces' links (`GLOO_SOCKET_IFNAME=eth0`).

One module per concern:
  plan.py        `ClusterPlan`: pure data, turned into the `ip`/`tc`/cgroup commands (unit-testable without root)
  host.py        the preflight (root, iproute2, namespaces, tc, cgroups) and running host commands
  namespaces.py  `Cluster`: runs a plan's commands, launches into a node, always tears down
  launch.py      training on the cluster: one torchrun agent per node, records and per-rank reports
  probe.py       the gloo collectives' times and one link's goodput
  __main__.py    the command line (also `python -m benchmarks cluster`)
"""

from benchmarks.cluster.host import preflight
from benchmarks.cluster.launch import (
    node_env,
    read_rank_reports,
    read_records,
    run_nodes,
    run_training,
    summarize,
    train_argv,
)
from benchmarks.cluster.namespaces import Cluster
from benchmarks.cluster.plan import ClusterError, ClusterPlan, format_rate, parse_rate
from benchmarks.cluster.probe import measure_link, probe_collectives

__all__ = [
    "Cluster",
    "ClusterError",
    "ClusterPlan",
    "format_rate",
    "measure_link",
    "node_env",
    "parse_rate",
    "preflight",
    "probe_collectives",
    "read_rank_reports",
    "read_records",
    "run_nodes",
    "run_training",
    "summarize",
    "train_argv",
]
