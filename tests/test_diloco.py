"""DiLoCo and Streaming DiLoCo equal their equations: 2 or 4 gloo ranks in replicas against a
sequential reference written here (the replicas simulated in one process, torch's AdamW inside and
torch's Nesterov SGD outside); the wire formats' error; the impossible settings' one-line errors."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import read_metrics, run_train, six_step_args, tiny_args
from test_schedules import ROOT, run_worker

from torchacco.config import Config, DiLoCo, load_config
from torchacco.errors import UserError
from torchacco.parallel.diloco import has_outer_step
from torchacco.parallel.diloco.compression import sparse_token_weighted_mean
from torchacco.parallel.diloco.pseudo_gradient import (
    split_across,
    split_token_weighted_mean,
    token_weighted_mean,
)
from torchacco.parallel.diloco.wire import CHUNK, ROW
from torchacco.planning import dry_run, predict
from torchacco.validate import validate

sys.path.insert(0, str(Path(__file__).parent / "workers"))
import overlap_worker as worker  # noqa: E402


class Replica:
    """One replica: θ in a model, torch AdamW, the schedule over its own tokens; its ranks' data."""

    def __init__(self, ranks: list[int]):
        self.ranks, self.index = ranks, 0
        self.model = worker.tiny_model()
        self.params = list(self.model.parameters())
        cfg = worker.config("zero1", "deterministic")
        self.max_norm = cfg.training.max_norm
        decay = [p for n, p in self.model.named_parameters() if p.ndim >= 2 and "embeddings" not in n]
        plain = [p for n, p in self.model.named_parameters() if not (p.ndim >= 2 and "embeddings" not in n)]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.optimizer.weight_decay}, {"params": plain, "weight_decay": 0.0}],
            betas=(cfg.optimizer.beta1, cfg.optimizer.beta2),
            eps=cfg.optimizer.eps,
        )
        self.schedule, self.consumed = worker.schedule(), 0.0

    def update(self, micro_batches: int) -> float:
        """One inner AdamW update over its ranks' next micro-batches; the loss tokens behind it."""
        self.opt.zero_grad(set_to_none=True)
        tokens, consumed = 0, 0
        for _ in range(micro_batches):
            for rank in self.ranks:
                batch = worker.micro_batch(rank, self.index)
                logits = self.model(batch["input_ids"])
                F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum").backward()
                tokens += (batch["labels"] != -100).sum().item()
                consumed += worker.BATCH * worker.SEQ
            self.index += 1
        for p in self.params:
            p.grad /= tokens
        torch.nn.utils.clip_grad_norm_(self.params, self.max_norm)
        for group in self.opt.param_groups:
            group["lr"] = self.schedule(self.consumed, consumed)
        self.opt.step()
        self.consumed += consumed
        return float(tokens)


def fragments_of_tiny_model(fragments: int) -> list[list[int]]:
    """Parameter indices per fragment: embeddings with layer 0, the final norm and head with layer 1."""
    names = [n for n, _ in worker.tiny_model().named_parameters()]
    if fragments == 1:
        return [list(range(len(names)))]
    first = [i for i, n in enumerate(names) if n.startswith(("tok_embeddings", "layers.0."))]
    return [first, [i for i in range(len(names)) if i not in first]]


def sparse_reference(e: torch.Tensor, keep: int, bits: int | None) -> torch.Tensor:
    """What top-k sends of e, chunk by chunk: the `keep` largest magnitudes of every 4096 elements (of equal
    ones, the first), each rounded to the nearest of 2^bits levels spread evenly over ±(the chunk's largest
    kept magnitude); fp32 values as they are when `bits` is None."""
    sent = torch.zeros_like(e)
    for start in range(0, e.numel(), 4096):
        chunk = e[start : start + 4096]
        order = sorted(range(chunk.numel()), key=lambda j: -abs(chunk[j].item()))[:keep]
        top = torch.tensor(max(abs(chunk[j].item()) for j in order), dtype=torch.float32)
        levels = None if bits is None else 2**bits - 1
        for j in order:
            if bits is None:
                sent[start + j] = chunk[j]
            else:
                step = top * (2.0 / levels)
                code = torch.round(chunk[j] / step + levels / 2).clamp(0, levels)
                sent[start + j] = (code - levels / 2) * step
    return sent


