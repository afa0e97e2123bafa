"""`[optimizer] name = "muon"`: torch's Muon on the hidden matrices, AdamW on the rest. Every strategy's update
equals a single-process torch.optim.Muon + torch.optim.AdamW reference over the same micro-batches."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "workers"))
import overlap_worker as worker  # noqa: E402
from test_schedules import Reference, acco_reference, dpu_reference, run_worker, wp_reference, zero1_reference  # noqa: E402

from torchacco.config import Optimizer  # noqa: E402
from torchacco.optim import build_optimizer, hidden_matrix_ids  # noqa: E402

MUON = {"TORCHACCO_TEST_OPTIMIZER": "muon"}
# Newton–Schulz runs in bf16: a gradient summed in another order (the ranks' reduction against the reference's
# sequential sum) can round some of its inputs the other way, which moves those elements of a step by a few bf16
# ulps. Measured over 3 updates: θ off the reference by 0.1–0.6% of its displacement, 7e-4 at most. One straddling
# matrix orthogonalised shard by shard (no gather) puts θ 7% off, 1e-2 at most.
MAX_DRIFT, MAX_ABS = 0.02, 2e-3


def assert_steps_as(theta, expected, initial):
    """θ within MAX_DRIFT of the reference's displacement from θ_0 (in norm), and MAX_ABS of it everywhere."""
    drift = ((theta - expected).norm() / (expected - initial).norm()).item()
    assert drift < MAX_DRIFT, drift
    torch.testing.assert_close(theta, expected, rtol=0, atol=MAX_ABS)


class Optimizers:
    """Several torch optimizers stepped as one (the reference's Muon and AdamW)."""

    def __init__(self, *parts):
        self.parts = parts

    @property
    def param_groups(self):  # read anew: load_state_dict gives each part new group dicts
        return [g for o in self.parts for g in o.param_groups]

    def step(self):
        for o in self.parts:
            o.step()

    def zero_grad(self, set_to_none=True):
        for o in self.parts:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return [o.state_dict() for o in self.parts]

    def load_state_dict(self, states):
        for o, s in zip(self.parts, states):
            o.load_state_dict(s)


def muon_reference(periods, lr_scaling=None) -> Reference:
    """The schedules' reference with torch's Muon on the blocks' 2-D weights (by name), AdamW on the rest."""
    ref = Reference(periods, lr_scaling)
    ref.opt = muon_and_adamw(ref.model)
    return ref


def muon_and_adamw(model) -> Optimizers:
    cfg = worker.config("ddp", "deterministic").optimizer
    named = dict(model.named_parameters())
    hidden = [p for n, p in named.items() if n.startswith("layers.") and p.ndim == 2]
    rest = [p for p in named.values() if all(p is not h for h in hidden)]
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    decay = [p for p in rest if p.ndim >= 2 and id(p) not in embeddings]
    plain = [p for p in rest if not (p.ndim >= 2 and id(p) not in embeddings)]
    adamw = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": plain, "weight_decay": 0.0}],
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
    )
    muon = torch.optim.Muon(hidden, weight_decay=cfg.weight_decay, adjust_lr_fn="match_rms_adamw")
    return Optimizers(muon, adamw)


@pytest.fixture
def muon_reference_in(monkeypatch):
    """The schedules' reference functions, stepping Muon + AdamW, on a one-layer Llama whose flat buffer splits
    matrices between ranks: the MLP's w1 on 2 ranks; wk, w1 and w3 on 4."""
    import test_schedules

    monkeypatch.setattr(test_schedules, "Reference", muon_reference)
    monkeypatch.setattr(worker, "MODEL", "one_layer")


REFERENCES = {
    "ddp": lambda periods: zero1_reference(periods, 3),
    "fsdp": lambda periods: zero1_reference(periods, 3),
    "hsdp": lambda periods: zero1_reference(periods, 3),
    "zero1": lambda periods: zero1_reference(periods, 3),
    "acco": lambda periods: acco_reference(periods, 3),
    "dpu": lambda periods: dpu_reference(periods, 3, warmup=1),
    "wp": lambda periods: wp_reference(periods, 3),
}


