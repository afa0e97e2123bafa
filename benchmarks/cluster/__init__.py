"""An emulated multi-node cluster on one Linux machine: network namespaces, shaped links, slow workers.

    sudo .venv/bin/python -m benchmarks cluster --nodes 2 --rate 200mbit --slow-node 1 --slow-factor 4 \\
        -- --config train_configs/default.toml --training.steps 10 --parallelism.data_parallel acco

Each node is a network namespace with one interface joined to a bridge in a namespace of its own (the host's network
is untouched), its link shaped with `tc tbf`, optionally under a cgroup CPU quota; one torchrun agent per node, gloo
over the links. plan.py: the plan as commands (no root); host.py: preflight; namespaces.py: `Cluster`, always torn
down; launch.py: training, records, reports, the collectives' probe; __main__.py: the command line.
"""

from benchmarks.cluster.host import preflight
from benchmarks.cluster.launch import probe_collectives, run_training, summarize
from benchmarks.cluster.namespaces import Cluster
from benchmarks.cluster.plan import ClusterError, ClusterPlan, format_rate, parse_rate

__all__ = ["Cluster", "ClusterError", "ClusterPlan", "format_rate", "parse_rate", "preflight",
           "probe_collectives", "run_training", "summarize"]  # fmt: skip
