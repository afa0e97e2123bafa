"""Speed on the emulated cluster: time per update of each strategy per setting, from short runs after warm-up.

    sudo .venv/bin/python -m benchmarks speed [--updates 110] [--repeats 2] [--settings a,b,c] [--rates 50mbit]

Settings (plans() below): a, b at the calibrated link rate and a third of it, c with four nodes one of them slow,
a2/b2 with 2 ranks per node, n8x4 with 32 (8 nodes of 4; virtual compute only), r<rate> per --rates. Each row also
holds every rank's peak RSS (--malloc-mmap: RSS follows live memory) and, with a slow node, its measured slowdown.
With --virtual-compute every strategy gets the same waits: one calibration per micro-batch shape, repeated until it
settles (or --virtual-calibration's), recorded in the table. Needs root and a quiet machine. Writes
<out>/<--name>.{json,md,png}.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
from pathlib import Path

from benchmarks import common
from benchmarks.cluster import Cluster, ClusterPlan, parse_rate, run_training
from benchmarks.cluster.launch import settled_calibration
from benchmarks.cluster.plan import ClusterError, add_node_options, node_options
from benchmarks.common import ACCO, DDP, FSDP, HSDP, QUIET, ROOT, TOKENS_PER_UPDATE, ZERO1, recipe, update_s
from benchmarks.yardstick.tokens import VARIANTS

BASELINES = (DDP, ZERO1, FSDP, HSDP)
STREAMING = "streaming_h10_avg"  # Streaming DiLoCo in bf16, the base of the variants below
SPARSE = "streaming_h10_avg_topk1_int2"  # the same, sending 1% of each chunk in 2 bits averaged over all replicas
RECOMMENDED = "streaming_h10_avg_topk3_int2_senders"  # docs/diloco.md's: 3% over the senders, the soonest in a and b
STRATEGIES = {  # every registered strategy's variants (balanced batches among them), then the yardstick's own
    **common.strategy_variants(),
    **{name: VARIANTS[name] for name in ("diloco_h10", "diloco_h50", "streaming_h50", "diloco_h10_avg", STREAMING)},
    # 8 sequences an update: twice the syncs per token; Muon inside: Newton–Schulz's time per update beside AdamW's
    **{n: VARIANTS[n] for n in ("ddp_b8", "zero1_b8", *(f"{v}_muon" for v in (DDP, ZERO1, ACCO, RECOMMENDED)))},
    # Streaming DiLoCo across nodes with ZeRO-1 or ACCO over each node's ranks (settings a2, b2)
    **{f"{STREAMING}_{inner}": [*VARIANTS[STREAMING], "--parallelism.data_parallel", inner] for inner in (ZERO1, ACCO)},
    # mixed replicas: a replica runs as many of a period's H inner updates as fit in the fastest one's time
    **{
        f"{v}_balanced": [*VARIANTS[v], "--diloco.balance_replicas", "true"]
        for v in ("diloco_h50", "diloco_h10_avg", STREAMING, SPARSE, RECOMMENDED)
    },
    **{name: VARIANTS[name] for name in (SPARSE, f"{SPARSE}_senders", RECOMMENDED)},
    # every gradient bucket 25 MiB (a set cap): this model's gradients in one bucket, all-reduced after the backward
    f"{DDP}_one_bucket": ["--parallelism.data_parallel", DDP, "--parallelism.bucket_cap_mb", "25"],
}
_ONE = [DDP, ZERO1, FSDP, ACCO, "diloco_h10_avg", STREAMING, RECOMMENDED]
_TWO = [DDP, ZERO1, HSDP, ACCO, STREAMING, f"{STREAMING}_{ZERO1}", f"{STREAMING}_{ACCO}"]
PER_SETTING = {  # the strategies each setting runs by default
    "a": _ONE, "b": _ONE, "a2": _TWO, "b2": _TWO,
    "c": [DDP, f"{DDP}_balanced", ZERO1, f"{ZERO1}_balanced", ACCO, f"{ACCO}_balanced", "diloco_h50",
          "diloco_h50_balanced"],
    "e": [*_ONE, SPARSE, f"{SPARSE}_senders"],
    "bm": [DDP, f"{DDP}_balanced", f"{ZERO1}_balanced", "diloco_h10_avg_balanced", f"{STREAMING}_balanced",
           f"{RECOMMENDED}_balanced"],
    "n8x4": [DDP, ZERO1, ACCO],
}  # fmt: skip
WARMUP = 10  # updates left out of the timing
CALIBRATION_HELP = "the file under --out whose 'calibration' sets the link rates of settings a and b (without .json)"
MMAP = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}  # freed buffers over 64 KiB go back at once


def persistent_mib(train: list[str], world: int, params: float, ranks_per_node: int = 1) -> float:
    """A rank's persistent memory (fp32) in the run `train` starts on `world` ranks, as predict counts it."""
    import torch

    from torchacco.config import load_config
    from torchacco.parallel.hsdp import shard_degree
    from torchacco.parallel.registry import strategy_class
    from torchacco.planning.cost_model import layout_memory

    cfg = load_config(train)
    replicas = cfg.parallelism.replicas
    outer = cfg.diloco if replicas > 1 else None
    cls = strategy_class(cfg.parallelism.data_parallel)
    options = cfg.options(cls.traits.options)
    group = world // replicas
    if cls.traits.shards_within_node:
        group = shard_degree(options, group, ranks_per_node, 1, 1)
    return layout_memory(cls, params, group, torch.float32, torch.float32, options, outer).total / 2**20


