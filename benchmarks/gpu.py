"""GPU benchmarks: throughput and MFU per strategy, memory, and ACCO's overlap seen in a trace.

    python -m benchmarks gpu mfu [--quick] [--out bench_results]
    python -m benchmarks gpu overlap [--delay-ms 40] [--out bench_results]

`mfu`: each case in a process of its own, one GPU, random tokens (Llama 3 8B-shaped layers at seq 8192, GPT-Neo
125M); MFU counts 6·N + 12·layers·dim·seq FLOPs per token against the GPU's dense bf16 peak. `overlap`: ACCO traced,
with a benchmark-only GPU delay of --delay-ms in each communication job (a world of 1 has no peers); the share of the
job's kernel time that ran beside compute kernels. Writes gpu_mfu.{json,md}, gpu_overlap.{json,md,png}.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import IterableDataset

from benchmarks.common import ACCO, DDP, FSDP, ROOT, ZERO1, bare_parser, records, write_report
from torchacco.parallel.registry import strategy_class

LLAMA_8B = dict(model="llama3", flavor="8B", seq=8192)
NEO_125M = dict(model="gpt_neo", flavor="125M", seq=2048, batch=8, ac="none")
COMPILED = {True: "compiled", False: "eager"}


def llama_case(strategy=FSDP, layers=4, batch=1, compile=True, ac="none", chunks=8) -> dict:
    """Llama 3 8B's first `layers` layers; the name says how the case differs from the first."""
    name = f"8B×{layers} {strategy} {COMPILED[compile]}" + f", {ac} AC" * (ac != "none")
    name += f", batch {batch}" * (batch > 1) + ", unchunked loss" * (chunks == 1)
    settings = dict(layers=layers, strategy=strategy, batch=batch, compile=compile, ac=ac, chunks=chunks)
    return {**LLAMA_8B, "name": name, **settings}


def cases(quick: bool) -> list[dict]:
    """The measured configurations: name, model shape, strategy, batch, compile, AC, loss chunks."""
    llama = [llama_case(), llama_case(layers=8, batch=2, ac="selective"), llama_case(compile=False)]
    llama += [llama_case(layers=8, batch=2, compile=False, ac="selective"), llama_case(ZERO1), llama_case(ACCO)]
    llama += [llama_case(ac="selective"), llama_case(ac="full"), llama_case(chunks=1)]
    neo = [(s, c) for s in (ZERO1, ACCO, DDP, FSDP) for c in ((True, False) if s in (ZERO1, ACCO) else (False,))]
    neo = [{**NEO_125M, "name": f"125M {s} {COMPILED[c]}", "strategy": s, "compile": c, "chunks": 4} for s, c in neo]
    return [llama[0], *neo[-2:]] if quick else llama + neo


class RandomTokens(IterableDataset):
    def __init__(self, vocab: int, seq: int):
        self.vocab, self.seq = vocab, seq

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        while True:
            ids = torch.randint(0, self.vocab, (self.seq + 1,), generator=g)
            yield {"input_ids": ids[:-1], "labels": ids[1:]}


def run_case(case: dict, out: Path, steps: int) -> dict:
    """Train one case in this process; the mean of the logged steps after the first three."""
    from torchacco.config import Config
    from torchacco.spec import get_model_spec
    from torchacco.trainer import train

    spec = get_model_spec(case["model"])
    overrides = {"n_layers": case["layers"]} if "layers" in case else {}
    args = dataclasses.replace(spec.flavors[case["flavor"]], **overrides)
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device="cuda")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights()
    cfg = Config()
    cfg.model.name, cfg.model.flavor, cfg.model.compile = case["model"], case["flavor"], case["compile"]
    t = cfg.training
    t.seq_len, t.local_batch_size, t.steps = case["seq"], case["batch"], steps
    t.mixed_precision, t.device = "bf16", "cuda"
    t.global_batch_size = case["batch"] * strategy_class(case["strategy"]).traits.periods_per_update
    t.activation_checkpoint, t.loss_chunks = case["ac"], case.get("chunks", 1)
    cfg.parallelism.data_parallel = case["strategy"]
    cfg.eval.every = 0
    cfg.metrics.log_every, cfg.metrics.tensorboard, cfg.metrics.progress_bar = 1, False, False
    cfg.job.dump_folder, cfg.job.overwrite = str(out), True
    if case.get("profile"):
        cfg.profiling.enable, cfg.profiling.start_step, cfg.profiling.active_steps = True, 4, 2
    data = RandomTokens(args.vocab_size, case["seq"])
    train(cfg, model=model, datasets=(data, data))
    rows = records(out)
    mean = lambda key: sum(r.get(key, 0.0) for r in rows[3:]) / len(rows[3:])
    params = sum(p.numel() for p in model.parameters())
    return {**case, "params": params, "tokens_per_s": mean("tokens_per_s"), "mfu": mean("mfu"),
            "tflops": mean("tflops"), "peak_memory_gib": max(r["memory_gib"] for r in rows), "updates": len(rows),
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__}  # fmt: skip