def diloco_reference(
    updates, micro_batches, replicas, dp, H, P=1, tau=0, alpha=0.0, lr=0.7, mu=0.9, eager=False, computed=None,
    topk=None, warm=0, mu_warmup=0, h_max=0, mu_decay=False,
):  # fmt: skip
    """θ_global after `updates` inner updates (the equations of torchacco/parallel/diloco/__init__.py).
    `computed[r][t]`: whether replica r computed slot t (mixed replicas; all of them when None).
    `topk`: (elements kept per chunk, code bits, error decay β, over the senders): each replica sends the top-k
    of its residual e ← β·e + Δ_r and keeps the rest; over the senders, an element's mean weighs only the
    replicas that sent it, over at least half of the tokens. `warm`: after each of the first `warm` updates, every
    replica's θ becomes the token-weighted mean of theirs (the outer optimizer untouched). `h_max`: after
    each outer step the next comes min(h_max, max(H, ⌊H·(η_peak / η_t)²⌋)) / P updates later (QSR). `mu_decay`: the
    momentum is also multiplied by η_t / η_peak."""
    reps = [Replica([r * dp + d for d in range(dp)]) for r in range(replicas)]
    frags = fragments_of_tiny_model(P)
    # θ_global per fragment, as parameters of torch's Nesterov SGD
    backups = [[p.detach().clone().requires_grad_(True) for i, p in enumerate(reps[0].params) if i in f] for f in frags]
    outer = [torch.optim.SGD(b, lr=lr, momentum=mu, nesterov=mu > 0) for b in backups]
    tokens = [[0.0] * P for _ in reps]
    in_flight, guesses = {}, {}
    residuals = [[None] * P for _ in reps]
    steps = [0] * P  # each fragment's outer steps

    def eager_guess(f):
        """Each replica continues from the outer step taken with its own Δ (torch's momentum buffer untouched)."""
        guesses[f] = []
        with torch.no_grad():
            for rep in reps:
                mine = []
                for b, i in zip(backups[f], frags[f]):
                    delta = b.detach() - rep.params[i].detach()
                    m = outer[f].state[b].get("momentum_buffer", torch.zeros_like(b)) if outer[f].state else 0.0
                    guess = b.detach() - lr * (delta + mu * (mu * m + delta))
                    rep.params[i].copy_(guess)
                    mine.append(guess.clone())
                guesses[f].append(mine)

    def pseudo_gradient_mean(f):
        total = sum(tokens[r][f] for r in range(replicas))
        if topk is not None:
            return sparse_mean(f, total)
        mean = [torch.zeros_like(b) for b in backups[f]]
        for r, rep in enumerate(reps):
            for m, b, i in zip(mean, backups[f], frags[f]):
                m += tokens[r][f] / total * (b.detach() - rep.params[i].detach())
            tokens[r][f] = 0.0
        return mean

    def sparse_mean(f, total):
        keep, bits, decay, over_senders = topk
        mean, weight = torch.zeros(sum(b.numel() for b in backups[f])), torch.zeros(1)
        for r, rep in enumerate(reps):
            delta = torch.cat([(b.detach() - rep.params[i].detach()).reshape(-1) for b, i in zip(backups[f], frags[f])])
            e = delta if residuals[r][f] is None else decay * residuals[r][f] + delta
            sent = sparse_reference(e, keep, bits)
            residuals[r][f] = e - sent
            mean += tokens[r][f] / total * sent
            weight = weight + tokens[r][f] / total * (sent != 0 if over_senders else 1)  # (codes are never 0)
            tokens[r][f] = 0.0
        mean = mean / weight.clamp_min(0.5)  # over the senders: at least half of the tokens
        return [g.view_as(b) for g, b in zip(mean.split([b.numel() for b in backups[f]]), backups[f])]

    interval = H // P
    period, peak = warm // interval, 0.0  # the periods begun; the largest lr so far
    next_outer = (period + 1) * interval
    spread, token_counts = 0.0, set()  # how far the replicas drift apart between outer steps; their tokens
    for t in range(1, updates + 1):
        ran = [computed is None or bool(computed[r][t - 1]) for r in range(replicas)]
        for r, rep in enumerate(reps):
            if not ran[r]:
                continue
            n = rep.update(micro_batches)
            tokens[r] = [x + n for x in tokens[r]]
            token_counts.add((t, r, n))
        if computed is not None:  # each replica's lr clock: the tokens of the replicas that ran, over R
            nominal = micro_batches * dp * worker.BATCH * worker.SEQ
            for r, rep in enumerate(reps):
                rep.consumed += nominal * sum(ran) / replicas - (nominal if ran[r] else 0)
        spread = max(spread, (reps[0].params[1] - reps[-1].params[1]).norm().item())
        lr_t = reps[0].opt.param_groups[0]["lr"]
        peak = max(peak, lr_t)
        if t <= warm:
            with torch.no_grad():
                for f in range(P):
                    total = sum(tokens[r][f] for r in range(replicas))
                    for b, i in zip(backups[f], frags[f]):
                        b.copy_(sum(tokens[r][f] / total * rep.params[i] for r, rep in enumerate(reps)))
                        for rep in reps:
                            rep.params[i].copy_(b)
                    for r in range(replicas):
                        tokens[r][f] = 0.0
            continue
        if t == next_outer:
            f, period = period % P, period + 1
            next_outer += min(h_max, max(H, int(H * (peak / lr_t) ** 2))) // P if h_max else interval
            mean = in_flight.pop(f) if tau else pseudo_gradient_mean(f)
            for b, g in zip(backups[f], mean):
                b.grad = g
            steps[f] += 1  # fragment f's k-th outer step: μ·min(1, k / W), times η_t / η_peak with the decay
            momentum = mu * (min(1.0, steps[f] / mu_warmup) if mu_warmup else 1.0)
            outer[f].param_groups[0]["momentum"] = momentum * (lr_t / peak if mu_decay else 1.0)
            outer[f].step()
            with torch.no_grad():
                for r, rep in enumerate(reps):
                    for k, (b, i) in enumerate(zip(backups[f], frags[f])):
                        local = rep.params[i].detach().clone()
                        if eager:
                            rep.params[i].copy_(b + (local - guesses[f][r][k]))
                        else:
                            rep.params[i].copy_((1 - alpha) * b + alpha * local)
        if tau and t + tau == next_outer:
            f = period % P
            in_flight[f] = pseudo_gradient_mean(f)  # first: it reads θ_r, which the eager guess then replaces
            if eager:
                eager_guess(f)
    theta = [None] * len(reps[0].params)
    for f, idx in enumerate(frags):
        for b, i in zip(backups[f], idx):
            theta[i] = b.detach()
    distinct_tokens = len({n for _, _, n in token_counts}) > 1
    return torch.cat([t.reshape(-1) for t in theta]), spread, distinct_tokens