def seconds_per_token(records: list[dict], warmup: int = WARMUP) -> float:
    return sum(map(update_s, records[warmup:])) / sum(r["tokens_per_update"] for r in records[warmup:])


def seconds_per_update(records: list[dict], warmup: int = WARMUP) -> float:
    return sum(map(update_s, records[warmup:])) / len(records[warmup:])


def compute_s(record: dict) -> float:
    """A logged update's seconds before its sync: data, forward and backward (`share_sync` is the rest)."""
    return update_s(record) * (1 - record["share_sync"])


def warmup_of(name: str) -> int:
    """The updates left out of a label's timing: DiLoCo's first period too (mixed replicas run it unmeasured)."""
    return WARMUP + 50 if name.startswith(("diloco", "streaming")) else WARMUP


def kept_run(plan: ClusterPlan, args: list[str], folder: Path, name: str, resume: bool, run):
    """`run()`'s result, kept in folder/name; with `resume`, a kept one of the same arguments on the same plan."""
    shape = {k: v for k, v in dataclasses.asdict(plan).items() if k not in ("prefix", "subnet")}  # names, per call
    kept, key = folder / name, json.dumps({"args": args, "plan": shape}, sort_keys=True)
    if resume and kept.exists():
        saved = json.loads(kept.read_text())
        if saved.pop("key", None) == key:
            return saved["result"]
    result = run()
    folder.mkdir(parents=True, exist_ok=True)
    kept.write_text(json.dumps({"key": key, "result": result}))
    return result


def timed_run(plan: ClusterPlan, train: list[str], folder: Path, resume: bool, env: dict | None = None,
              virtual_compute: bool = False, virtual_scale: float = 1.0,
              calibration: dict | None = None) -> dict:  # fmt: skip
    """One speed run's records and per-rank reports (with `resume`: a finished run's with the same arguments and, under
    virtual compute, the same calibrated waits)."""
    key = [*train, *["--virtual-compute", f"{virtual_scale:g}", json.dumps(calibration)] * virtual_compute]
    waits = {"calibration": calibration} if virtual_compute else {}
    return kept_run(plan, key, folder, "speed_run.json", resume,
                    lambda: run_training(plan, train, folder, env=env, virtual_compute=virtual_compute,
                                         virtual_scale=virtual_scale, **waits))  # fmt: skip


SHAPE = ("--config", "--model.name", "--model.flavor", "--tokenizer.vocab_size", "--training.local_batch_size",
         "--training.seq_len", "--training.mixed_precision", "--training.activation_checkpoint",
         "--model.compile")  # fmt: skip


def micro_batch_shape(train: list[str]) -> str:
    """What virtual compute's waits depend on in a run's arguments (the last of each flag wins, as the trainer's)."""
    values = {flag: value for flag, value in zip(train, train[1:]) if flag in SHAPE}
    return " ".join(f"{flag.removeprefix('--')}={values[flag]}" for flag in SHAPE if flag in values)