# The default pass runs the two designs (flat slices, DTensor shards) and a peek (acco); the slow pass all.
ON_TWO_RANKS = [k if k in ("zero1", "fsdp", "acco") else pytest.param(k, marks=pytest.mark.slow) for k in REFERENCES]


@pytest.mark.integration
@pytest.mark.exact
@pytest.mark.parametrize("kind", ON_TWO_RANKS)
def test_each_strategy_steps_as_torchs_muon_with_adamw_on_two_ranks(tmp_path, muon_reference_in, kind):
    run = run_worker(tmp_path, kind, commits=3, micro_batches=2, model="one_layer", env=MUON)
    expected = REFERENCES[kind](run["periods"])
    assert_steps_as(run["theta"], expected, Reference(run["periods"]).theta())


@pytest.mark.integration
@pytest.mark.exact
@pytest.mark.slow
@pytest.mark.parametrize("kind", list(REFERENCES))
def test_each_strategy_steps_as_torchs_muon_with_adamw_on_four_ranks(tmp_path, muon_reference_in, kind):
    env = {**MUON, "TORCHACCO_TEST_SHARD_DEGREE": "2"}
    run = run_worker(tmp_path, kind, commits=3, micro_batches=2, nproc=4, model="one_layer", env=env)
    assert_steps_as(run["theta"], REFERENCES[kind](run["periods"]), Reference(run["periods"]).theta())


@pytest.mark.integration
@pytest.mark.exact
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ddp", "zero1"])
def test_muon_inside_diloco_replicas_equals_the_equations(tmp_path, monkeypatch, kind):
    """Two replicas of one rank, Muon + AdamW the inner optimizer, an outer Nesterov step every 2 updates."""
    import test_diloco

    plain = test_diloco.Replica.__init__

    def with_muon(self, ranks):
        plain(self, ranks)
        self.opt = muon_and_adamw(self.model)

    monkeypatch.setattr(test_diloco.Replica, "__init__", with_muon)
    monkeypatch.setenv("TORCHACCO_TEST_OPTIMIZER", "muon")
    run = test_diloco.run_diloco(tmp_path, kind, 4, micro_batches=2, sync_every=2)
    expected, spread, _ = test_diloco.diloco_reference(4, 2, replicas=2, dp=1, H=2)
    assert spread > 1e-4
    assert_steps_as(
        run["theta"], expected, torch.cat([p.detach().reshape(-1) for p in worker.tiny_model().parameters()])
    )


def _gpt_neo():
    from torchacco.models.gpt_neo import spec

    return spec.model_cls(spec.args("debug", vocab_size=64, dim=16, n_layers=2, n_heads=2, max_seq_len=8))


def _hidden_names(model) -> set[str]:
    ids = hidden_matrix_ids(model)
    return {n for n, p in model.named_parameters() if id(p) in ids}


def test_gpt_neo_hidden_matrices_are_the_blocks_projections():
    model = _gpt_neo()
    per_layer = {f"layers.{i}.{m}.weight" for i in range(2) for m in ("attn.q_proj", "attn.k_proj", "attn.v_proj")}
    per_layer |= {f"layers.{i}.{m}.weight" for i in range(2) for m in ("attn.out_proj", "mlp.c_fc", "mlp.c_proj")}
    assert _hidden_names(model) == per_layer  # not wte, wpe (the tied head), norms or biases


def test_llama_hidden_matrices_exclude_embeddings_and_the_untied_head():
    model = worker.tiny_model()
    names = _hidden_names(model)
    assert "output.weight" in dict(model.named_parameters()) and "output.weight" not in names
    mats = ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1")
    mats += ("feed_forward.w2", "feed_forward.w3")
    assert names == {f"layers.{i}.{m}.weight" for i in range(2) for m in mats}


def test_a_hugging_face_models_hidden_matrices_are_its_decoder_layers_and_the_rest_steps_with_adamw():
    from test_hf_model import _gpt2

    model = _gpt2()
    names = _hidden_names(model)
    assert names == {
        f"transformer.h.{i}.{m}.weight"
        for i in range(3)
        for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    }  # GPT-2's Conv1D weights; not wte, wpe, lm_head (tied), norms or biases
    cfg = Optimizer(name="muon")
    opt = build_optimizer(model, cfg)
    muon, adamw = opt.parts
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    assert {id(p) for g in muon.param_groups for p in g["params"]} == hidden_matrix_ids(model)
    assert muon.param_groups[0]["adjust_lr_fn"] == "match_rms_adamw"