def run_diloco(tmp_path, kind, updates, micro_batches, nproc=2, replicas=2, **diloco):
    env = {
        "TORCHACCO_TEST_REPLICAS": str(replicas),
        "TORCHACCO_TEST_DILOCO": ",".join(f"{k}={v}" for k, v in diloco.items()),
    }
    return run_worker(tmp_path, kind, updates, micro_batches, nproc=nproc, env=env)


@pytest.mark.integration
@pytest.mark.exact
@pytest.mark.parametrize(
    "kind, diloco, updates",
    [
        ("ddp", dict(sync_every=3), 6),
        ("zero1", dict(sync_every=4, fragments=2), 8),
        ("zero1", dict(sync_every=4, fragments=2, overlap_steps=1, mixing=0.5), 9),
        ("fsdp", dict(sync_every=2, outer_lr=1.0, outer_momentum=0.0, offload=1), 4),
        ("zero1", dict(sync_every=4, fragments=2, overlap_steps=1, eager=1), 9),
        (
            "ddp",
            dict(
                sync_every=4,
                fragments=2,
                overlap_steps=1,
                topk=0.05,
                outer_dtype="int4",
                error_decay=0.9,
                topk_mean="replicas",
            ),
            9,
        ),
        (
            "ddp",
            dict(sync_every=4, fragments=2, overlap_steps=1, topk=0.02, outer_dtype="int2", topk_mean="senders"),
            9,
        ),
        ("zero1", dict(sync_every=4, fragments=2, overlap_steps=1, warm_start=4), 9),
        ("ddp", dict(sync_every=2, fragments=2, outer_momentum_warmup=3), 12),
        ("zero1", dict(sync_every=4, fragments=2, overlap_steps=1, sync_every_max=12), 23),
        ("ddp", dict(sync_every=2, fragments=2, outer_momentum_warmup=3, outer_momentum_decay=1), 12),
    ],
    ids=[
        "ddp",
        "zero1-streaming",
        "zero1-overlap-mixing",
        "fsdp-averaging-offload",
        "zero1-eager",
        "ddp-topk-int4-replicas",
        "ddp-topk-senders",
        "zero1-warm-start",
        "ddp-momentum-warmup",
        "zero1-qsr",
        "ddp-momentum-warmup-and-decay",
    ],
)
def test_diloco_equals_its_equations(tmp_path, kind, diloco, updates):
    run = run_diloco(tmp_path, kind, updates, micro_batches=2, **diloco)
    reference_keys = dict(H=diloco["sync_every"], P=diloco.get("fragments", 1), tau=diloco.get("overlap_steps", 0))
    reference_keys |= dict(alpha=diloco.get("mixing", 0.0), lr=diloco.get("outer_lr", 0.7))
    reference_keys |= dict(mu=diloco.get("outer_momentum", 0.9), eager=bool(diloco.get("eager", 0)))
    reference_keys |= dict(warm=diloco.get("warm_start", 0), mu_warmup=diloco.get("outer_momentum_warmup", 0))
    reference_keys |= dict(h_max=diloco.get("sync_every_max", 0), mu_decay=bool(diloco.get("outer_momentum_decay")))
    if "topk" in diloco:
        bits = {"int8": 8, "int4": 4, "int2": 2}[diloco["outer_dtype"]]
        over_senders = diloco.get("topk_mean", DiLoCo().topk_mean) == "senders"
        reference_keys |= dict(topk=(round(diloco["topk"] * 4096), bits, diloco.get("error_decay", 0.95), over_senders))
    expected, spread, distinct_tokens = diloco_reference(updates, 2, replicas=2, dp=1, **reference_keys)
    torch.testing.assert_close(run["theta"], expected, rtol=1e-5, atol=1e-5)
    # The replicas saw different data and drifted apart (so the mean is a mean); the masked labels
    # give them different token counts (so the weighting is exercised).
    assert spread > 1e-4 and distinct_tokens
    assert not torch.allclose(expected, torch.cat([p.detach().reshape(-1) for p in worker.tiny_model().parameters()]))


