"""A data-parallel strategy is one class: defined here, outside torchacco, and registered, it trains
through torchacco.train, and the config, its reference, the cost model and the benchmarks' strategy
lists pick it up with no edit anywhere else."""

import contextlib
import dataclasses
import re
from pathlib import Path
from typing import ClassVar

import pytest
import torch
import torch.distributed as dist

from torchacco.config import Config, load_config, reference_markdown
from torchacco.options import Options, key
from torchacco.parallel import registry
from torchacco.parallel.accounting import gather_counts
from torchacco.parallel.strategy import Counts, MemoryParts, Strategy, Traits, UpdateResult
from torchacco.planning import cost_model as cm
from torchacco.trainer import train

ROOT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass
class ToyOptions(Options):
    section: ClassVar[str] = "toy_sgd"
    momentum: float = key(0.0, "heavy-ball momentum of the toy strategy")


class AllReduceSGD(Strategy):
    """Plain SGD on replicated parameters: sum the gradients with one all-reduce after the period."""

    traits = Traits("toy_sgd", "all_reduce_in_backward", "gradient all-reduce", options=ToyOptions)

    def __init__(self, model, dims, plan, lr: float, momentum: float):
        self.model, self.dims, self.plan, self.lr, self.momentum = model, dims, plan, lr, momentum
        self.velocity = [torch.zeros_like(p) for p in model.parameters()]

    @classmethod
    def from_config(cls, model, dims, plan, device, *, optimizer, options, **_):
        return cls(model, dims, plan, optimizer.lr, options.momentum)

    @classmethod
    def memory(cls, numel, dp_size, param_dtype, reduce_dtype, options=None):
        return MemoryParts(weights=4 * numel, gradients=4 * numel, buffers=4 * numel)  # the velocity

    def micro_batches(self):
        for _ in range(self.plan.micro_batches):
            yield contextlib.nullcontext()

    def step(self, counts: Counts) -> UpdateResult:
        gathered = gather_counts(counts, self.dims.dp_group, "cpu")
        gathered.require_tokens()
        with torch.no_grad():
            for p, v in zip(self.model.parameters(), self.velocity):
                dist.all_reduce(p.grad, group=self.dims.dp_group)
                v.mul_(self.momentum).add_(p.grad, alpha=1 / gathered.tokens)
                p.sub_(v, alpha=self.lr)
                p.grad = None
        return gathered.result(gathered.loss_sum, 0.0, self.lr, True)

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


@pytest.fixture
def toy_registered(monkeypatch):
    monkeypatch.setitem(cm.VARIANTS, "toy_sgd_momentum", (("--toy_sgd.momentum", "0.9"), "deterministic"))
    registry.register(AllReduceSGD)
    yield AllReduceSGD
    registry.REGISTERED.pop(AllReduceSGD.name)


class Counting(torch.utils.data.IterableDataset):
    def __iter__(self):
        while True:
            seq = torch.arange(33) % 50
            yield {"input_ids": seq[:-1], "labels": seq[1:]}


def test_a_strategy_defined_outside_torchacco_trains_through_train(toy_registered, tmp_path):
    from torchacco.models.llama3 import spec

    model = spec.model_cls(spec.args("debug", vocab_size=64, n_layers=2))
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights()
    cfg = load_config(["--parallelism.data_parallel", "toy_sgd", "--toy_sgd.momentum", "0.5"])
    cfg.job.dump_folder = str(tmp_path)
    cfg.training.steps, cfg.training.seq_len, cfg.training.local_batch_size = 12, 32, 8
    cfg.optimizer.lr, cfg.lr_schedule.warmup_steps = 0.02, 0
    cfg.eval.every, cfg.metrics.tensorboard, cfg.metrics.log_every = 0, False, 1
    train(cfg, model=model, datasets=(Counting(), None))
    losses = [float(m) for m in re.findall(r'"loss": ([\d.]+)', (tmp_path / "metrics.jsonl").read_text())]
    assert len(losses) == 12 and max(losses[-3:]) < 0.75 * losses[0], losses
    assert 'data_parallel = "toy_sgd"' in (tmp_path / "config.toml").read_text()
    assert "momentum = 0.5" in (tmp_path / "config.toml").read_text()


