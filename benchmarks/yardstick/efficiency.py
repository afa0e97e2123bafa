"""The token-efficiency table `torchacco predict` reads: per measured variant, the tokens it needs for DDP's
final validation loss (same seed) as a multiple of DDP's.

    .venv/bin/python -m benchmarks efficiency-table --tokens diloco_budgets_lr3e-3 --tokens acco_budgets_lr3e-3

Reads <out>/<--tokens>.json (token-efficiency --budgets, one recipe in every file) and writes
torchacco/planning/token_efficiency.json. Files with distinct seeds pool; a variant no seed of which reached the target
is recorded as not reaching it; one with mixed or only bounded seeds is left out; a DiLoCo variant carries its outer
step.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import sys
from pathlib import Path

from benchmarks import common
from benchmarks.common import DDP, ROOT, mean_ci, recipe
from benchmarks.yardstick.table import token_ratios
from benchmarks.yardstick.tokens import RANKS, VARIANTS, variant_batch
from torchacco.config import load_config
from torchacco.planning.cost_model import NOT_THE_UPDATE, TOKEN_EFFICIENCY


def resolved(label: str, updates: int, lr: float, extra: list[str] = ()):
    """The trainer's config of a variant's run (seed 0; the seed changes nothing recorded here); `extra`: the
    overrides of the tuning grid point it was measured at."""
    return load_config([*recipe(updates, lr, 0), *VARIANTS[label], *extra])


def recipe_sentence(cfg, updates: int) -> str:
    t, o, s = cfg.training, cfg.optimizer, cfg.lr_schedule
    return (
        f"{cfg.model.name} {cfg.model.flavor}, {cfg.tokenizer.vocab_size:,}-token BPE vocabulary, seq {t.seq_len}, "
        f"{t.global_batch_size} sequences per update, 2 ranks, AdamW β {o.beta1:g}/{o.beta2:g}, wd "
        f"{o.weight_decay:g}, gradient clipping at {t.max_norm:g}, {s.warmup_steps / updates:.0%} warm-up + "
        f"{s.decay}, lr {o.lr:g}, {updates:,} updates"
    )


def diloco_settings(cfg, ranks: int) -> dict | None:
    """A DiLoCo run's replicas, inner strategy and outer step on `ranks` (None: one replica, no outer step)."""
    replicas = cfg.parallelism.replicas
    if replicas == 1:
        return None
    outer = {k: v for k, v in dataclasses.asdict(cfg.diloco).items() if k not in NOT_THE_UPDATE}
    # ranks_per_replica is recorded, not matched: DDP over G ranks computes the update of one rank with G× the
    # micro-batches, so what is matched is the inner strategy's update
    inner = {"inner": cfg.parallelism.data_parallel, "ranks_per_replica": ranks // replicas}
    return {"replicas": replicas, **inner, **outer}


LEFT_OUT: dict = {}  # a variant a file measures but the table cannot hold (in any file: left out of the table)


def entries(name: str, rows: dict, updates: int, lr: float, tuned: dict) -> dict[str, dict]:
    """One result file's measured variants as the table's entries (LEFT_OUT: said why on stderr); an entry keeps
    its per-seed ratios (`values`) until the files are pooled. `tuned`: each variant's chosen grid point, where the
    file tuned them (an entry then records its lr as a multiple of the recipe's, and its outer step is the point's)."""
    ratios, bounds = token_ratios(rows)
    out = {}

    def settings(label: str) -> dict:  # a DiLoCo variant's outer step, at the grid point it ran at
        if label not in VARIANTS:
            raise SystemExit(f"efficiency-table: {name} measures {label!r}, not a variant of token-efficiency")
        point = tuned.get(label, {"lr": lr, "extra": []})
        cfg = resolved(label, updates, lr, point["extra"])
        diloco, optimizer = diloco_settings(cfg, RANKS.get(label, 2)), cfg.optimizer.name
        return ({"diloco": diloco} if diloco else {}) | ({"optimizer": optimizer} if optimizer != "adamw" else {})

    for label in sorted(set(rows) - set(ratios)):
        row = rows[label]
        if row.get("budgets") and not any(r is not None for r in row.get("tokens_to_target_ratio", [])):
            out[label] = {"not_reached_within": max(int(n) for n in row["budgets"]) / updates,
                          "gap_pct": round(row["mean_gap_pct"], 2), "seeds": len(row["val_loss"]),
                          "source": f"bench_results/{name}.md", **settings(label)}  # fmt: skip
        else:
            print(f"[efficiency-table] {name}: {label} left out (a seed never reached DDP's loss)", file=sys.stderr)
            out[label] = LEFT_OUT
    for label, values in ratios.items():
        if label == DDP:
            continue
        if label in bounds:
            print(f"[efficiency-table] {name}: {label} left out (only a bound)", file=sys.stderr)
            out[label] = LEFT_OUT
            continue
        point = tuned.get(label, {"lr": lr, "extra": []})
        gaps = {"gaps": rows[label]["gap_pct"]} if "gap_pct" in rows[label] else {}  # loss at equal tokens, %
        at = {"lr_multiple": round(point["lr"] / lr, 4)} if not math.isclose(point["lr"], lr) else {}
        out[label] = {"values": values, **gaps, **at, "source": f"bench_results/{name}.md", **settings(label)}
    return out


def pooled(label: str, parts: list[tuple[str, list[int], dict]]) -> dict | None:
    """One variant's entry from the (name, seeds, entry) of the files that measure it: files with distinct seeds
    pool into one mean and 95% interval (a seed's runs are the same in any file); None where a file left it out."""
    if any(entry is LEFT_OUT for _, _, entry in parts):
        return None
    if len(parts) > 1:
        seen: dict[int, str] = {}
        for name, seeds, _ in parts:
            twice = sorted(set(seeds) & set(seen))
            if twice:
                raise SystemExit(f"efficiency-table: {label} is measured in {seen[twice[0]]} and {name} with seed "
                                 f"{twice[0]}; pool files with distinct seeds")  # fmt: skip
            seen |= dict.fromkeys(seeds, name)
        points = {json.dumps([entry.get("lr_multiple"), entry.get("diloco")]) for _, _, entry in parts}
        if len(points) > 1:
            names = " and ".join(name for name, _, _ in parts)
            raise SystemExit(f"efficiency-table: {label} ran at other settings in {names} (a tuned lr or outer step); "
                             "pool files of one setting")  # fmt: skip
        unreached = next((name for name, _, entry in parts if "values" not in entry), None)
        if unreached:
            raise SystemExit(f"efficiency-table: {label} in {unreached} never reached DDP's loss; only measured "
                             "ratios pool across files")  # fmt: skip
    first = parts[0][2]
    if "values" not in first:
        return dict(first)
    values = [v for _, _, part in parts for v in part["values"]]
    mean, half = mean_ci(values)
    entry = {k: v for k, v in first.items() if k not in ("values", "gaps")}  # the pooled ones replace them
    if all("gaps" in part for _, _, part in parts):
        entry["gap_pct"] = round(statistics.fmean(g for _, _, part in parts for g in part["gaps"]), 2)
    return {"mean": round(mean, 4), "ci95": round(half, 4) if math.isfinite(half) else None, "seeds": len(values),
            **entry, "source": " and ".join(part["source"] for _, _, part in parts)}  # fmt: skip


DEBUG_MODEL = "GPT-Neo debug"  # token_efficiency's meta["model"] for its default flavor


def read(out: Path, name: str, lr: str) -> tuple[dict, str, dict]:
    """A result file's meta, learning rate and rows (--lr, or its only one)."""
    try:
        data = json.loads((out / f"{name}.json").read_text())
        meta, summary = data["meta"], data["summary"]
    except (OSError, KeyError, json.JSONDecodeError) as e:
        raise SystemExit(f"efficiency-table: cannot read {out / name}.json: {e}") from None
    try:
        key = f"{float(lr):g}" if lr else (next(iter(summary)) if len(summary) == 1 else None)
    except ValueError:
        raise SystemExit(f"efficiency-table: --lr {lr!r} is not a number") from None
    if key not in summary:
        raise SystemExit(f"efficiency-table: {name} has learning rates {', '.join(summary)}; pick one with --lr")
    if meta.get("model", DEBUG_MODEL) != DEBUG_MODEL:  # the table's recipe is the debug model's
        raise SystemExit(f"efficiency-table: {name} measured {meta['model']}; the table holds {DEBUG_MODEL} runs")
    return meta, key, summary[key]


def table(out: Path, names: list[str], lr: str, command: str) -> dict:
    metas, parts, recipes = [], {}, set()
    for name in names:
        meta, key, rows = read(out, name, lr)
        recipes.add((meta["updates"], key))
        tuned = meta.get("tuned", {}).get(key, {})
        batches = {v: tuned.get(v, {}).get("batch", variant_batch(v) if v in VARIANTS else 16) for v in rows}
        off = next((v for v, b in batches.items() if b != 16), None)  # predict times every update at the recipe's
        if off:
            raise SystemExit(f"efficiency-table: {name} ran {off} at a batch of {batches[off]}; the table holds runs "
                             "at the recipe's 16 sequences: leave out --tune-batch and the _b8 variants")  # fmt: skip
        for label, entry in entries(name, rows, meta["updates"], float(key), tuned).items():
            parts.setdefault(label, []).append((name, meta.get("seeds", []), entry))
        metas.append(meta)
    if len(recipes) > 1:
        raise SystemExit(f"efficiency-table: the files differ in (updates, lr): {sorted(recipes)}; give one recipe")
    (updates, key), *_ = recipes
    return {
        "what": "tokens to DDP's final validation loss (same seed) as a multiple of DDP's: mean, 95% interval",
        "date": max(m["date"] for m in metas),
        "machine": "; ".join(dict.fromkeys(m["machine"] for m in metas)),
        "model": recipe_sentence(resolved(DDP, updates, float(key)), updates),
        "commands": [*(m["command"] for m in metas), command],
        "tokens_to_target": {
            label: entry for label, found in parts.items() if (entry := pooled(label, found)) is not None
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = common.bare_parser("efficiency-table", __doc__)
    parser.add_argument("--tokens", action="append", required=True, help="a token-efficiency result run with --budgets")
    parser.add_argument("--lr", default="", help="the learning rate to read (default: each file's only one)")
    parser.add_argument("--out", default="bench_results", help="where the result files are")
    parser.add_argument("--to", default=str(TOKEN_EFFICIENCY), help="the table to write")
    args = parser.parse_args(argv)
    result = table(ROOT / args.out, args.tokens, args.lr, common.command("efficiency-table", argv))
    Path(args.to).write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    print(json.dumps(result, indent=1, ensure_ascii=False))
    return 0