@pytest.mark.integration
@pytest.mark.exact
@pytest.mark.slow
def test_sharded_outer_step_equals_the_unsharded_one(tmp_path):
    """Two replicas of two ranks: zero1 inside (θ_global and momentum sharded, the all-reduce between
    shard holders) against ddp inside (every rank holds all of θ_global), and both against the reference."""
    diloco = dict(sync_every=2, fragments=2)
    sharded = run_diloco(tmp_path, "zero1", 4, 1, nproc=4, **diloco)
    replicated = run_diloco(tmp_path, "ddp", 4, 1, nproc=4, **diloco)
    torch.testing.assert_close(sharded["theta"], replicated["theta"], rtol=1e-5, atol=1e-6)
    expected, _, _ = diloco_reference(4, 1, replicas=2, dp=2, H=2, P=2)
    torch.testing.assert_close(sharded["theta"], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.integration
@pytest.mark.exact
@pytest.mark.slow
def test_ddp_inside_replicas_of_two_ranks_with_the_transfer_beside_compute_equals_its_equations(tmp_path):
    """Δ split over a replica's two ddp ranks, its mean all-gathered on the transfer's thread while
    ddp all-reduces gradients on the compute thread (each on a group of its own)."""
    diloco = dict(sync_every=4, fragments=2, overlap_steps=1)
    run = run_diloco(tmp_path, "ddp", 9, 1, nproc=4, **diloco)
    expected, _, _ = diloco_reference(9, 1, replicas=2, dp=2, H=4, P=2, tau=1)
    torch.testing.assert_close(run["theta"], expected, rtol=1e-5, atol=1e-5)


def diloco_memory(tmp_path, kind: str, **diloco) -> list[dict]:
    out = tmp_path / f"memory_{kind}.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TORCHACCO_TEST_REPLICAS": "2"}
    env["TORCHACCO_TEST_DILOCO"] = ",".join(f"{k}={v}" for k, v in diloco.items())
    worker_py = Path(__file__).parent / "workers" / "diloco_memory.py"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4", str(worker_py)]
    proc = subprocess.run([*argv, kind, str(out)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.integration
@pytest.mark.slow
def test_memory_over_the_inner_strategy_is_the_backup_and_momentum_of_this_ranks_part_of_theta(tmp_path):
    """2 replicas of 2 ranks, every live tensor counted: DiLoCo adds θ_global and the momentum in fp32 (8 bytes
    per element) of the θ the rank holds: half of θ with zero1 inside, all of it with ddp; topk's residual 4
    more; eager adds θ̂ of the largest fragment (4 bytes per element). The cost model's share of θ per rank is
    the same (it leaves out eager's θ̂)."""
    from torchacco.planning.cost_model import Hardware, Workload, diloco_memory_bytes

    work, node = Workload(params=1.0, flops_per_token=1.0, tokens_per_micro_batch=1.0), Hardware(2, 1.0, None, 0, 2)
    for kind, diloco in [
        ("ddp", dict(sync_every=2)),
        ("zero1", dict(sync_every=4, fragments=2, overlap_steps=1, eager=1)),
        ("zero1", dict(sync_every=2, topk=0.05)),  # the residual: 4 more bytes per element
    ]:
        reports = diloco_memory(tmp_path, kind, **diloco)
        per_element = 12 if diloco.get("topk") else 8
        for r in reports:
            extra = r["diloco_bytes"] - r["inner_bytes"]
            eager = 4 * r["largest_fragment"] if diloco.get("eager") else 0
            placeholders = per_element * r["empty_fragments"]  # a fragment none of whose θ is on this rank
            assert extra == per_element * r["theta_elements"] + eager + placeholders, (kind, diloco, r)
            outer = diloco_memory_bytes(work, node, kind) - diloco_memory_bytes(work, node, kind, offload=True)
            share = outer / 8.0  # the model's share of θ per rank (params = 1)
            assert r["theta_elements"] == pytest.approx(share * r["model_elements"], rel=0.02), (kind, r)


@pytest.mark.integration
def test_acco_inside_replicas_trains_and_the_replicas_agree_after_an_outer_step(tmp_path):
    """ACCO inside each replica (its estimate and commit rounds between outer steps): θ_global is
    the token-weighted outer step of the two replicas' ACCO trajectories, within ACCO's tolerance of
    the reference with a synchronous inner step (one half-batch of staleness per update)."""
    run = run_diloco(tmp_path, "acco", 4, 2, sync_every=2)
    expected, _, _ = diloco_reference(4, 2, replicas=2, dp=1, H=2)
    initial = torch.cat([p.detach().reshape(-1) for p in worker.tiny_model().parameters()])
    assert not torch.allclose(run["theta"], initial)
    # ACCO's θ differs from the synchronous inner step's by its estimate's error: small against the step.
    assert (run["theta"] - expected).norm() < 0.5 * (expected - initial).norm()


@pytest.mark.integration
@pytest.mark.exact
def test_mixed_replicas_a_slow_replica_runs_fewer_inner_updates_and_the_merge_equals_its_equations(tmp_path):
    """Replica 1 sleeps 400 ms per micro-batch (H_1 = 1 while replica 0's takes under 200 ms, a margin for a
    loaded machine): after the first period it computes only the first of each period's 4 slots and idles the
    rest, and θ_global equals the sequential reference run over the same schedule (token-weighted merge, every
    replica's lr clock the run's tokens over R)."""
    run = run_worker(
        tmp_path,
        "ddp",
        12,
        1,
        delay=0.4,
        env={"TORCHACCO_TEST_REPLICAS": "2", "TORCHACCO_TEST_DILOCO": "sync_every=4,balance_replicas=1"},
    )
    fast, slow = run["periods"]
    assert fast == [1] * 12, fast
    assert slow[:4] == [1] * 4, "the first period has no measurement: every replica runs H"
    assert slow[4:] == [1, 0, 0, 0] * 2, slow
    expected, _, _ = diloco_reference(12, 1, replicas=2, dp=1, H=4, computed=run["periods"])
    torch.testing.assert_close(run["theta"], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.integration
@pytest.mark.exact
def test_mixed_replicas_with_streaming_send_the_same_fragments_at_the_same_outer_steps(tmp_path):
    """Two fragments, each all-reduced beside one inner update (τ = 1); replica 1 sleeps 500 ms per micro-batch
    (a wide margin: a period of H / P = 2 slots times only 2 updates). After the first period the slow replica
    computes the first slot of each, both send fragment f at the same outer steps, and θ_global equals the
    sequential reference over that schedule."""
    diloco = "sync_every=4,fragments=2,overlap_steps=1,balance_replicas=1"
    run = run_worker(tmp_path, "ddp", 10, 1, delay=0.5,
                     env={"TORCHACCO_TEST_REPLICAS": "2", "TORCHACCO_TEST_DILOCO": diloco})  # fmt: skip
    fast, slow = run["periods"]
    assert fast == [1] * 10 and slow == [1, 1] + [1, 0] * 4, run["periods"]
    expected, _, _ = diloco_reference(10, 1, replicas=2, dp=1, H=4, P=2, tau=1, computed=run["periods"])
    torch.testing.assert_close(run["theta"], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("wire, tolerance", [("fp32", 1e-6), ("bf16", 2**-8), ("int8", 1 / 254)])
def test_token_weighted_mean_on_each_wire(wire, tolerance):
    """One rank (a group of one): the mean is the pseudo-gradient itself, within the format's error."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        delta = torch.randn(1000)
        mean = token_weighted_mean(delta, 123.0, dist.group.WORLD, wire)
    finally:
        dist.destroy_process_group()
    assert mean.dtype == torch.float32
    assert ((mean - delta).abs() <= tolerance * delta.abs().max()).all()


def _split_mean_rank(rank: int, store_path: str, out: str) -> None:
    """Ranks 0, 1 are replica 0 and ranks 2, 3 replica 1; a replica's ranks hold the same Δ."""
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 4), rank=rank, world_size=4)
    replica_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    split_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replica, dp = divmod(rank, 2)
    torch.manual_seed(replica)
    delta = torch.randn(2 * ROW + 77) * torch.logspace(-3, 2, 2 * ROW + 77)
    tokens = [300.0, 500.0][replica]
    results = {}
    for wire in ("fp32", "bf16", "int8", "int4"):
        whole = token_weighted_mean(delta, tokens, replica_groups[dp], wire)
        split = split_token_weighted_mean(delta, tokens, replica_groups[dp], wire, split_groups[replica])
        results[wire] = (whole, split)
    # top-k: each rank sends its 1/dp of the chunks; the mean and what was sent are all-gathered
    e = torch.cat([delta, delta.flip(0), delta[:1000]])  # (past one chunk)
    exchange = lambda x: sparse_token_weighted_mean(x, tokens, replica_groups[dp], "int2", 40)  # noqa: E731
    whole, split = exchange(e), split_across(exchange, e, split_groups[replica], CHUNK)
    results["topk"], results["topk-sent"] = (whole[0], split[0]), (whole[1], split[1])
    torch.save(results, f"{out}.{rank}")
    dist.destroy_process_group()


@pytest.mark.integration
@pytest.mark.slow
def test_split_mean_equals_the_whole_mean_on_every_wire(tmp_path):
    """A replicated inner strategy's ranks each send 1/dp of Δ and all-gather the rest: the same mean,
    element for element, as every rank sending all of it (the codes' rows and top-k's chunks stay whole)."""
    import torch.multiprocessing as mp

    out = str(tmp_path / "mean")
    mp.spawn(_split_mean_rank, args=(str(tmp_path / "store"), out), nprocs=4)
    per_rank = [torch.load(f"{out}.{rank}") for rank in range(4)]
    for wire in ("fp32", "bf16", "int8", "int4", "topk"):
        for results in per_rank:
            whole, split = results[wire]
            assert torch.equal(whole, split), wire
            assert wire != "topk" or torch.equal(*results["topk-sent"])  # the error feedback's share too
        assert all(torch.equal(r[wire][1], per_rank[0][wire][1]) for r in per_rank), wire  # every rank agrees


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"parallelism.replicas": 3}, "not divisible by [parallelism] replicas"),
        ({"diloco.sync_every": 10, "diloco.topk": 0.03, "diloco.outer_dtype": "int2"},
         "outer_dtype, topk set: they shape the exchange between replicas, and [parallelism] replicas = 1 has none"),
        ({"diloco.sync_every": 10, "diloco.overlap_steps": 1, "diloco.mixing": 0.5},
         "overlap_steps, mixing set: they shape the exchange"),
        ({"diloco.warm_start": 10, "diloco.balance_replicas": True, "training.max_tokens": 10**6},
         "warm_start, balance_replicas set: they shape the exchange"),
        ({"diloco.fault_tolerant": True}, "fault_tolerant set: they shape the exchange"),
        ({"parallelism.replicas": 2, "diloco.sync_every": 10, "diloco.fragments": 3}, "not a multiple of fragments"),
        ({"parallelism.replicas": 2, "diloco.balance_replicas": True}, "balance_replicas needs [training] max_tokens"),
        (
            {"parallelism.replicas": 2, "diloco.balance_replicas": True, "training.max_tokens": 10**6,
             "parallelism.data_parallel": "acco", "training.global_batch_size": 32},
            "runs its updates overlapped with the next",
        ),
        ({"parallelism.replicas": 2, "diloco.sync_every": 8, "diloco.fragments": 2, "diloco.overlap_steps": 4},
         "below sync_every / fragments = 4"),
        ({"parallelism.replicas": 2, "diloco.mixing": 0.5}, "overlap_steps = 0"),
        ({"parallelism.replicas": 2, "diloco.eager": True}, "set overlap_steps >= 1 and mixing = 0"),
        ({"parallelism.replicas": 2, "parallelism.data_parallel": "wp"}, "cannot run inside DiLoCo's replicas"),
        ({"parallelism.replicas": 2, "parallelism.data_parallel": "hsdp"}, "it replicates across nodes itself"),
        ({"parallelism.replicas": 2, "diloco.outer_momentum": 1.0}, "outer_momentum = 1 in [0, 1)"),
        ({"parallelism.replicas": 2, "parallelism.data_parallel": "acco", "acco.mode": "adaptive",
          "training.global_batch_size": 16, "training.max_tokens": 10**5}, "'adaptive' inside DiLoCo's replicas"),
        ({"parallelism.replicas": 2, "training.global_batch_size": 12}, "× replicas = 4 × 2 × 2 = 16"),
        ({"parallelism.replicas": 2, "diloco.topk": 1.5}, "use 0 (all) to 1"),
        ({"parallelism.replicas": 2, "diloco.sync_every": 4, "diloco.fragments": 2, "diloco.warm_start": 3},
         "must be a multiple of sync_every / fragments = 2"),
        ({"parallelism.replicas": 2, "diloco.warm_start": 100, "diloco.balance_replicas": True,
          "training.max_tokens": 10**6}, "use one of them"),
        ({"parallelism.replicas": 2, "diloco.error_decay": 0.5}, "topk = 0 sends all; set topk"),
        ({"parallelism.replicas": 2, "diloco.topk_mean": "replicas"}, "averages what topk sends, and topk = 0"),
        ({"parallelism.replicas": 2, "diloco.sync_every": 10, "diloco.sync_every_max": 5}, "of at least sync_every"),
        ({"parallelism.replicas": 2, "diloco.sync_every_max": 200, "diloco.fault_tolerant": True},
         "set sync_every_max = 0"),
        ({"parallelism.replicas": 2, "diloco.outer_momentum_decay": True, "diloco.fault_tolerant": True},
         "set outer_momentum_decay = false"),
        ({"parallelism.replicas": 2, "diloco.outer_momentum_decay": True, "diloco.outer_momentum": 0.0},
         "outer_momentum_decay scales the outer momentum, and outer_momentum = 0"),
        ({"parallelism.replicas": 2, "diloco.outer_momentum_warmup": 20, "diloco.outer_momentum": 0.0},
         "outer_momentum_warmup scales the outer momentum, and outer_momentum = 0"),
        ({"parallelism.replicas": 2, "diloco.topk": 0.01, "diloco.error_decay": -1}, "between 0 and 1"),
        ({"parallelism.replicas": 2, "optimizer.slow_beta": 1.0}, "must be in [0, 1) (0: off)"),
        ({"parallelism.replicas": 2, "optimizer.slow_weight": 0.0}, "slow_weight = 0 must be in (0, 1]"),
    ],
)  # fmt: skip
def test_impossible_settings_are_one_line_errors(overrides, message):
    cfg = Config()
    cfg.training.local_batch_size = 4
    for key, value in overrides.items():
        section, name = key.split(".")
        setattr(cfg.section(section), name, value)
    with pytest.raises(UserError) as e:
        validate(cfg, world_size=4)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_fragments_split_a_models_blocks_held_in_a_module_dict():
    """Under pipeline parallelism a stage keeps its blocks in a ModuleDict (`pipeline.Layers`): fragments follow
    the blocks, not every parameter into the first fragment."""
    from torchacco.parallel.diloco import fragment_of

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(5, 2)
            self.layers = torch.nn.ModuleDict({str(i): torch.nn.Linear(2, 2) for i in range(4)})
            self.norm = torch.nn.LayerNorm(2)

    model = Model()
    names = [n for n, _ in model.named_parameters()]
    which = dict(zip(names, fragment_of(model, names, 2)))
    assert which["embed.weight"] == which["layers.0.weight"] == which["layers.1.bias"] == 0
    assert which["layers.2.weight"] == which["layers.3.bias"] == which["norm.weight"] == 1


