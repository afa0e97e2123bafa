"""Planning a run before it starts: the cost model, the dry run on a cluster, and predict's pick of a strategy.

They read strategies through the registry: their traits and their `memory()`, never a concrete class.
"""
