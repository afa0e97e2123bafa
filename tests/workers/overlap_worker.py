"""A torchrun worker for the schedule tests: drives a data-parallel strategy directly.

Every rank draws its micro-batches from a generator seeded by (rank, index), with some labels
masked so that token weighting matters. Rank 0 saves θ (the committed parameters), what each
rank computed per period, and the update results.

    torchrun --nproc_per_node 2 tests/workers/overlap_worker.py KIND OUT COMMITS MICRO_BATCHES MODE SLOW_RANK_DELAY

TORCHACCO_TEST_DTYPE=bf16 computes in bf16, TORCHACCO_TEST_REDUCE ([parallelism] reduce_dtype,
default fp32) sums its gradients in that dtype. TORCHACCO_TEST_REPLICAS (default 1) and
TORCHACCO_TEST_DILOCO ("key=value,..." of [diloco]) run the strategy inside DiLoCo's replicas; θ is then θ_global.
TORCHACCO_TEST_OPTIMIZER ([optimizer] name, default adamw) and TORCHACCO_TEST_SHARD_DEGREE ([hsdp] shard_degree).
"""

import gc
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchacco.build import build_strategy
from torchacco.config import Config
from torchacco.device import Device, Stopwatch
from torchacco.loss import TokenLoss
from torchacco.lr import TokenSchedule
from torchacco.parallel.process_groups import init_distributed
from torchacco.parallel.strategy import Counts, UpdatePlan

VOCAB, SEQ, BATCH = 64, 16, 2
MODEL = os.environ.get("TORCHACCO_TEST_MODEL", "tiny")
EVALUATE_BETWEEN_ROUNDS = os.environ.get("TORCHACCO_TEST_EVALUATE", "") == "1"
REPLICAS = int(os.environ.get("TORCHACCO_TEST_REPLICAS", "1"))
DILOCO = dict(item.split("=") for item in os.environ.get("TORCHACCO_TEST_DILOCO", "").split(",") if item)


class Micro(torch.nn.Module):
    """Six parameters: on 4 ranks the last rank's optimizer shard is only padding."""

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(3, 1)
        self.head = torch.nn.Linear(1, 3, bias=False)
        self.layers = torch.nn.ModuleList()

    def forward(self, tokens):
        return self.head(self.embedding(tokens % 3))


def tiny_model():
    if MODEL == "micro":
        torch.manual_seed(0)
        return Micro()
    from torchacco.models.llama3 import spec

    args = spec.args(
        "debug",
        vocab_size=VOCAB,
        dim=32,
        n_layers=1 if MODEL == "one_layer" else 2,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden_dim=64,
        max_seq_len=SEQ,
    )
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights()
    return model


def micro_batch(rank: int, index: int) -> dict:
    g = torch.Generator().manual_seed(1000 * rank + index)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    labels = tokens[:, 1:].clone() % (3 if MODEL == "micro" else VOCAB)
    labels[torch.rand(labels.shape, generator=g) < 0.3] = -100
    return {"input_ids": tokens[:, :-1], "labels": labels}


def live_tensor_bytes() -> int:
    """Bytes of every live CPU tensor storage, each counted once: a hidden copy anywhere would show."""
    gc.collect()
    storages = {}
    with warnings.catch_warnings():  # isinstance() pokes deprecated torch.distributed attributes
        warnings.simplefilter("ignore")
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in tensors:
        if obj.device.type == "cpu" and not obj.is_meta:
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def schedule() -> TokenSchedule:
    # Warm-up over the first updates, then cosine: both parts of the token clock are exercised.
    return TokenSchedule(peak_lr=1e-2, warmup_tokens=200, total_tokens=2000, decay="cosine", min_lr_ratio=0.1)