def table_calibration(path: Path, saved: Path | None):
    """The waits of each micro-batch shape for one table (shape -> calibration): `saved`'s where it has that shape,
    else measured once on a quiet machine; each new one written to `path` at once (a later --resume reuses it)."""
    waits = json.loads(saved.read_text())["virtual_calibration"] if saved else {}

    def of(train: list[str]) -> dict:
        shape = micro_batch_shape(train)
        if shape not in waits:
            waits[shape] = settled_calibration(train)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"virtual_calibration": waits}, indent=1))
        return waits[shape]

    return of, waits


def plans(out: Path, calibration: str = "time_to_loss", rates: str = "",
          rate_nodes: int = 2) -> dict[str, tuple[ClusterPlan, list[str]]]:  # fmt: skip
    """Setting -> (its cluster, the trainer arguments it adds); a and b's link rates follow the calibration's
    balance rate (ZeRO-1's job as long as its compute), measured by `time-to-target`."""
    path = out / f"{calibration}.json"
    try:
        balance = json.loads(path.read_text())["calibration"]["balance_bps"]
    except (OSError, ValueError, KeyError, TypeError):
        raise ClusterError(f"no calibration in {path}: run `python -m benchmarks time-to-target` "
                           "first, which measures it") from None  # fmt: skip
    two = ["--training.local_batch_size", "2"]  # so that ACCO's two periods fit 16 sequences on 4 ranks
    return {
        "a": (ClusterPlan(nodes=2, rate_bps=balance), []), "b": (ClusterPlan(nodes=2, rate_bps=balance / 3), []),
        "e": (ClusterPlan(nodes=2, rate_bps=balance / 30), []),  # a tenth of b's: an internet link between sites
        # b's link with node 1 at a third of node 0's core: mixed and slow at once
        "bm": (ClusterPlan(nodes=2, rate_bps=balance / 3, slow_node=1, slow_factor=3.0, cpu_per_node=1.0), []),
        # micro-batches of one sequence; 8 evaluation batches per rank read the recipe's 32 validation windows
        "c": (ClusterPlan(nodes=4, rate_bps=1e9, slow_node=3, slow_factor=4.0, cpu_per_node=0.45),
              ["--training.local_batch_size", "1", "--eval.batches", "8"]),
        # the inner strategy's traffic stays on the node, the outer sync crosses the shaped link
        "a2": (ClusterPlan(nodes=2, ranks_per_node=2, rate_bps=balance), two),
        "b2": (ClusterPlan(nodes=2, ranks_per_node=2, rate_bps=balance / 3), two),
        **{f"r{r}": (ClusterPlan(nodes=rate_nodes, rate_bps=parse_rate(r)), []) for r in rates.split(",") if r},
        # 32 ranks (for --virtual-compute): 8 nodes of 4 on a 100 Mbit/s link, 64 sequences of 1 per update
        "n8x4": (ClusterPlan(nodes=8, ranks_per_node=4, rate_bps=1e8),
                 ["--training.local_batch_size", "1", "--training.global_batch_size", "64"]),
    }  # fmt: skip


def slowdown(plan: ClusterPlan, folder: Path, seconds: float = 2.0) -> float:
    """The slow node's measured slowdown (a quota alone is not exact on a shared machine): busy loops in every node
    at once, the others' mean rate over the slow one's."""
    folder.mkdir(parents=True, exist_ok=True)
    logs = [folder / f"spin{i}.txt" for i in range(plan.nodes)]
    busy = f"import time\nt=time.perf_counter(); n=0\nwhile time.perf_counter()-t<{seconds}: n+=1\nprint(n)"
    spin = [sys.executable, "-c", busy]
    with Cluster(plan) as cluster:
        for p in [cluster.launch(i, spin, log=logs[i]) for i in range(plan.nodes)]:  # all started, then waited for
            p.wait()
    rates = [float(log.read_text().split()[-1]) for log in logs]
    return statistics.fmean(r for i, r in enumerate(rates) if i != plan.slow_node) / rates[plan.slow_node]


