"""The sweeps on the emulated cluster (`python -m benchmarks throughput|heterogeneous|convergence|memory|all`, see
benchmarks/cli.py): one module per sweep, common.py what they share. Each prints a markdown table and writes
`<out>/cluster_<sweep>.{json,md,png}`; raw run folders go to `<out>/runs/cluster/`."""