def test_the_combined_optimizer_steps_as_its_parts_and_round_trips_its_state():
    torch.manual_seed(0)
    model, twin = worker.tiny_model(), worker.tiny_model()
    cfg = Optimizer(name="muon", lr=1e-2)
    opt, ref = build_optimizer(model, cfg), build_optimizer(twin, cfg)
    ref = Optimizers(*ref.parts)
    for step in range(3):
        for m in (model, twin):
            torch.manual_seed(step)
            for p in m.parameters():
                p.grad = torch.randn_like(p)
        opt.step()
        ref.step()
        if step == 1:  # a fresh optimizer loaded from the state steps on identically
            state = opt.state_dict()
            opt = build_optimizer(model, cfg)
            opt.load_state_dict(state)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    assert "momentum_buffer" in opt.parts[0].state[next(iter(opt.parts[0].param_groups[0]["params"]))]


MUON_ARGS = ("--optimizer.name", "muon")


@pytest.mark.integration
@pytest.mark.exact
@pytest.mark.parametrize(
    "kind", ["zero1", pytest.param("acco", marks=pytest.mark.slow), pytest.param("fsdp", marks=pytest.mark.slow)]
)
def test_a_muon_run_resumes_bit_for_bit(tiny_corpus, cache_dir, tmp_path, six_step_run, kind):
    from conftest import read_metrics, run_train, six_step_args

    full = six_step_run(kind, *MUON_ARGS)
    expected = read_metrics(full)
    step3 = full / "checkpoint" / "step-00000003"
    resumed = run_train(
        six_step_args(tiny_corpus, cache_dir, tmp_path / "resumed", kind, 6, *MUON_ARGS, "--checkpoint.load_path",
                      str(step3))
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    records = read_metrics(tmp_path / "resumed")
    assert [r["step"] for r in records] == [4, 5, 6]
    for key in ("loss", "lr", "tokens", "grad_norm"):
        assert [r[key] for r in records] == [r[key] for r in expected[3:]], key
    assert records[-1]["val_loss"] == expected[-1]["val_loss"]


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["zero1", "fsdp"])
def test_a_muon_checkpoint_reshards_from_2_ranks_to_1_and_back(tiny_corpus, cache_dir, tmp_path, kind):
    from conftest import run_train, six_step_args
    from test_checkpoint import _logical_state, _tensors, reshard

    from torchacco.checkpoint import step_dirs

    run = tmp_path / "run"
    assert run_train(six_step_args(tiny_corpus, cache_dir, run, kind, 3, *MUON_ARGS)).returncode == 0
    two = step_dirs(run / "checkpoint")[-1][1]
    one = reshard(run, two, tmp_path / "one", nproc=1)  # 2 ranks -> 1
    back = reshard(run, one, tmp_path / "back", nproc=2)  # 1 rank -> 2
    states = [_tensors(_logical_state(c, tmp_path / f"{n}.pt")["dp"]) for c, n in ((two, "a"), (one, "b"), (back, "c"))]
    assert states[0].keys() == states[1].keys() == states[2].keys()
    assert any("momentum_buffer" in k or "exp_avg" in k for k in states[0])
    for name, tensor in states[0].items():
        assert torch.equal(tensor, states[1][name]) and torch.equal(tensor, states[2][name]), name


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "fsdp"])
def test_the_dry_run_counts_one_momentum_on_the_matrices_where_adamw_keeps_two(strategy):
    from torchacco.build import model_args
    from torchacco.config import load_config
    from torchacco.planning import dry_run
    from torchacco.spec import get_model_spec

    cfgs = [load_config(["--parallelism.data_parallel", strategy, *extra]) for extra in ([], MUON_ARGS)]
    adamw, muon = (dry_run.plan(cfg, dry_run.Cluster(1, 2)).kinds[0].memory for cfg in cfgs)
    spec = get_model_spec(cfgs[0].model.name)
    with torch.device("meta"):
        model = spec.model_cls(model_args(spec, cfgs[0].model))
    named = dict(model.named_parameters())
    hidden = sum(p.numel() for n, p in named.items() if n.startswith("layers.") and p.ndim == 2)
    share = hidden / sum(p.numel() for p in named.values())
    assert 0.1 < share < 1
    assert muon.optimizer == pytest.approx(adamw.optimizer * (1 - share / 2), rel=1e-9)


