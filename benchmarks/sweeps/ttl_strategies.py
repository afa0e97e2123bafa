"""The strategies the time-to-loss benchmark compares: their training arguments (shared by the sweep
and its report)."""

ACCO = ["--parallelism.data_parallel", "acco"]
STRATEGIES = {
    "ddp": ["--parallelism.data_parallel", "ddp"],
    "zero1": ["--parallelism.data_parallel", "zero1"],
    "fsdp": ["--parallelism.data_parallel", "fsdp"],
    "acco": ACCO,
    "acco_bf16_estimate": [*ACCO, "--acco.estimate_comm", "bf16"],
    "acco_balanced": [*ACCO, "--acco.mode", "balanced"],
    "acco_adaptive": [*ACCO, "--acco.mode", "adaptive"],  # capped at max_growth (default 2)
    "acco_adaptive_uncapped": [*ACCO, "--acco.mode", "adaptive", "--acco.max_growth", "0"],
    "dpu": ["--parallelism.data_parallel", "dpu"],
}
# Opt-in variants on a longer token budget (their schedule stretched to it): a strategy a little
# behind per token but faster per token can still reach the target sooner. Not an equal-budget row.
LONGER_BUDGET = {"acco_balanced_1.25x_tokens": ("acco_balanced", 1.25)}
