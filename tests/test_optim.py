"""Sharded AdamW equals torch's AdamW; `peek` leaves all state untouched; token-indexed LR."""

import copy

import pytest
import torch

from torchacco.config import Optimizer
from torchacco.lr import TokenSchedule
from torchacco.optim import ShardedAdamW


def _reference_and_sharded(weight_decay=0.1, decay_until=30):
    torch.manual_seed(0)
    cfg = Optimizer(lr=1e-2, weight_decay=weight_decay, beta1=0.9, beta2=0.95, eps=1e-8)
    decayed = torch.nn.Parameter(torch.randn(decay_until, dtype=torch.float64).float())
    plain = torch.nn.Parameter(torch.randn(50 - decay_until))
    ref = torch.optim.AdamW(
        [{"params": [decayed], "weight_decay": weight_decay}, {"params": [plain], "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
    )
    sharded = ShardedAdamW(torch.cat([decayed.detach(), plain.detach()]).clone(), [(0, decay_until)], cfg)
    return ref, (decayed, plain), sharded


@pytest.mark.exact
def test_sharded_adamw_matches_torch_adamw():
    ref, (decayed, plain), sharded = _reference_and_sharded()
    for step in range(5):
        grad = torch.randn(50)
        lr = 1e-2 * (step + 1) / 5
        decayed.grad, plain.grad = grad[:30].clone(), grad[30:].clone()
        for g in ref.param_groups:
            g["lr"] = lr
        ref.step()
        sharded.step(grad, lr)
        torch.testing.assert_close(
            sharded.state.master, torch.cat([decayed.detach(), plain.detach()]), rtol=1e-6, atol=1e-7
        )
    assert sharded.state.step == 5


def _slow_momentum_reference(theta, grads, lrs, cfg, decay_until):
    """MT-DAO's step (arXiv 2510.05361, one slow moment), written out in float64."""
    theta, m, v, s = theta.double(), *(torch.zeros(theta.numel(), dtype=torch.float64) for _ in range(3))
    b1, b2, bs, w = cfg.beta1, cfg.beta2, cfg.slow_beta, cfg.slow_weight
    for t, (g, lr) in enumerate(zip(grads, lrs), start=1):
        g = g.double()
        theta[:decay_until] *= 1 - lr * cfg.weight_decay
        m, v, s = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g, bs * s + (1 - bs) * g
        direction = (1 - w) * m / (1 - b1**t) + w * s / (1 - bs**t)
        theta -= lr * direction / ((v / (1 - b2**t)).sqrt() + cfg.eps)
    return theta


@pytest.mark.parametrize("slow_weight", [0.3, 1.0])
def test_slow_momentum_steps_as_written_replicated_and_sharded(slow_weight):
    """The slow moment, in torch-optimizer form (DDP, FSDP) and sharded (ZeRO-1, ACCO), against the
    equations; and the two forms equal bit for bit, as ZeRO-1 must equal DDP."""
    from torchacco.optim import build_adamw

    torch.manual_seed(0)
    cfg = Optimizer(lr=1e-2, weight_decay=0.1, slow_beta=0.99, slow_weight=slow_weight)
    model = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.LayerNorm(6))  # 30 decayed, 18 not
    theta = torch.cat([p.detach().flatten() for p in model.parameters()])
    sharded = ShardedAdamW(theta.clone(), [(0, 30)], cfg)
    replicated = build_adamw(model, cfg)
    grads, lrs = [torch.randn(48) for _ in range(6)], [1e-2 * (k + 1) / 6 for k in range(6)]
    for grad, lr in zip(grads, lrs):
        for p, piece in zip(model.parameters(), grad.split([p.numel() for p in model.parameters()])):
            p.grad = piece.view_as(p).clone()
        for g in replicated.param_groups:
            g["lr"] = lr
        replicated.step()
        sharded.step(grad, lr, chunk=11)  # chunks straddle the decay range's end
    stepped = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert torch.equal(sharded.state.master, stepped)
    expected = _slow_momentum_reference(theta, grads, lrs, cfg, decay_until=30)
    torch.testing.assert_close(stepped.double(), expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(expected, _slow_momentum_reference(theta, grads, lrs, Optimizer(
        lr=1e-2, weight_decay=0.1, slow_beta=0.99, slow_weight=0.0), decay_until=30), atol=1e-4)  # fmt: skip
    peeked = sharded.peek(grads[0], 1e-3)
    assert torch.equal(peeked, sharded.step(grads[0], 1e-3).clone())


def test_slow_momentum_state_round_trips():
    from torchacco.optim import build_adamw

    cfg = Optimizer(lr=1e-2, slow_beta=0.99)
    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    b.load_state_dict(a.state_dict())
    opt_a, opt_b = build_adamw(a, cfg), build_adamw(b, cfg)
    for _ in range(2):
        for p in a.parameters():
            p.grad = torch.ones_like(p)
        opt_a.step()
    b.load_state_dict(a.state_dict())
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))  # as from a file: no tensor shared
    for model, opt in ((a, opt_a), (b, opt_b)):
        for p in model.parameters():
            p.grad = torch.full_like(p, -0.5)
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_peek_is_step_without_side_effects():
    _, _, sharded = _reference_and_sharded()
    sharded.step(torch.randn(50), 1e-2)  # non-trivial moments
    before = copy.deepcopy(sharded.state)
    grad = torch.randn(50)
    peeked = sharded.peek(grad, 5e-3)
    for name in ("master", "exp_avg", "exp_avg_sq"):
        assert torch.equal(getattr(sharded.state, name), getattr(before, name)), name
    assert sharded.state.step == before.step
    assert torch.equal(peeked, sharded.step(grad, 5e-3).clone())


