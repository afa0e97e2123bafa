"""Benchmarks: they print and save their numbers (JSON + markdown); they are not tests, and not part of
the installed package. Run them from the repository's root:

    sudo .venv/bin/python -m benchmarks throughput|heterogeneous|convergence|memory|all|time-to-loss
    sudo .venv/bin/python -m benchmarks.cluster ... -- <torchacco.train arguments>
    .venv/bin/python -m benchmarks.compare ...   # variants side by side on one machine
    .venv/bin/python -m benchmarks.gpu mfu|overlap
    python3 -m benchmarks gpu-check [--dry-run]   # the CUDA paths in one short GPU session (gpu_check.py)

  cluster/   the emulated multi-node cluster (network namespaces, shaped links, slow nodes)
  sweeps/    the sweeps on it and their reports
  workers/   the programs each rank runs under torchrun (training with a report, a collective probe,
             training with an artificial communication delay)
  compare.py, gpu.py, trace.py   side-by-side runs, the GPU benchmarks, reading profiler traces

The cost model they are checked against is part of torchacco (`torchacco.cost_model`,
`python -m torchacco.predict`).
"""