def test_the_sharded_state_keeps_the_second_moment_for_adamws_elements_only():
    import torch.distributed as dist

    from torchacco.config import Config
    from torchacco.device import Device
    from torchacco.parallel.process_groups import init_distributed

    dims = init_distributed(Device("cpu"))
    try:
        cfg = Config()
        cfg.parallelism.data_parallel, cfg.optimizer.name = "zero1", "muon"
        model = worker.tiny_model()
        hidden = sum(p.numel() for n, p in model.named_parameters() if n.startswith("layers.") and p.ndim == 2)
        dp = worker.build(model, cfg, dims, 2)
        state = dp.sharded.optimizer.state
        assert state.exp_avg.numel() == state.master.numel() == dp.sharded.flat.padded_numel  # one rank
        assert state.exp_avg_sq.numel() == dp.sharded.flat.numel - hidden
    finally:
        dist.destroy_process_group()


def test_predict_adds_newton_schulz_and_the_gathers_to_each_strategys_update():
    import dataclasses

    from torchacco.optim import muon_workload
    from torchacco.planning import cost_model as cm
    from torchacco.spec import get_model_spec

    spec = get_model_spec("gpt_neo")
    with torch.device("meta"):
        model = spec.model_cls(spec.args("125M"))
    fields = muon_workload(Optimizer(name="muon"), model)
    # GPT-Neo 125M: per layer four 768 × 768 and two 768 × 3072 matrices, 5 steps of 4m²n + 2m³ each
    m, n = 768, 3072
    assert fields["muon_params"] == 12 * (4 * m * m + 2 * m * n)
    assert fields["muon_flops"] == 12 * 5 * (4 * 6 * m**3 + 2 * (4 * m * m * n + 2 * m**3))
    assert fields["muon_largest"] == m * n
    assert muon_workload(Optimizer(), model) == {}
    adamw = cm.model_workload("gpt_neo", "125M", 1024, 8, 4)
    muon = dataclasses.replace(adamw, **fields)
    hw = cm.Hardware(nodes=2, flops=1e14, bandwidth_bps=1e10, ranks_per_node=2)
    V = cm.collective_s(adamw.params * adamw.comm_bytes, hw)
    ns = fields["muon_flops"] / hw.flops
    extra = {
        s: cm.predict(muon, hw, s)["step_time_s"] - cm.predict(adamw, hw, s)["step_time_s"] for s in ("ddp", "zero1")
    }
    assert extra["ddp"] == pytest.approx(ns)  # every matrix on every rank, no communication
    # a slice's share, and the bf16 pieces of a straddling matrix from the rank across the node boundary
    assert extra["zero1"] == pytest.approx(ns / hw.world + 8 * 2 * m * n / hw.bandwidth_bps)
    assert extra["zero1"] < ns / hw.world + hw.ag_factor * V / 4  # far less than gathering the parameters
    fsdp = cm.predict(muon, hw, "fsdp")["step_time_s"] - cm.predict(adamw, hw, "fsdp")["step_time_s"]
    assert fsdp == pytest.approx(ns + hw.ag_factor * cm.collective_s(2 * fields["muon_params"], hw))  # bf16 updates