def test_peek_at_round_zero_uses_bias_correction_of_step_one():
    _, _, sharded = _reference_and_sharded(weight_decay=0.0)
    grad = torch.randn(50)
    peeked = sharded.peek(grad, 1e-2)
    # At step 1, Adam's bias-corrected update is lr * g / (|g| + eps') ≈ lr * sign(g).
    torch.testing.assert_close(sharded.state.master - peeked, 1e-2 * grad.sign(), atol=1e-6, rtol=1e-4)
    assert sharded.state.step == 0 and not sharded.state.exp_avg.any()


def test_token_schedule():
    s = TokenSchedule(peak_lr=1.0, warmup_tokens=100, total_tokens=1100, decay="cosine", min_lr_ratio=0.1)
    assert s(0, 50) == pytest.approx(0.5)  # warm-up counts the update's own tokens
    assert s(50, 50) == pytest.approx(1.0)
    assert s(600) == pytest.approx(0.55)
    assert s(1100) == pytest.approx(0.1) and s(5000) == pytest.approx(0.1)
    lin = TokenSchedule(1.0, 0, 1000, "linear", 0.0)
    assert lin(0, 100) == 1.0  # no warm-up: the first update is at the peak
    assert lin(250, 100) == pytest.approx(0.75)
    assert TokenSchedule(2.0, 0, 10, "constant")(7) == 2.0


def test_no_weight_decay_on_norms_biases_and_embeddings():
    from torchacco.optim import no_weight_decay_ids
    from torchacco.spec import get_model_spec

    spec = get_model_spec("gpt_neo")
    model = spec.model_cls(spec.args("debug"))
    skip = no_weight_decay_ids(model)
    names = {name for name, p in model.named_parameters() if id(p) in skip}
    assert {
        "wte.weight",
        "wpe.weight",
        "ln_f.weight",
        "ln_f.bias",
        "layers.0.ln_1.weight",
        "layers.0.attn.out_proj.bias",
        "layers.0.mlp.c_fc.bias",
    } <= names
    decayed = {name for name, p in model.named_parameters() if id(p) not in skip}
    assert decayed == {
        name for name, p in model.named_parameters() if p.ndim == 2 and "wte" not in name and "wpe" not in name
    }
    assert "layers.0.attn.q_proj.weight" in decayed and "layers.1.mlp.c_proj.weight" in decayed


