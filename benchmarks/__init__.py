"""Benchmarks: they print and save their numbers (JSON + markdown); they are not tests, and not part of
the installed package. One command line, run from the repository's root (`--help` lists the commands):

    sudo .venv/bin/python -m benchmarks <command> ...   # see benchmarks/cli.py

  time_to_target.py   the yardstick: time to a target loss (token_efficiency.py × speed.py; end_to_end.py checks
                      the product, efficiency_table.py writes the table `python -m torchacco.predict` reads)
  cost_model_check.py the cost model's time per update against the measured speed (its probes: cost_model_probes.py)
  cluster/            the emulated multi-node cluster (network namespaces, shaped links, slow nodes)
  sweeps/             the sweeps on it (throughput, heterogeneous, convergence, memory)
  workers/            the programs each rank runs under torchrun (training with a report, a collective probe,
                      training with an artificial communication delay)
  compare.py, gpu.py, trace.py, acco_reference.py   side-by-side runs, the GPU benchmarks, reading profiler
                      traces, ACCO's equations in one process

The cost model they are checked against is part of torchacco (`torchacco.cost_model`,
`python -m torchacco.predict`).
"""