def test_only_the_ranks_that_share_a_matrix_exchange_its_pieces():
    from types import SimpleNamespace

    from torchacco.parallel.muon import _straddling

    # Matrices of 6, 10 and 4 elements at 0, 6 and 16, over slices of 7: the second spans all three ranks.
    params, offsets, size = [torch.zeros(2, 3), torch.zeros(2, 5), torch.zeros(2, 2)], [0, 6, 16], 7
    slices = {0: [(0, 6, 0, 0), (6, 7, 1, 0)], 1: [(0, 7, 1, 1)], 2: [(0, 2, 1, 8), (2, 6, 2, 0)]}
    pieces = {0: (0, 1), 1: (1, 8), 2: (8, 10)}  # of the second matrix, by rank
    for rank, matrices in slices.items():
        flat = SimpleNamespace(shard_numel=size, offsets=offsets, params=params, rank=rank)
        ((i, (lo, hi), first, others),) = _straddling(flat, matrices)  # the others are whole where they lie
        assert (i, first, hi - lo) == (1, pieces[rank][0], pieces[rank][1] - pieces[rank][0])
        assert others == [(q, *pieces[q]) for q in pieces if q != rank]


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"optimizer.slow_beta": 0.99}, "with name = 'muon' set slow_beta = 0"),
        ({"optimizer.muon_momentum": 1.0}, "muon_momentum must be in [0, 1)"),
        ({"optimizer.ns_steps": 0}, "ns_steps in [1, 99]"),
        ({"parallelism.tensor_parallel_degree": 2, "parallelism.data_parallel": "acco"}, "needs a synchronous"),
        ({"emulation.virtual_compute": True}, "times AdamW only"),
    ],
)
def test_what_muon_does_not_combine_with_is_one_line(overrides, message):
    from torchacco.config import Config
    from torchacco.errors import UserError
    from torchacco.validate import validate

    cfg = Config()
    cfg.optimizer.name, cfg.training.local_batch_size = "muon", 4
    for key, value in overrides.items():
        section, name = key.split(".")
        setattr(cfg.section(section), name, value)
    with pytest.raises(UserError) as e:
        validate(cfg, world_size=4)
    assert message in str(e.value) and "\n" not in str(e.value)
    validate(Config(optimizer=Optimizer(name="muon")), world_size=4)  # muon alone is fine


TP2, PP2 = ("--parallelism.tensor_parallel_degree", "2"), ("--parallelism.pipeline_parallel_degree", "2")
LLAMA = ("--model.name", "llama3", "--model.flavor", "debug")


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize(
    "kind, extra, reference",
    [("zero1", TP2, "zero1"), ("fsdp", TP2, "zero1"), ("zero1", (*LLAMA, *PP2), "zero1")],
    ids=["zero1-tp2", "fsdp-tp2", "zero1-pp2"],
)
def test_muon_under_tensor_or_pipeline_parallelism_follows_one_process(tiny_corpus, cache_dir, tmp_path, kind, extra,
                                                                       reference):  # fmt: skip
    """A matrix split over tp ranks is orthogonalised whole: the losses follow a one-process run's (a split one
    would step another way from the first update)."""
    from conftest import read_metrics, run_train, tiny_args

    def losses(name, kind, nproc, *more):
        argv = tiny_args(tiny_corpus, cache_dir, tmp_path / name, "--parallelism.data_parallel", kind,
                         "--training.global_batch_size", "8", "--training.steps", "4", *MUON_ARGS, *more)  # fmt: skip
        proc = run_train(argv, nproc=nproc)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return [r["loss"] for r in read_metrics(tmp_path / name)]

    model = extra[:2] if extra[0] == "--model.name" else ()
    expected = losses("one", reference, 1, *model)
    assert losses("split", kind, 2, *extra) == pytest.approx(expected, rel=1e-4)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["zero1", "acco", "wp"])
def test_bf16_compute_with_muon_tracks_the_fp32_equations(tmp_path, muon_reference_in, kind):
    """3 ranks in bf16, gradients summed in fp32 in the job's buffer, the parameters written into a bf16 half of it
    (`overlapped._fp32_reduce_out`), which the matrices' updates are gathered through too: θ tracks the fp32
    equations within bf16 compute's own error (as AdamW's test_bf16_compute_sums_gradients_in_fp32_by_default):
    measured 5% of the update for each."""
    run = run_worker(tmp_path, kind, 3, 2, nproc=3, model="one_layer", env={**MUON, "TORCHACCO_TEST_DTYPE": "bf16"})
    reference = REFERENCES[kind](run["periods"])
    update = reference - Reference(run["periods"]).theta()
    assert (run["theta"] - reference).norm() < 0.15 * update.norm()