@pytest.mark.exact
def test_peek_in_chunks_equals_one_piece_and_writes_any_dtype():
    ref, _, sharded = _reference_and_sharded(weight_decay=0.1, decay_until=30)
    sharded.step(torch.randn(50), 1e-2)
    grad = torch.randn(50)
    whole = sharded.peek(grad, 3e-3, chunk=1 << 20)
    assert torch.equal(sharded.peek(grad, 3e-3, chunk=7), whole)  # chunks straddle the decay range's end
    bf16 = torch.empty(50, dtype=torch.bfloat16)
    sharded.peek(grad, 3e-3, out=bf16, chunk=16)
    assert torch.equal(bf16, whole.bfloat16())


def test_updates_read_a_scaled_gradient_of_any_dtype_and_may_write_over_it():
    """The job's in-place form: the gradient shard is scaled as it is read, and the new
    parameters may overwrite its buffer chunk by chunk."""
    _, _, a = _reference_and_sharded(weight_decay=0.1, decay_until=30)
    _, _, b = _reference_and_sharded(weight_decay=0.1, decay_until=30)
    grad = torch.randn(50).bfloat16()
    a.step(grad.float() * 0.25, 1e-2)
    buffer = grad.clone()
    b.step(buffer, 1e-2, scale=0.25, out=buffer, chunk=7)
    for name in ("master", "exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(getattr(b.state, name), getattr(a.state, name), rtol=0, atol=1e-7)
    assert torch.equal(buffer, b.state.master.bfloat16())  # each chunk read before it was overwritten

    peeked = a.peek(grad.float() * 0.25, 1e-2)
    buffer = grad.clone()
    torch.testing.assert_close(b.peek(buffer, 1e-2, scale=0.25, out=buffer, chunk=7), peeked.bfloat16())


def test_commit_with_prediction_is_step_then_peek():
    _, _, a = _reference_and_sharded(weight_decay=0.1, decay_until=30)
    _, _, b = _reference_and_sharded(weight_decay=0.1, decay_until=30)
    grad = torch.randn(50)
    a.step(grad, 1e-2)
    predicted = a.peek(grad, 1e-2)
    out = torch.empty(50)
    b.step(grad, 1e-2, out=out, predict=True, chunk=16)
    assert torch.equal(b.state.master, a.state.master) and b.state.step == a.state.step
    assert torch.equal(out, predicted)


@pytest.mark.integration
def test_updates_hold_a_few_chunks_not_copies_of_the_shard():
    """The overlapped job runs beside the next micro-batch's activations, so its working memory
    must stay a few chunks. Peak resident memory during a step and a peek on a 16M-element shard
    (64 MiB per fp32 copy) must grow by far less than one copy. In a fresh process, with glibc
    returning every freed buffer to the system, so the high-water mark follows live memory."""
    import os
    import subprocess
    import sys

    script = """
import torch
from torchacco.config import Optimizer
from torchacco.optim import ShardedAdamW

def high_water_mib():
    return int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) / 1024

n = 16 << 20
opt = ShardedAdamW(torch.randn(n), [(0, n // 2)], Optimizer(weight_decay=0.1))
grad = torch.randn(n).bfloat16()
out = torch.empty(n, dtype=torch.bfloat16)
opt.step(grad, 1e-3, scale=0.5, out=out)  # warm up the allocator and every code path once
growth = []
for update in (lambda: opt.step(grad, 1e-3, scale=0.5, out=grad, predict=True),
               lambda: opt.peek(grad, 1e-3, scale=0.5, out=grad)):
    open("/proc/self/clear_refs", "w").write("5")  # reset the high-water mark
    before = high_water_mib()
    update()
    growth.append(high_water_mib() - before)
print(*growth)
"""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    step_mib, peek_mib = map(float, proc.stdout.split())
    # A chunk is 512 Ki elements (2 MiB in fp32); an update holds ~6 of them. One fp32 copy is 64 MiB.
    assert step_mib < 20 and peek_mib < 20, (step_mib, peek_mib)