def loss_gaps(out: Path) -> dict[str, tuple[float, str]]:
    """Variant -> (loss gap to DDP %, lr) from the token-efficiency tables of 1,000 updates and 5 seeds of the debug
    model under `out`: at DDP's best lr (3e-3) where measured, else at 1.5e-3."""
    gaps = {}
    for lr in ("0.0015", "0.003"):
        for table in sorted(out.glob("*token_efficiency*.json")) + sorted(out.glob("diloco_budgets*.json")):
            data = json.loads(table.read_text())
            meta = data.get("meta", {})
            short = meta.get("updates", 0) < 1000 or len(meta.get("seeds", [])) < 5  # shorter runs, screens
            if short or meta.get("model", "GPT-Neo debug") != "GPT-Neo debug":
                continue
            rows = data.get("summary", {}).get(lr, {})
            gaps |= {name: (row["mean_gap_pct"], lr) for name, row in rows.items() if "mean_gap_pct" in row}
    return gaps


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    out, plan_of, params, settings, names = _checked(parser, args)
    gaps, results, env = loss_gaps(out), {}, MMAP if args.malloc_mmap else None
    kept = out / f"{args.name}_virtual_calibration.json"
    saved = out / f"{args.virtual_calibration}.json" if args.virtual_calibration else kept
    reuse = args.virtual_calibration or args.resume and kept.exists()
    try:
        waits_of, waits = table_calibration(kept, saved if reuse else None)
    except (OSError, ValueError, KeyError) as e:
        parser.error(f"--virtual-calibration: cannot read {saved}'s 'virtual_calibration': {e}")
    for setting in settings:
        plan, extra = plan_of[setting]
        rows = results[setting] = {"plan": plan.describe(), "strategies": {}}
        if plan.slow_node is not None:
            rows["measured_slowdown"] = slowdown(plan, out / "runs" / "speed" / f"{setting}_slowdown")
        for name in names(setting):
            rows["strategies"][name] = _timed_strategy(args, out, setting, name, (plan, extra), params, waits_of, env)
        _rank(rows, gaps)
    meta = common.meta("speed", argv, virtual_compute=args.virtual_compute, virtual_scale=args.virtual_scale,
                       rates=args.rates, rate_nodes=args.rate_nodes, node_rate=args.node_rate,
                       train_args=args.train_args)  # fmt: skip
    bars = {common.panel_title(s, rows["plan"]): [(common.plain_name(n), r["speedup_vs_best_baseline"], 0)
                                                   for n, r in rows["strategies"].items()]
            for s, rows in results.items()}  # fmt: skip
    data = {"meta": meta, "settings": results, **({"virtual_calibration": waits} if waits else {})}
    common.write_report(out, args.name, data, markdown(results, meta),
                        lambda path: common.bars(path, bars, "updates per second vs the best baseline"))  # fmt: skip
    return 0


def _parser():
    parser = common.parser("speed", __doc__, "speed")
    parser.add_argument("--updates", type=int, default=110)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--settings", default="a,b")
    parser.add_argument("--rates", default="", help="link rates (e.g. 50mbit,1gbit) of 2-node settings r<rate>")
    parser.add_argument("--rate-nodes", type=int, default=2, help="nodes of the r<rate> settings")
    add_node_options(parser)
    parser.add_argument("--strategies", default="", help=f"from {', '.join(STRATEGIES)}; default: per setting")
    parser.add_argument("--train-args", default="", help="more trainer arguments for every run, e.g. "
                        "'--training.mixed_precision bf16'")  # fmt: skip
    parser.add_argument("--virtual-compute", choices=("off", "on", "both"), default="off", help="on: forward, "
                        "backward and AdamW as calibrated waits that hold no CPU, as on GPUs (torchacco/emulation.py); "
                        "both: each run also so, side by side (its validation)")  # fmt: skip
    scale_help = "with --virtual-compute: every wait this many times its calibrated length (more compute per byte)"
    parser.add_argument("--virtual-scale", type=float, default=1.0, help=scale_help)
    parser.add_argument("--memory-budget-mib", type=float, default=0, help="a rank's memory for the model's state: "
                        "a strategy whose persistent memory exceeds it does not fit and is not a baseline (0: no "
                        "budget)")  # fmt: skip
    parser.add_argument("--malloc-mmap", action="store_true", help="RSS follows live memory (glibc mmap threshold)")
    parser.add_argument("--resume", action="store_true", help="keep the runs a previous call finished with the same "
                        "arguments on the same cluster plan; run the rest")  # fmt: skip
    parser.add_argument("--calibration", default="time_to_loss", help=CALIBRATION_HELP)
    parser.add_argument("--virtual-calibration", default="", help="a file under --out (without .json) whose "
                        "'virtual_calibration' (a speed table's) gives virtual compute's waits per micro-batch shape; "
                        "default: measured once per shape on a quiet machine, saved to <name>_virtual_calibration "
                        "(which --resume reuses)")  # fmt: skip
    return parser