def mfu(args) -> None:
    results, out = [], Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for case in cases(args.quick):
        start = time.perf_counter()
        argv = [sys.executable, "-m", "benchmarks.gpu", "case", case["name"], "--steps", str(args.steps)]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        failure = (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]
        result = json.loads(line.removeprefix("RESULT ")) if line else {**case, "error": failure}
        result["seconds"] = time.perf_counter() - start
        print(json.dumps(result), flush=True)
        results.append(result)
        (out / "gpu_mfu.json").write_text(json.dumps(results, indent=1))  # after each case: a cut run keeps them
        (out / "gpu_mfu.md").write_text(mfu_table(results))
    print(mfu_table(results))


def mfu_table(results: list[dict]) -> str:
    device = next((r["device"] for r in results if "device" in r), "?")
    lines = [f"One {device}, a world of 1, bf16, random tokens; measured {time.strftime('%Y-%m-%d')}.", "",
             "| case | params | seq × batch | tokens/s | tokens/s × layers | MFU | peak memory (GiB) |",
             "|---|---:|---|---:|---:|---:|---:|"]  # fmt: skip
    for r in results:
        if "error" in r:
            lines.append(f"| {r['name']} | | | failed: {r['error']} | | | |")
            continue
        layers = r.get("layers", "")
        per_layer = f"{r['tokens_per_s'] * layers:,.0f}" if layers else ""
        lines.append(f"| {r['name']} | {r['params'] / 1e9:.2f}B | {r['seq']} × {r['batch']} | "
                     f"{r['tokens_per_s']:,.0f} | {per_layer} | {r['mfu']:.1%} | "
                     f"{r['peak_memory_gib']:.1f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def _delay_jobs(delay_ms: float) -> None:
    """BENCHMARK ONLY: each sharded job first enqueues a GPU-side wait of `delay_ms` on its stream."""
    from torchacco.parallel.collectives import set_collective_hook

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    end.synchronize()
    cycles = int(1_000_000 * delay_ms / start.elapsed_time(end))

    def delay(name: str) -> None:  # once per job: before its reduce-scatter
        if name == "reduce_scatter":
            torch.cuda._sleep(cycles)

    set_collective_hook(delay)


def overlap_run(args) -> dict:
    """ACCO on one GPU with profiling and the job delay; the trace's overlap figures."""
    from benchmarks.trace import overlap, render_timeline

    _delay_jobs(args.delay_ms)
    case = {**NEO_125M, "name": "125M acco (traced)", "strategy": ACCO, "compile": False, "profile": True}
    folder = Path("/tmp/torchacco-gpu-bench/overlap")
    result = run_case(case, folder, args.steps)
    trace = sorted((folder / "profile/rank0").glob("trace_step*.json"))[-1]
    found = {**overlap(trace), "delay_ms": args.delay_ms, "tokens_per_s": result["tokens_per_s"],
             "device": result["device"], "torch": result["torch"], "date": time.strftime("%Y-%m-%d")}  # fmt: skip
    render_timeline(trace, Path(args.out) / "gpu_overlap.png", f"ACCO on one {result['device']}: kernels by stream")
    return found


def overlap_table(found: dict) -> str:
    return (
        f"ACCO, GPT-Neo 125M, seq 2048 × 8, bf16, one {found['device']} (a world of 1), {found['delay_ms']:g} ms "
        f"benchmark-only GPU delay in each job; measured {found['date']} from the profiler's trace of 2 updates.\n\n"
        "| job kernel time (ms) | of it while compute kernels ran (ms) | exposed (ms) | overlap | compute kernel "
        "time (ms) | job streams | compute streams |\n|---:|---:|---:|---:|---:|---|---|\n"
        f"| {found['job_kernel_ms']:.1f} | {found['job_hidden_ms']:.1f} | {found['job_exposed_ms']:.1f} | "
        f"{found['overlap']:.1%} | {found['compute_kernel_ms']:.1f} | {', '.join(found['job_streams'])} | "
        f"{', '.join(found['compute_streams'])} |\n"
    )


def main(argv=None) -> int:
    parser = bare_parser("gpu", __doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("mfu")
    p.add_argument("--out", default="bench_results")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--timeout", type=float, default=400)
    p.add_argument("--quick", action="store_true")
    p = sub.add_parser("case")
    p.add_argument("case", help="a case's name (cases() below)")
    p.add_argument("--steps", type=int, default=12)
    p = sub.add_parser("overlap")
    p.add_argument("--out", default="bench_results")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--delay-ms", type=float, default=40.0)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("torchacco: error: the GPU benchmarks need CUDA", file=sys.stderr)
        return 1
    if args.command == "mfu":
        mfu(args)
    elif args.command == "case":
        case = next((c for c in cases(quick=False) if c["name"] == args.case), None)
        if case is None:
            parser.error(f"no case named {args.case!r}")
        result = run_case(case, Path("/tmp/torchacco-gpu-bench") / case["name"].replace(" ", "_"), args.steps)
        print("RESULT " + json.dumps(result), flush=True)
    else:
        found = overlap_run(args)  # (its PNG is the trace's timeline, drawn beside)
        write_report(Path(args.out), "gpu_overlap", found, overlap_table(found))
    return 0


if __name__ == "__main__":  # `python -m benchmarks.gpu case ...`: mfu and gpu_check.py run each case so
    sys.exit(main())