def config(kind: str, mode: str) -> Config:
    cfg = Config()
    cfg.parallelism.data_parallel = kind
    cfg.strategy_options["acco"].mode = mode
    cfg.strategy_options["acco"].dpu_warmup_steps = 1 if kind == "dpu" else 0
    cfg.strategy_options["acco"].max_growth = 3.0  # bounds the fast rank's adaptive periods: 3 × 2 micro-batches
    cfg.strategy_options["acco"].estimate_comm = os.environ.get("TORCHACCO_TEST_ESTIMATE_COMM", "full")
    cfg.strategy_options["acco"].estimate_share = float(os.environ.get("TORCHACCO_TEST_ESTIMATE_SHARE", "0.5"))
    cfg.strategy_options["acco"].estimate_clip = os.environ.get("TORCHACCO_TEST_ESTIMATE_CLIP", "own")
    cfg.training.max_norm = 0.5  # low enough that clipping is active
    cfg.parallelism.replicas = REPLICAS
    cfg.parallelism.reduce_dtype = os.environ.get("TORCHACCO_TEST_REDUCE", "fp32")
    cfg.parallelism.balance_batches = mode == "balanced" and kind in ("ddp", "zero1")  # (acco: its own mode)
    cfg.strategy_options["acco"].mode = "deterministic" if cfg.parallelism.balance_batches else mode
    for name, text in DILOCO.items():
        kind_of = type(getattr(cfg.diloco, name))
        setattr(cfg.diloco, name, text == "1" if kind_of is bool else kind_of(text))
    cfg.optimizer.weight_decay = 0.1
    cfg.optimizer.name = os.environ.get("TORCHACCO_TEST_OPTIMIZER", "adamw")
    cfg.strategy_options["hsdp"].shard_degree = int(os.environ.get("TORCHACCO_TEST_SHARD_DEGREE", "0"))
    return cfg


def update_plan(cfg: Config, dims, micro_batches: int, dtype=torch.float32) -> UpdatePlan:
    nominal = micro_batches * BATCH * SEQ * dims.dp_size  # the recipe's tokens per update
    return UpdatePlan(micro_batches, schedule(), cfg.training.max_norm, dtype, nominal)


def build(model, cfg: Config, dims, micro_batches: int, dtype=torch.float32, device=Device("cpu")):
    """The strategy of `cfg` over `model`, with the tests' schedule."""
    return build_strategy(model, cfg, dims, update_plan(cfg, dims, micro_batches, dtype), device)


def exit_without_finalizing() -> None:
    """Exit 0 (the results are saved) skipping the interpreter's teardown: there, a gloo thread that drops
    the last reference to a finished collective's tensors after the process groups are destroyed aborts
    the process now and then ("terminate called without an active exception", about 1 run in 60 of the
    4-rank Streaming DiLoCo test on 2 cores)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(kind, out, commits, micro_batches, mode, delay):
    dims = init_distributed(Device("cpu"), replicas=REPLICAS)
    rank = dims.rank
    dtype = torch.bfloat16 if os.environ.get("TORCHACCO_TEST_DTYPE") == "bf16" else torch.float32
    dp = build(tiny_model(), config(kind, mode), dims, micro_batches, dtype)
    periods, results, index = [], [], 0
    while len(results) < commits:
        tokens, loss_sum, n = 0, 0.0, 0
        watch = Stopwatch(cuda=False).start()  # the period's compute time: balanced mode splits by it
        for ctx in dp.micro_batches():
            if rank == 1:
                time.sleep(delay)  # a slow worker
            with ctx:
                loss, count = TokenLoss().of_batch(dp.model, micro_batch(rank, index))
                loss.backward()
            tokens, loss_sum, n, index = tokens + count.item(), loss_sum + loss.item(), n + 1, index + 1
        periods.append(n)
        result = dp.step(Counts(tokens, loss_sum, n, n * BATCH * SEQ, (watch.stop(),)))
        if result is not None and result.committed:
            results.append(result)
            if EVALUATE_BETWEEN_ROUNDS:  # as the trainer does: a forward pass with θ between two rounds
                with dp.evaluation() as model, torch.no_grad():
                    model(micro_batch(rank, 10_000)["input_ids"])
    with dp.evaluation():
        full = [p.full_tensor() if isinstance(p, DTensor) else p for p in dp.model.parameters()]  # (fsdp)
        theta = torch.cat([p.detach().reshape(-1).float() for p in full])
    dp.close()
    all_periods = [None] * dims.world_size
    dist.all_gather_object(all_periods, periods)
    if rank == 0:
        torch.save(
            {
                "theta": theta,
                "periods": all_periods,
                "results": [(r.tokens, r.loss, r.lr, r.micro_batches, r.grad_norm) for r in results],
            },
            out,
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    kind, out, commits, micro_batches, mode, delay = sys.argv[1:]
    main(kind, out, int(commits), int(micro_batches), mode, float(delay))
    exit_without_finalizing()
