"""The strategies the time-to-loss benchmark compares: every registered strategy's benchmark
variants, with their training arguments (shared by the sweep and its report)."""

from torchacco.parallel.registry import STRATEGIES as REGISTERED


def strategies() -> dict[str, list[str]]:
    """label -> training arguments, read from the registered strategy classes when asked (a
    strategy registered later is in the list)."""
    return {
        label: ["--parallelism.data_parallel", cls.name, *args]
        for cls in REGISTERED.values()
        for label, (args, _) in cls.benchmark_variants().items()
    }


# Opt-in variants on a longer token budget (their schedule stretched to it): a strategy a little
# behind per token but faster per token can still reach the target sooner. Not an equal-budget row.
LONGER_BUDGET = {"acco_balanced_1.25x_tokens": ("acco_balanced", 1.25)}
