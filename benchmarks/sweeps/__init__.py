"""Benchmark sweeps on the emulated cluster (`benchmarks.cluster`) and the cost model's validation.

    python -m benchmarks throughput     # strategy × link rate, default model, 2 nodes
    python -m benchmarks heterogeneous  # 4 nodes, one 4× slower (CPU quota)
    python -m benchmarks convergence    # val loss vs tokens and wall-clock, 3 seeds
    python -m benchmarks memory         # peak memory per rank per strategy
    python -m benchmarks all [--quick]  # all four
    python -m benchmarks time-to-loss   # the headline: time to a target validation loss per strategy

Run them from the repository's root, as root (`sudo .venv/bin/python -m benchmarks ...`). The cost
model alone, for a real cluster, is part of torchacco: `python -m torchacco.predict` (no root needed).

Each sweep prints a markdown table and writes `<out>/cluster_<sweep>.{json,md,png}` (PNG needs
matplotlib: `pip install -e .[bench]`). Raw run folders go to `<out>/runs/cluster/`.
"""

# One module per sweep; common.py holds what they share, cli.py the command line.
