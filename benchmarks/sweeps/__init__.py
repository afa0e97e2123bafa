"""Benchmark sweeps on the emulated cluster (`torchacco.bench.cluster`) and the cost model's validation.

    python -m torchacco.bench throughput     # strategy × link rate, default model, 2 nodes
    python -m torchacco.bench heterogeneous  # 4 nodes, one 4× slower (CPU quota)
    python -m torchacco.bench convergence    # val loss vs tokens and wall-clock, 3 seeds
    python -m torchacco.bench memory         # peak memory per rank per strategy
    python -m torchacco.bench all [--quick]  # all four
    python -m torchacco.bench predict ...    # the cost model for a real cluster (no root needed)

Each sweep prints a markdown table and writes `<out>/cluster_<sweep>.{json,md,png}` (PNG needs
matplotlib: `pip install -e .[bench]`). Raw run folders go to `<out>/runs/cluster/`.
"""

# One module per sweep; common.py holds what they share, cli.py the command line.