def _checked(parser, args):
    """The arguments checked: (out, each setting's (plan, trainer arguments), the calibration's parameters, the
    settings, each setting's strategies)."""
    if args.virtual_scale <= 0:
        parser.error(f"--virtual-scale must be positive, got {args.virtual_scale:g}")
    if args.memory_budget_mib < 0:
        parser.error(f"--memory-budget-mib must be positive (0: no budget), got {args.memory_budget_mib:g}")
    if args.rate_nodes < 2:
        parser.error(f"--rate-nodes must be at least 2 (the nodes a link joins), got {args.rate_nodes}")
    out = ROOT / args.out
    try:
        plan_of = plans(out, args.calibration, args.rates, args.rate_nodes)
        params = json.loads((out / f"{args.calibration}.json").read_text())["calibration"].get("params")
    except ClusterError as e:
        parser.error(str(e))
    names = lambda setting: args.strategies.split(",") if args.strategies else PER_SETTING.get(setting, [])
    settings = [s for s in args.settings.split(",") if s] + [f"r{r}" for r in args.rates.split(",") if r]
    for setting in settings:
        if setting not in plan_of:
            parser.error(f"--settings: unknown setting {setting!r}; one of {', '.join(plan_of)}")
        if setting == "n8x4" and args.virtual_compute != "on":
            parser.error("setting n8x4 needs --virtual-compute on: 32 ranks computing on this machine's cores time "
                         "the CPU, not the links")  # fmt: skip
        plan, extra = plan_of[setting]
        try:
            plan_of[setting] = dataclasses.replace(plan, **node_options(args)), extra
        except ClusterError as e:
            parser.error(f"setting {setting}: {e}")
        for name in names(setting):
            if name not in STRATEGIES:
                parser.error(f"--strategies: unknown strategy {name!r}; one of {', '.join(STRATEGIES)}")
            if args.updates <= warmup_of(name):
                parser.error(f"--updates {args.updates} leaves no timed update for {name} (its first "
                             f"{warmup_of(name)} are warm-up); use at least {warmup_of(name) + 1}")  # fmt: skip
        if not names(setting):
            parser.error(f"--settings {setting}: give its --strategies")
    return out, plan_of, params, settings, names


def _timed_strategy(args, out: Path, setting: str, name: str, planned, params, waits_of, env) -> dict:
    """One strategy's row in a setting: its --repeats timed runs (and their virtual-compute twins)."""
    plan, extra = planned
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.virtual_compute]
    times, token_times, rss, virtual_times, calibration = [], [], [], [], None
    for repeat, virtual in ((r, v) for r in range(args.repeats) for v in modes):
        train = [*recipe(args.updates, 1.5e-3, repeat), *QUIET, *STRATEGIES[name], "--eval.every", "0"]
        train += ["--training.max_tokens", "0", "--training.steps", str(args.updates), *extra]
        if "--diloco.balance_replicas" in STRATEGIES[name]:  # its clock is in tokens: the recipe's
            train += ["--training.max_tokens", str(args.updates * TOKENS_PER_UPDATE)]
        train += args.train_args.split()
        folder = out / "runs" / "speed" / f"{setting}_{name}_{repeat}{'_virtual' * virtual}"
        waits_now = waits_of(train) if virtual else None  # one calibration per shape: the same waits for all
        run = timed_run(plan, train, folder, args.resume, env, virtual, args.virtual_scale, waits_now)
        warmup = warmup_of(name)
        if virtual and len(modes) == 2:  # the side-by-side check: kept apart from the real runs' figures
            virtual_times.append(seconds_per_token(run["records"], warmup) * TOKENS_PER_UPDATE)
            print(f"[speed] {setting} {name} #{repeat} virtual: {virtual_times[-1]:.4f} s", flush=True)
            continue
        calibration = run.get("calibration")  # virtual compute's waits (cost-model-check predicts from them)
        times.append(seconds_per_update(run["records"], warmup))
        token_times.append(seconds_per_token(run["records"], warmup) * TOKENS_PER_UPDATE)
        rss.append([round(r["peak_rss_gib"], 4) for r in run.get("ranks", [])])
        print(f"[speed] {setting} {name} #{repeat}: {times[-1]:.4f} s per update", flush=True)
    # "mean": seconds per recipe update's tokens (16 × 128), the time per update of all but mixed replicas
    mib = persistent_mib(train, plan.world_size, params, plan.ranks_per_node) if params else None
    fits = not (args.memory_budget_mib and mib) or mib <= args.memory_budget_mib
    row = {"seconds_per_update": times, "seconds_per_recipe_update": token_times,
           "mean": statistics.fmean(token_times), "peak_rss_gib_per_rank": rss,
           **({"calibration": calibration} if calibration else {}), "persistent_mib": mib, "fits": fits}  # fmt: skip
    if virtual_times:
        virtual_vs_real = statistics.fmean(virtual_times) / statistics.fmean(token_times)
        row |= {"virtual_seconds": virtual_times, "virtual_vs_real": virtual_vs_real}
    return row