def test_more_fragments_than_blocks_is_one_line():
    from torchacco.parallel.diloco import fragment_of

    model = worker.tiny_model()
    names = [n for n, _ in model.named_parameters()]
    assert fragment_of(model, names, 2) == [0] + [0] * 9 + [1] * 9 + [1, 1]
    with pytest.raises(UserError, match="fragments = 3 exceeds the 2 transformer blocks"):
        fragment_of(model, names, 3)


def test_offline_export_of_a_replicated_run_is_one_line(tmp_path, capsys):
    from torchacco.export import main

    cfg = Config()
    cfg.parallelism.replicas = 2
    (tmp_path / "config.toml").write_text(cfg.to_toml())
    assert main([str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert "not exported offline yet" in err and "export_hf = true" in err and "\n" not in err


# An outer step over one replica (SNOO, arXiv 2510.15830; DiLoCo with M = 1): Δ̄ = Δ, nothing exchanged.
SLOW = pytest.mark.slow


@pytest.mark.integration
@pytest.mark.exact
@pytest.mark.parametrize(
    "kind, diloco, updates",
    [
        ("ddp", dict(sync_every=3), 6),  # one replica of two ddp ranks: no split all-gather either
        pytest.param(
            "zero1", dict(sync_every=4, fragments=2, sync_every_max=8, outer_momentum_warmup=2), 14, marks=SLOW
        ),
        pytest.param("fsdp", dict(sync_every=2, offload=1, outer_momentum_decay=1), 6, marks=SLOW),
    ],
    ids=["ddp", "zero1-streaming-qsr-momentum-warmup", "fsdp-offload-momentum-decay"],
)
def test_an_outer_step_over_one_replica_equals_its_equations(tmp_path, kind, diloco, updates):
    run = run_diloco(tmp_path, kind, updates, micro_batches=2, replicas=1, **diloco)
    keys = dict(H=diloco["sync_every"], P=diloco.get("fragments", 1), h_max=diloco.get("sync_every_max", 0))
    keys |= dict(mu_warmup=diloco.get("outer_momentum_warmup", 0), mu_decay=bool(diloco.get("outer_momentum_decay")))
    expected, _, distinct_tokens = diloco_reference(updates, 2, replicas=1, dp=2, **keys)
    torch.testing.assert_close(run["theta"], expected, rtol=1e-5, atol=1e-5)
    plain, _, _ = diloco_reference(updates, 2, replicas=1, dp=2, **keys, lr=1.0, mu=0.0)  # θ_global = θ: no step
    assert distinct_tokens and (expected - plain).norm() > 100 * 1e-5 * plain.norm()


def first_outer_step(theta_0: torch.Tensor, theta_h: torch.Tensor, lr: float = 0.7, mu: float = 0.9) -> torch.Tensor:
    """θ_global after the first outer step, H updates from θ_0 to θ_H: m = Δ, θ_0 − η·(1 + μ)·Δ."""
    return theta_0 - lr * (1 + mu) * (theta_0 - theta_h)


@pytest.mark.integration
@pytest.mark.exact
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["acco", "dpu", "wp", "hsdp"])
def test_an_outer_step_over_one_replica_of_each_strategy_moves_its_own_theta(tmp_path, kind):
    """The strategies without a synchronous reference here (ACCO's estimate, DPU's and WP's stale gradient; HSDP's
    2-D mesh): the first outer step, after H = 2 updates, equals the equations over the same strategy's plain run."""
    (tmp_path / "plain").mkdir(), (tmp_path / "snoo").mkdir()
    plain = run_worker(tmp_path / "plain", kind, 2, 2)
    snoo = run_diloco(tmp_path / "snoo", kind, 2, 2, replicas=1, sync_every=2)
    initial = torch.cat([p.detach().reshape(-1) for p in worker.tiny_model().parameters()])
    assert not torch.allclose(plain["theta"], initial)
    torch.testing.assert_close(snoo["theta"], first_outer_step(initial, plain["theta"]), rtol=1e-5, atol=1e-6)


@pytest.mark.integration
@pytest.mark.exact
@pytest.mark.slow
def test_evaluating_between_updates_leaves_an_outer_step_over_wp_unchanged(tmp_path):
    """WP computes at a predicted θ: evaluating θ_global between rounds restores that prediction, bit for bit."""
    env = {"TORCHACCO_TEST_REPLICAS": "1", "TORCHACCO_TEST_DILOCO": "sync_every=2"}
    (tmp_path / "quiet").mkdir(), (tmp_path / "evaluated").mkdir()
    quiet = run_worker(tmp_path / "quiet", "wp", 5, 2, env=env)
    evaluated = run_worker(tmp_path / "evaluated", "wp", 5, 2, env={**env, "TORCHACCO_TEST_EVALUATE": "1"})
    assert torch.equal(quiet["theta"], evaluated["theta"])


def test_the_documented_one_replica_example_runs_and_its_dry_run_counts_the_outer_state(tmp_path, capsys):
    """docs/diloco.md's SNOO example over train_configs/default.toml (zero1 on 2 ranks): valid; the dry run adds
    θ_global and the momentum of each rank's half of θ, 8 bytes per element; `predict` times it as zero1 (nothing sent),
    its tokens not measured."""

    text = (ROOT / "docs" / "diloco.md").read_text()
    argv = re.search(r"`\./run_train\.sh --config (train_configs/default\.toml [^`]*)`", text).group(1).split()
    configs = [load_config(["--config", str(ROOT / argv[0]), *extra]) for extra in ([], argv[1:])]
    assert [has_outer_step(1, c.diloco) for c in configs] == [False, True] and configs[1].parallelism.replicas == 1
    plain, snoo = (dry_run.plan(c, dry_run.Cluster(1, 2)).kinds[0] for c in configs)
    assert snoo.memory.buffers - plain.memory.buffers == 8 * snoo.params / 2 > 0
    (tmp_path / "snoo.toml").write_text(configs[1].to_toml())
    argv = ["--config", str(tmp_path / "snoo.toml"), "--nodes", "1", "--gpus-per-node", "2", "--optimizer", "adamw"]
    assert predict.main(argv) == 0  # (the config's optimizer)
    rows = {line.split("|")[1].strip(): line.split("|") for line in capsys.readouterr().out.splitlines() if "|" in line}
    own = rows["zero1, SNOO H 10 (the config's)"]
    assert own[2] == rows["zero1"][2] and "not measured" in map(str.strip, own)


def test_one_replica_has_an_outer_step_only_with_a_diloco_key_and_every_strategy_runs_it(monkeypatch):
    assert not has_outer_step(1, DiLoCo()) and has_outer_step(1, DiLoCo(sync_every=10)) and has_outer_step(2, DiLoCo())
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    for kind in ("ddp", "zero1", "fsdp", "hsdp", "acco", "dpu", "wp"):
        cfg = Config()
        cfg.parallelism.data_parallel, cfg.diloco.sync_every = kind, 10
        cfg.training.local_batch_size, cfg.training.global_batch_size = 4, 32  # (acco: two periods per update)
        validate(cfg, world_size=4)


@pytest.mark.integration
@pytest.mark.exact
@pytest.mark.slow
def test_an_outer_step_over_one_replica_resumes_bit_for_bit(tiny_corpus, cache_dir, tmp_path, six_step_run):
    """Checkpointed at update 3, between the outer steps of updates 2 and 4: θ_global and the momentum are state."""
    snoo = ("--diloco.sync_every", "2")
    full = six_step_run("zero1", *snoo)
    expected = read_metrics(full)
    assert [r["outer_bytes"] for r in expected if "outer_step" in r] == [0.0] * 3  # updates 2, 4 and 6; nothing sent
    step3 = str(full / "checkpoint" / "step-00000003")
    argv = six_step_args(tiny_corpus, cache_dir, tmp_path / "resumed", "zero1", 6, *snoo, "--checkpoint.load_path")
    resumed = run_train([*argv, step3])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "(an outer step every H 2: SNOO)" in resumed.stdout
    records = read_metrics(tmp_path / "resumed")
    for key in ("loss", "lr", "tokens", "grad_norm", "outer_delta_norm"):
        assert [r.get(key) for r in records] == [r.get(key) for r in expected[3:]], key
    assert records[-1]["val_loss"] == expected[-1]["val_loss"]


@pytest.mark.integration
@pytest.mark.slow
def test_an_outer_step_over_one_replica_under_tensor_parallelism_equals_one_rank(tiny_corpus, cache_dir, tmp_path):
    """zero1 inside, tp 2 against one rank: the outer step works on each rank's tensor-parallel shard of θ."""
    snoo = ("--parallelism.data_parallel", "zero1", "--diloco.sync_every", "2", "--training.steps", "5")
    runs = []
    for name, tp, nproc in (("one", "1", 1), ("tp2", "2", 2)):
        argv = tiny_args(tiny_corpus, cache_dir, tmp_path / name, *snoo, "--parallelism.tensor_parallel_degree", tp)
        proc = run_train(argv, nproc=nproc)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(read_metrics(tmp_path / name))
    one, tp2 = runs
    assert [r["step"] for r in tp2 if "outer_step" in r] == [2, 4] == [r["step"] for r in one if "outer_step" in r]
    assert [r["loss"] for r in tp2] == pytest.approx([r["loss"] for r in one], rel=1e-5, abs=1e-5)
