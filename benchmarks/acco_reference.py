"""A single-process reference of DDP and ACCO on torchacco's own model, data and recipe.

    .venv/bin/python -m benchmarks acco-reference --schedule acco --updates 640 --seed 2 --out FILE.jsonl

The equations of /work/shared/ACCO.md written out plainly, independently of torchacco's buffers, threads and
collectives: θ, m and v as flat fp32 vectors, AdamW by hand (torch's formula: decoupled decay on the same groups,
bias correction, eps outside the square root), clipping as torch's clip_grad_norm_. The data-parallel ranks are
simulated: each rank's own data loader (the trainer's, built for that rank), their token-loss sums added. So a run
here and a 2-rank torchacco run see the same model, initialisation, data order, lr clock and normaliser, and
differ only by floating-point order; bisecting between them separates a defect of torchacco's ACCO from a
property of the algorithm on this recipe.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from benchmarks.names import ACCO, DDP
from torchacco.build import build_model
from torchacco.config import load_config
from torchacco.device import Device
from torchacco.loss import TokenLoss
from torchacco.lr import TokenSchedule
from torchacco.optim import no_weight_decay_ids
from torchacco.spec import get_model_spec


def recipe(updates: int, lr: float, seed: int, extra: list[str] = (), flavor: str = "debug") -> list[str]:
    """The time-to-target recipe (benchmarks/time_to_target.py) on 2 ranks, as trainer arguments
    (GPT-Neo `flavor`: the sweep's debug, or tiny to check a finding on a larger model)."""
    return [
        "--config", "train_configs/default.toml",
        "--model.flavor", flavor,
        "--tokenizer.vocab_size", "1024",
        "--training.seq_len", "128",
        "--training.local_batch_size", "4",
        "--training.global_batch_size", "16",
        "--training.steps", str(10 * updates),
        "--training.max_tokens", str(updates * 16 * 128),
        "--lr_schedule.warmup_steps", str(max(1, updates // 20)),
        "--optimizer.lr", str(lr),
        "--eval.every", str(max(1, updates // 10)),
        "--eval.batches", "4",
        "--training.seed", str(seed),
        *extra,
    ]  # fmt: skip


class Simulation:
    """θ, AdamW state and the ranks' data, with gradients and evaluation over all simulated ranks."""

    def __init__(self, cfg, ranks: int = 2):
        from torchacco import data

        t = cfg.training
        self.cfg, self.ranks = cfg, ranks
        torch.manual_seed(t.seed)
        data.prepare(cfg.data, cfg.tokenizer, t.seq_len)
        tokenizer = data.load_tokenizer(cfg.data, cfg.tokenizer)
        sets = [data.build_datasets(cfg.data, cfg.tokenizer, t.seq_len, r, ranks, t.seed) for r in range(ranks)]
        self.train = [iter(data.build_dataloader(s[0], t.local_batch_size)) for s in sets]
        self.val = [data.build_dataloader(s[1], t.local_batch_size) for s in sets]
        spec = get_model_spec(cfg.model.name)
        self.model = build_model(spec, cfg.model, tokenizer.vocab_size, t.seed, Device("cpu"))
        self.params = [p for p in self.model.parameters() if p.requires_grad]  # a tied weight once
        skip = no_weight_decay_ids(self.model)
        self.decay = torch.cat([torch.full((p.numel(),), float(id(p) not in skip)) for p in self.params])
        self.theta = torch.cat([p.detach().reshape(-1) for p in self.params]).clone()
        self.m = torch.zeros_like(self.theta)
        self.v = torch.zeros_like(self.theta)
        self.step = 0
        self.loss_fn = TokenLoss()
        global_batch = t.global_batch_size
        self.micro_batches = global_batch // (t.local_batch_size * ranks)  # per rank and update
        tokens_per_update = global_batch * t.seq_len
        self.schedule = TokenSchedule(
            peak_lr=cfg.optimizer.lr,
            warmup_tokens=cfg.lr_schedule.warmup_steps * tokens_per_update,
            total_tokens=t.max_tokens or t.steps * tokens_per_update,
            decay=cfg.lr_schedule.decay,
            min_lr_ratio=cfg.lr_schedule.min_lr_ratio,
        )
        self.consumed = 0.0

    def load(self, flat: torch.Tensor) -> None:
        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

    def gradients_at(self, flat: torch.Tensor, micro_batches: int) -> tuple[torch.Tensor, float, float, float]:
        """(Σ ∇ token losses, tokens in the loss, their loss sum, input tokens) of the next `micro_batches`
        micro-batches of every rank, at parameters `flat`."""
        self.load(flat)
        for p in self.params:
            p.grad = None
        tokens = loss_sum = consumed = 0.0
        for r in range(self.ranks):
            for _ in range(micro_batches):
                batch = next(self.train[r])
                loss, count = self.loss_fn.of_batch(self.model, batch)
                loss.backward()
                tokens += count.item()
                loss_sum += loss.item()
                consumed += batch["input_ids"].numel()
        grad = torch.cat([p.grad.reshape(-1) for p in self.params])
        return grad, tokens, loss_sum, consumed

    def adamw(self, g_sum: torch.Tensor, tokens: float, lr: float, commit: bool, clip: bool = True):
        """Opt(θ, G / N) with torch AdamW's formula. Returns the new θ; commits m, v, step and θ if asked."""
        c = self.cfg.optimizer
        g = g_sum / tokens
        norm = g.norm().item()
        max_norm = self.cfg.training.max_norm
        if clip and max_norm:
            g = g * min(1.0, max_norm / (norm + 1e-6))
        step = self.step + 1
        theta = self.theta * (1 - lr * c.weight_decay * self.decay)
        m = self.m * c.beta1 + (1 - c.beta1) * g
        v = self.v * c.beta2 + (1 - c.beta2) * g * g
        denom = (v.sqrt() / math.sqrt(1 - c.beta2**step)) + c.eps
        theta = theta - (lr / (1 - c.beta1**step)) * m / denom
        if commit:
            self.theta, self.m, self.v, self.step = theta, m, v, step
        return theta, norm

    def evaluate(self) -> float:
        self.load(self.theta)
        self.model.eval()
        total = count = 0.0
        with torch.no_grad():
            for r in range(self.ranks):
                for i, batch in enumerate(self.val[r]):
                    if i >= self.cfg.eval.batches:
                        break
                    loss, n = self.loss_fn.of_batch(self.model, batch)
                    total += loss.item()
                    count += n.item()
        self.model.train()
        return total / max(count, 1.0)


def run(args) -> list[dict]:
    cfg = load_config(recipe(args.updates, args.lr, args.seed, args.extra))
    torch.set_num_threads(args.threads)
    sim = Simulation(cfg)
    records, every, half = [], cfg.eval.every, sim.micro_batches // 2
    start = time.perf_counter()
    if args.schedule == ACCO:
        # θ̃_0 = θ_0; then per update t: ESTIMATE θ̃_{t+1} = Opt(θ_t, g̃_t) beside g_t at θ_t,
        # COMMIT θ_{t+1} = Opt(θ_t, g̃_t + g_t) beside g̃_{t+1} at θ̃_{t+1}.
        g_est, n_est, l_est, c_est = sim.gradients_at(sim.theta, half)
    for t in range(1, args.updates + 1):
        if args.schedule == DDP:
            g, n, loss_sum, consumed = sim.gradients_at(sim.theta, sim.micro_batches)
            lr = sim.schedule(sim.consumed, consumed)
            _, norm = sim.adamw(g, n, lr, commit=True)
            drift = None
        else:
            lr_est = sim.schedule(sim.consumed, 2 * c_est)
            theta_est, _ = sim.adamw(g_est, n_est, lr_est, commit=False)
            g, n, loss_sum, consumed = sim.gradients_at(sim.theta, half)
            g, n, loss_sum, consumed = g_est + g, n_est + n, l_est + loss_sum, c_est + consumed
            lr = sim.schedule(sim.consumed, consumed)
            old = sim.theta
            _, norm = sim.adamw(g, n, lr, commit=True)
            drift = ((theta_est - sim.theta).norm() / sim.theta.norm()).item()
            update = ((sim.theta - old).norm() / sim.theta.norm()).item()
            g_est, n_est, l_est, c_est = sim.gradients_at(theta_est, half)
        sim.consumed += consumed
        record = {"step": t, "tokens": int(sim.consumed), "loss": loss_sum / n, "lr": lr, "grad_norm": norm}
        if drift is not None:
            record |= {"drift": drift, "update": update}
        if t % every == 0 or t == args.updates:
            record["val_loss"] = sim.evaluate()
            print(f"step {t} loss {record['loss']:.4f} val {record['val_loss']:.4f} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)  # fmt: skip
        records.append(record)
    return records


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks acco-reference", description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", choices=[DDP, ACCO], required=True)
    parser.add_argument("--updates", type=int, default=640)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", required=True)
    parser.add_argument("extra", nargs="*", help="more trainer overrides (after --), e.g. --training.max_norm 0")
    args = parser.parse_args(argv)
    records = run(args)
    with open(args.out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


if __name__ == "__main__":  # the old form: one line naming `python -m benchmarks <command>`
    from benchmarks.cli import moved

    raise SystemExit(moved(__spec__.name))
