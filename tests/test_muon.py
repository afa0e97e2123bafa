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
# sequential sum) can round one of its inputs the other way, which moves that element of the step by a bf16 ulp
# (~0.4%) of lr × 0.2·√max(A, B) ≈ 0.02. A matrix orthogonalised shard by shard moves θ by whole steps.
TOLERANCE = {"rtol": 1e-5, "atol": 2e-4}


class Optimizers:
    """Several torch optimizers stepped as one (the reference's Muon and AdamW)."""

    def __init__(self, *parts):
        self.parts = parts
        self.param_groups = [g for o in parts for g in o.param_groups]

    def step(self):
        for o in self.parts:
            o.step()

    def state_dict(self):
        return [o.state_dict() for o in self.parts]

    def load_state_dict(self, states):
        for o, s in zip(self.parts, states):
            o.load_state_dict(s)


def muon_reference(periods) -> Reference:
    """The schedules' reference with torch's Muon on the blocks' 2-D weights (by name), AdamW on the rest."""
    ref = Reference(periods)
    cfg = worker.config("ddp", "deterministic").optimizer
    named = dict(ref.model.named_parameters())
    hidden = [p for n, p in named.items() if n.startswith("layers.") and p.ndim == 2]
    rest = [p for p in named.values() if all(p is not h for h in hidden)]
    embeddings = {id(m.weight) for m in ref.model.modules() if isinstance(m, torch.nn.Embedding)}
    decay = [p for p in rest if p.ndim >= 2 and id(p) not in embeddings]
    plain = [p for p in rest if not (p.ndim >= 2 and id(p) not in embeddings)]
    adamw = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": plain, "weight_decay": 0.0}],
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
    )
    muon = torch.optim.Muon(hidden, weight_decay=cfg.weight_decay, adjust_lr_fn="match_rms_adamw")
    ref.opt = Optimizers(muon, adamw)
    return ref


@pytest.fixture
def muon_reference_in(monkeypatch):
    """The schedules' reference functions, stepping Muon + AdamW."""
    import test_schedules

    monkeypatch.setattr(test_schedules, "Reference", muon_reference)


REFERENCES = {
    "ddp": lambda periods: zero1_reference(periods, 3),
    "fsdp": lambda periods: zero1_reference(periods, 3),
    "hsdp": lambda periods: zero1_reference(periods, 3),
    "zero1": lambda periods: zero1_reference(periods, 3),
    "acco": lambda periods: acco_reference(periods, 3),
    "dpu": lambda periods: dpu_reference(periods, 3, warmup=1),
    "wp": lambda periods: wp_reference(periods, 3),
}


@pytest.mark.integration
@pytest.mark.exact
@pytest.mark.parametrize("kind", list(REFERENCES))
def test_each_strategy_steps_as_torchs_muon_with_adamw_on_two_ranks(tmp_path, muon_reference_in, kind):
    run = run_worker(tmp_path, kind, commits=3, micro_batches=2, env=MUON)
    expected = REFERENCES[kind](run["periods"])
    torch.testing.assert_close(run["theta"], expected, **TOLERANCE)
    assert not torch.allclose(expected, Reference(run["periods"]).theta())  # it trained


@pytest.mark.integration
@pytest.mark.exact
@pytest.mark.slow
@pytest.mark.parametrize("kind", list(REFERENCES))
def test_each_strategy_steps_as_torchs_muon_with_adamw_on_four_ranks(tmp_path, muon_reference_in, kind):
    env = {**MUON, "TORCHACCO_TEST_SHARD_DEGREE": "2"}
    run = run_worker(tmp_path, kind, commits=3, micro_batches=2, nproc=4, env=env)
    torch.testing.assert_close(run["theta"], REFERENCES[kind](run["periods"]), **TOLERANCE)


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
        f"transformer.h.{i}.{m}.weight" for i in range(3) for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
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