def test_a_config_built_before_register_gets_the_new_section_with_its_defaults():
    early = Config()
    registry.register(AllReduceSGD)
    try:
        assert early.options(ToyOptions) == ToyOptions() and "[toy_sgd]" in early.to_toml()
    finally:
        registry.REGISTERED.pop(AllReduceSGD.name)


def test_the_config_and_its_reference_follow_the_registered_strategies(toy_registered):
    cfg = Config()
    assert cfg.strategy_options["toy_sgd"].momentum == 0.0
    assert "[toy_sgd]" in cfg.to_toml()
    reference = reference_markdown()
    assert "## [toy_sgd]" in reference and "`toy_sgd`" in reference
    assert "heavy-ball momentum of the toy strategy" in reference


def test_the_cost_model_and_the_benchmarks_list_a_registered_strategy(toy_registered):
    from benchmarks.common import strategy_variants

    assert {"toy_sgd", "toy_sgd_momentum"} <= set(cm.variants())
    work = cm.Workload(params=1e6, flops_per_token=6e6, tokens_per_micro_batch=1e3, micro_batches=2)
    hw = cm.Hardware(nodes=2, flops=1e12, bandwidth_bps=1e9)
    predicted = cm.predict_all(work, hw)
    assert predicted["toy_sgd"]["step_time_s"] == predicted["ddp"]["step_time_s"]  # the same traits, the same time
    assert cm.memory_bytes(work, hw, "toy_sgd") == 12 * 1e6
    expected = ["--parallelism.data_parallel", "toy_sgd", "--toy_sgd.momentum", "0.9"]
    assert strategy_variants()["toy_sgd_momentum"] == expected


def test_an_unknown_strategy_is_one_line_listing_the_registered_ones():
    from torchacco.errors import UserError

    names = "ddp, zero1, fsdp, hsdp, acco, dpu, wp"
    with pytest.raises(UserError, match=rf"data_parallel = 'nope' is not one of: {names}$"):
        load_config(["--parallelism.data_parallel", "nope"])


def test_a_second_strategy_with_a_taken_name_or_section_is_refused(toy_registered):
    clash = type("Clash", (AllReduceSGD,), {})
    with pytest.raises(ValueError, match="registered already"):
        registry.register(clash)
    options = type("O", (Options,), {"section": "toy_sgd"})
    other = type(
        "Other",
        (AllReduceSGD,),
        {"traits": dataclasses.replace(AllReduceSGD.traits, name="toy_other", options=options)},
    )
    with pytest.raises(ValueError, match=r"\[toy_sgd\] holds another strategy's options"):
        registry.register(other)


def test_no_strategy_name_is_spelled_outside_its_own_modules():
    """A strategy's name, as a string literal, appears only in the modules of its class and its
    bases, its registry line and its options section: everything else asks the class (traits) or the registry."""
    sources = [p for folder in ("torchacco", "benchmarks") for p in (ROOT / folder).rglob("*.py")]
    for name, cls in registry.strategies().items():
        own = {
            Path(c.__module__.replace(".", "/") + ".py") for c in cls.__mro__ if c.__module__.startswith("torchacco")
        } | {Path("torchacco/parallel/registry.py"), Path("torchacco/options.py")}
        spelled = re.compile(rf"""["']{re.escape(name)}["']""")
        offenders = [
            str(p.relative_to(ROOT))
            for p in sources
            if p.relative_to(ROOT) not in own and spelled.search(p.read_text(encoding="utf-8"))
        ]
        assert not offenders, f"{name!r} is spelled in {offenders}; ask the strategy class or the registry instead"