def _rank(rows: dict, gaps: dict) -> None:
    """Each strategy's speed-up over the setting's best synchronous baseline that fits (and over its unbalanced
    self), and its loss gap."""
    ran = rows["strategies"]
    synchronous = [n for n in ran if n.removesuffix("_balanced") in BASELINES and ran[n]["fits"]] or list(ran)
    best = rows["best_baseline"] = min(synchronous, key=lambda n: ran[n]["mean"])
    for name, row in ran.items():
        row["speedup_vs_best_baseline"] = ran[best]["mean"] / row["mean"]
        plain = name.removesuffix("_balanced")
        row["speedup_vs_unbalanced"] = ran[plain]["mean"] / row["mean"] if plain != name and plain in ran else None
        # Balanced batches do not change the update; mixed replicas do (its gap is not measured yet)
        row["gap_pct"] = gaps.get(name if name.startswith("diloco") else plain)


def markdown(results: dict, meta: dict) -> str:
    lines = ["# Speed on the emulated cluster: time per update, and the loss at equal tokens", "",
             f"{meta['date']}, {meta['machine']}; network namespaces, `tc tbf`, CPU quotas; one rank per node unless "
             "the setting says more." + (" Virtual compute: forward, backward and AdamW are calibrated waits "
                                         "(torchacco/emulation.py)." if meta.get("virtual_compute") == "on" else ""),
             f"Command: `{meta['command']}`. Loss gaps at equal tokens: `bench_results/*token_efficiency*.md` "
             "(loopback, 1,000 updates, 5 seeds, paired with DDP at the lr named, 3e-3 where measured (DDP's best), "
             "else 1.5e-3; a balanced variant computes its strategy's update).", ""]  # fmt: skip
    for setting, rows in results.items():
        slow = f" Slow node measured {rows['measured_slowdown']:.2f}× slower." if "measured_slowdown" in rows else ""
        lines += [f"## Setting {setting}: {rows['plan']}", "",
                  f"Best synchronous baseline (balanced ones included): {rows['best_baseline']}.{slow}", "",
                  "| strategy | s per update's tokens (repeats) | speed vs best baseline | vs its unbalanced self "
                  "| val loss vs ddp at equal tokens (%) | peak RSS per rank (MiB) |",
                  "|---|---|---:|---:|---:|---|"]  # fmt: skip
        for key, head in (("persistent_mib", " state per rank (MiB) |"), ("virtual_vs_real", " virtual / real |")):
            if any(row.get(key) for row in rows["strategies"].values()):
                lines[-2], lines[-1] = lines[-2] + head, lines[-1] + "---:|"
        for name, row in rows["strategies"].items():
            each = ", ".join(f"{t:.4f}" for t in row.get("seconds_per_recipe_update", row["seconds_per_update"]))
            gap = "—" if row["gap_pct"] is None else f"{row['gap_pct'][0]:+.2f} (lr {float(row['gap_pct'][1]):g})"
            self_ = "" if row["speedup_vs_unbalanced"] is None else f"{row['speedup_vs_unbalanced']:.2f}×"
            rss = ", ".join(f"{x * 1024:.0f}" for x in max(row.get("peak_rss_gib_per_rank", []), default=[]))
            mib = row.get("persistent_mib")
            virtual = f" {mib:.2f}{'' if row['fits'] else ' (does not fit)'} |" if mib else ""
            virtual += f" {row['virtual_vs_real']:.3f} |" if "virtual_vs_real" in row else ""
            lines.append(f"| {name} | {row['mean']:.4f} ({each}) | {row['speedup_vs_best_baseline']:.2f}× | {self_} | "
                         f"{gap} | {rss} |{virtual}")  # fmt: skip
        lines.append("")
    return "\n".join(lines)
