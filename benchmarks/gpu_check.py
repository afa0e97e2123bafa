"""`python -m benchmarks gpu-check`: the CUDA paths checked in one short GPU lease (about 13 minutes).

Six steps (STEPS; --dry-run prints them and checks, without a GPU, that every command would start), each a process
group with its own time limit (a hang costs that step's limit, not the lease); the JSON summary
(bench_results/gpu_check_<date>.json) is rewritten after each step. Where a command may run only 10 minutes, run it
as two: `--steps env,cuda-tests,parity`, then `--steps env,throughput,stall,torchtitan`. The env step installs the
wheels in --wheels (benchmarks/gpu_wheels.sh) offline; throughput compares against bench_results/gpu_{mfu,overlap}.json;
torchtitan runs the same case in torchtitan 0.2.2 (carried: 0.3.0 does not import with torch 2.11). A step whose
needs are absent (no GPU, no torchtitan, a torch torchtitan does not import with) is "skipped: <reason>".
`--nproc 8` runs the multi-GPU steps instead (MULTI; on 2 nodes, each node with `--nnodes 2 --node-rank R
--master-addr HOST`), every command checked by --dry-run as the launcher checks it for its world size."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import platform
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from benchmarks.common import DDP, FSDP, bare_parser, records, trainers
from torchacco.errors import error_line

ROOT = Path(__file__).resolve().parents[1]
BF16_REL = 0.01  # the relative loss gap allowed between bf16 runs on two devices (CPU bf16 vs fp32: 4e-4)
KEPT = 0.95  # a throughput figure passes at 95% of its 2026-11-22 value (run-to-run spread is a few %)
CASE = "8B×8 fsdp compiled, selective AC, batch 2"  # benchmarks/gpu.py's case that throughput and torchtitan run
TITAN = "0.2.2"  # the torchtitan that benchmarks/gpu_wheels.sh carries
# the modules it needs beyond torchacco's (its MoE kernels import triton, which a CUDA torch brings; datasets imports
# httpx); importing torchtitan.train shows that it imports with this torch
TITAN_NEEDS = ("torchtitan", "torchdata", "datasets", "tyro", "einops", "triton", "httpx")
# a worker's error line, behind the launcher's `[rankN]: `
ERROR = re.compile(r"^(?:\[rank\d+\]: )?(torchacco: error: .*)$", re.M)
NEEDS = ("torch", "torchdata", "tokenizers", "safetensors", "tensorboard", "torchacco.models", "pytest")


@dataclasses.dataclass
class Step:
    name: str
    limit_s: float
    what: str
    child: list[str] | None = None  # the step's process; None: this module's `_step NAME`


# Limits from the H100 run of 2026-11-27 (bench_results/gpu_check_2026-11-27.json) plus some room
STEPS = [
    Step("env", 25, "carried wheels and torchacco installed offline; torch +cu, GPU name, NCCL version"),
    Step("cuda-tests", 330, "the suite's CUDA tests, -x"),
    Step("parity", 110, "acco/zero1/fsdp, CUDA vs CPU, bf16, one safetensors export; resume from a CUDA checkpoint"),
    Step("throughput", 90, "8B×8 compiled MFU and ACCO's overlap against 2026-11-22"),
    Step("stall", 70, "a stalled collective: the one-line diagnosis and flight_recorder/"),
    Step("torchtitan", 115, f"torchtitan {TITAN} on the 8B×8 case: tokens/s and peak memory ratios"),
]


# --nproc N (N ≥ 2, a multiple of 4): the multi-GPU paths, in this order; --nnodes 2 runs it on 2 nodes, each node
# with its --node-rank (node 0 checks the results; torchft-nccl is one node's)
MULTI = [
    STEPS[0],
    Step("parity", 540, "ddp, zero1, fsdp, acco at dp = N, compiled and eager; zero1, fsdp, acco with Muon; vs CPU"),
    Step("acco-tp-pp", 240, "acco on llama3 debug at tp 2 × dp N/2 and tp 2 × pp 2 × dp N/4, 50 updates each"),
    Step("diloco-fsdp", 150, "DiLoCo, 2 replicas × fsdp N/2, τ = 1, 12 updates: outer steps, a falling loss"),
    Step("memory-8b", 300, "llama3 8B fsdp, 3 updates: rank 0's peak allocated and a memory snapshot vs the dry run"),
    Step("async-save-resume", 150, "acco, an async save at step 3, steps 4-6 resumed bit for bit; host RSS vs staged"),
    Step("hung-collective", 240, "a rank SIGSTOPped under acco, then zero1: the one-line diagnosis, flight_recorder/"),
    Step("torchft-nccl", 180, "fault-tolerant DiLoCo on NCCL, 2 replicas; replica 1 SIGKILLed mid-exchange"),
]


def debug_run(ctx) -> list[str]:
    """6 updates of the GPT-Neo debug model on a generated corpus, as the suite's tiny runs."""
    return ["--data.dataset", str(ctx.work / "corpus"), "--data.cache_dir", str(ctx.work / "cache"),
            "--tokenizer.vocab_size", "400", "--model.flavor", "debug", "--training.seq_len", "64",
            "--training.local_batch_size", "4", "--training.global_batch_size", "8", "--training.steps", "6",
            "--metrics.log_every", "1", "--metrics.tensorboard", "false", "--metrics.progress_bar", "false",
            "--eval.every", "0"]  # fmt: skip


def train(ctx, out: str, *extra: str, device: str = "cuda") -> list[str]:
    folder = ["--job.dump_folder", str(ctx.work / out), "--training.device", device]
    return [str(ROOT / "run_train.sh"), *folder, *debug_run(ctx), *extra]


CPU = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "4"}
SAVE = ("--checkpoint.enable", "true", "--checkpoint.every", "3", "--checkpoint.keep", "0")


def compared() -> tuple[str, str, str]:
    """ACCO's, ZeRO-1's and FSDP's names, asked of their classes when a plan is made."""
    from torchacco.parallel.acco import ACCO
    from torchacco.parallel.fsdp import FSDP
    from torchacco.parallel.zero1 import ZeRO1

    return ACCO.name, ZeRO1.name, FSDP.name


BF16 = ("--training.mixed_precision", "bf16")  # auto would be fp32 on the CPU
PROBE = (
    "import importlib.util as u, json, torch; c = torch.cuda.is_available(); print(json.dumps({"
    "'torch': torch.__version__, 'cuda_build': torch.version.cuda, 'gpu': torch.cuda.get_device_name() if c else None, "
    "'nccl': '.'.join(map(str, torch.cuda.nccl.version())) if c else None, "
    f"'missing': [m for m in {NEEDS!r} if u.find_spec(m) is None]}}))"
)


def plan(name: str, ctx) -> list[tuple[str, list[str], dict]]:
    """A step's commands: (label, argv, extra environment). The dry run prints and checks them."""
    py, init = sys.executable, ("--model.init_from", str(ctx.work / "start" / "hf"), *BF16)
    acco = ("--parallelism.data_parallel", compared()[0])
    if getattr(ctx, "nproc", 1) > 1 and name != "env":
        return multi_plan(name, ctx, py, init)
    if name == "env":
        pip = [py, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
        wheels = sorted(str(w) for w in Path(ctx.wheels).glob("*.whl"))
        carried = [("wheels", [*pip, "--no-compile", "--upgrade", "--target", str(ctx.work / "site"), *wheels], {})]
        return carried * bool(wheels) + [
            ("install", [*pip, "--no-build-isolation", "-e", str(ROOT)], {}),
            ("probe", [py, "-c", PROBE], {}),
        ]
    if name == "cuda-tests":  # the test files that skip without CUDA
        tests = (p for p in (ROOT / "tests").glob("test_*.py") if "not HAS_CUDA" in p.read_text())
        files = sorted(str(p.relative_to(ROOT)) for p in tests)
        return [("pytest", [py, "-m", "pytest", "-x", "-q", "-m", "not faults", *files], {})]
    if name == "parity":
        start = train(ctx, "start", *acco, "--training.steps", "1", "--checkpoint.export_hf", "true")
        runs = [
            (f"{k}_{d}", train(ctx, f"{k}_{d}", "--parallelism.data_parallel", k, *init,
                               *SAVE * (k == acco[1] and d == "cuda"), device=d), CPU if d == "cpu" else {})
            for k in compared() for d in ("cuda", "cpu")
        ]  # fmt: skip
        step3 = str(ctx.work / "acco_cuda" / "checkpoint" / "step-00000003")
        resumed = train(ctx, "acco_resumed", *acco, *init, *SAVE, "--checkpoint.load_path", step3)
        return [("start", start, {}), *runs, ("resumed", resumed, {})]
    if name == "throughput":
        gpu = [py, "-m", "benchmarks.gpu"]
        return [
            ("mfu", [*gpu, "case", CASE, "--steps", "12"], {}),
            ("overlap", [*gpu, "overlap", "--steps", "8", "--out", str(ctx.work)], {}),
        ]
    if name == "stall":
        extra = (*acco, "--training.steps", "40", "--training.collective_timeout_s", "30")
        return [("stall", train(ctx, "stall", *extra), {"TORCHACCO_FAULT": "stall@rank0:step3"})]
    if name == "torchtitan":
        titan = [py, "-m", "benchmarks.gpu_check", "_titan", "--work", str(ctx.work)]
        return [("titan", [*titan, "--titan-assets", str(ctx.titan_assets)], {})]
    return []


LLAMA = ("--model.name", "llama3", "--model.flavor", "debug")
EIGHT_B = ("--config", "train_configs/llama3_8b_fsdp.toml", "--model.vocab_size", "128256", "--tokenizer.path", "",
           "--training.steps", "3", "--training.local_batch_size", "1", "--eval.every", "0", "--checkpoint.enable",
           "false")  # fmt: skip


def nodes_env(ctx, label: str) -> dict:
    """A run over the check's --nproc GPUs per node, on --nnodes nodes (each run its own rendezvous)."""
    env = {"NPROC": str(ctx.nproc)}
    if ctx.nnodes > 1:
        env |= {"NNODES": str(ctx.nnodes), "NODE_RANK": str(ctx.node_rank), "MASTER_ADDR": ctx.master_addr,
                "MASTER_PORT": str(ctx.master_port), "RDZV_ID": f"gpu-check-{label}"}  # fmt: skip
    return env


def on_nodes(ctx, label: str, out: str, *extra: str) -> tuple[str, list[str], dict]:
    """A debug run over the check's GPUs, dumped in `out`, which also names its rendezvous."""
    return label, train(ctx, out, *extra), nodes_env(ctx, out)


def multi_plan(name: str, ctx, py: str, init: tuple) -> list[tuple[str, list[str], dict]]:
    n = ctx.nproc * ctx.nnodes
    batch = ("--training.global_batch_size", str(8 * n))  # 2 micro-batches of 4 per rank: acco's two periods
    kind = lambda k: ("--parallelism.data_parallel", k)  # noqa: E731
    if name == "parity":
        start = ("start", train(ctx, "start", "--training.steps", "1", "--checkpoint.export_hf", "true", device="cpu"),
                 {**CPU, "NPROC": "1"})  # fmt: skip
        cpu = [(f"{k}_cpu", train(ctx, f"{k}_cpu", *kind(k), *init, *batch, device="cpu"), {**CPU, "NPROC": "2"})
               for k in (DDP, *compared())]  # fmt: skip
        compiled = lambda c: ("--model.compile", "true" if c == "compiled" else "false")  # noqa: E731
        gpu = [on_nodes(ctx, f"{k}_{c}", f"{k}_{c}", *kind(k), *init, *batch, *compiled(c))
               for k in (DDP, *compared()) for c in ("eager", "compiled")]  # fmt: skip
        muon = ("--optimizer.name", "muon", *init, *batch)
        muon_cpu = [(f"muon_{k}_cpu", train(ctx, f"muon_{k}_cpu", *kind(k), *muon, device="cpu"),
                     {**CPU, "NPROC": "2"}) for k in compared()]  # fmt: skip
        return [start, *cpu, *gpu, *muon_cpu, *(on_nodes(ctx, f"muon_{k}", f"muon_{k}", *kind(k), *muon)
                                                for k in compared())]  # fmt: skip
    if name == "acco-tp-pp":
        fifty = (*LLAMA, *kind(compared()[0]), *batch, "--training.steps", "50", "--metrics.log_every", "1")
        tp, pp = ("--parallelism.tensor_parallel_degree", "2"), ("--parallelism.pipeline_parallel_degree", "2")
        return [on_nodes(ctx, f"tp2_dp{n // 2}", "tp2", *fifty, *tp),
                on_nodes(ctx, f"tp2_pp2_dp{n // 4}", "tp2pp2", *fifty, *tp, *pp)]  # fmt: skip
    if name == "diloco-fsdp":
        diloco = ("--parallelism.replicas", "2", *kind(FSDP), *batch, "--training.steps", "12",
                  "--diloco.sync_every", "4", "--diloco.overlap_steps", "1")  # fmt: skip
        return [on_nodes(ctx, f"2x_fsdp{n // 2}", "diloco", *diloco)]
    if name == "memory-8b":
        data = ("--data.dataset", str(ctx.work / "corpus"), "--data.cache_dir", str(ctx.work / "cache"),
                "--tokenizer.vocab_size", "400", "--training.global_batch_size", str(2 * n))  # fmt: skip
        dry = [py, "-m", "torchacco", "dry-run", *EIGHT_B, *data, "--dry-run", f"{ctx.nnodes}x{ctx.nproc}"]
        snapshot = ("--profiling.enable", "true", "--profiling.memory_snapshot", "true", "--profiling.start_step",
                    "2", "--profiling.active_steps", "1", "--metrics.log_every", "1")  # fmt: skip
        run = [str(ROOT / "run_train.sh"), *EIGHT_B, *data, *snapshot, "--job.dump_folder", str(ctx.work / "8b")]
        return [("dry-run", dry, {}), ("run", run, nodes_env(ctx, "8b"))]
    if name == "async-save-resume":
        save = (*kind(compared()[0]), *batch, *SAVE, "--checkpoint.async_save", "true")
        step3 = str(ctx.work / "saved" / "checkpoint" / "step-00000003")
        return [on_nodes(ctx, "saved", "saved", *save),
                on_nodes(ctx, "resumed", "resumed", *save, "--checkpoint.load_path", step3)]  # fmt: skip
    if name == "hung-collective":
        hang = (*batch, "--training.steps", "60", "--training.collective_timeout_s", "30")
        return [on_nodes(ctx, k, f"hung_{k}", *kind(k), *hang) for k in compared()[:2]]
    if name == "torchft-nccl":
        ft = ("--parallelism.replicas", "2", *kind(DDP), *batch, "--training.steps", "9", "--diloco.sync_every",
              "3", "--diloco.fault_tolerant", "true", "--diloco.round_timeout_s", "20")  # fmt: skip
        return [("ft", train(ctx, "ft", *ft), {"NPROC": str(ctx.nproc), "TORCHACCO_FAULT": FREEZE})]
    return []


FREEZE = "freeze@replica1:rank0:step3:600s"  # stopped in its outer step's exchange: the check then SIGKILLs it


def shown(cmd: list[str], env: dict, ctx) -> str:
    """A command as printed: the debug run's shared arguments as <debug run>, the probe's code elided."""
    text = " ".join([*(f"{k}={v!r}" for k, v in env.items()),
                     *("'<probe: torch build, GPU, NCCL, modules>'" if a == PROBE else a for a in cmd)])  # fmt: skip
    return text.strip().replace(" ".join(debug_run(ctx)), "<debug run>")


def validate(argv: list[str], env: dict) -> list[str]:
    """What would stop `argv` from starting: a missing program, module, file or config key."""
    problems = []
    if not (Path(argv[0]).exists() if "/" in argv[0] else shutil.which(argv[0])):
        problems.append(f"{argv[0]} not found")
    if argv[1:2] == ["-m"] and importlib.util.find_spec(argv[2]) is None:
        problems.append(f"module {argv[2]} not found")
    for arg in argv[1:]:
        if arg.endswith((".py", ".sh", ".toml")) and not (ROOT / arg).exists():
            problems.append(f"{arg} not found")
    dry = argv[2:4] == ["torchacco", "dry-run"]
    if argv[0].endswith("run_train.sh") or dry:  # the launcher's own check, which would fail the run at its start
        from torchacco.config import load_config
        from torchacco.validate import validate as check

        nodes, per_node = map(int, argv[-1].split("x")) if dry else (int(env.get(k, 1)) for k in ("NNODES", "NPROC"))
        args = argv[4:-2] if dry else argv[1:]
        if "--model.init_from" in args:  # an earlier run's export: not there yet
            del args[args.index("--model.init_from") : args.index("--model.init_from") + 2]
        try:
            check(load_config(args), nodes * per_node, per_node, here=False)
        except Exception as e:
            problems.append(f"{'dry run' if dry else 'run_train.sh'} overrides: {e}")
    if argv[2:4] == ["benchmarks.gpu", "case"]:
        from benchmarks.gpu import cases

        if argv[4] not in (c["name"] for c in cases(quick=False)):
            problems.append(f"benchmarks.gpu has no case {argv[4]!r}")
    return problems


# The parent: each step in a process group of its own, killed at its limit.


def run_step(step: Step, ctx, limit: float, env: dict) -> dict:
    started = time.monotonic()
    own = [sys.executable, "-m", "benchmarks.gpu_check", "_step", step.name, "--limit-s", str(round(limit))]
    argv = step.child or own + [f"--{k.replace('_', '-')}={getattr(ctx, k)}" for k in SHARED]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env=env, start_new_session=True)  # fmt: skip
    timed_out = False
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        # SIGTERM first: torchrun passes it to its workers, which run in sessions of their own
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        timed_out = True
    lines = out.splitlines()
    result = {"step": step.name, "limit_s": round(limit), "seconds": round(time.monotonic() - started, 1)}
    result["parts"] = [json.loads(x[5:]) for x in lines if x.startswith("PART ")]
    if timed_out:
        result["status"] = f"timed out after {limit:.0f} s"
    else:
        final = next((json.loads(x[7:]) for x in reversed(lines) if x.startswith("RESULT ")), None)
        result.update(final or {"status": f"failed: exit code {proc.returncode}, no result"})
    if not result["status"].startswith(("passed", "skipped")):
        result["stderr_tail"] = err.splitlines()[-20:]
    return result


def commit() -> str | None:
    """The checkout's commit; TORCHACCO_COMMIT where the copy has no .git (the device tool's)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    except OSError:
        head = None
    return (head.stdout.strip() if head and head.returncode == 0 else "") or os.environ.get("TORCHACCO_COMMIT")


def main(argv=None) -> int:
    parser = bare_parser("gpu-check", __doc__)
    parser.add_argument("--steps", help="a comma-separated subset (default: all)")
    parser.add_argument("--budget-s", type=float, help="all steps' limits together (default: 780, a 15-min lease; "
                        "with --nproc > 1 the limits' sum)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=ROOT / f"bench_results/gpu_check_{time.strftime('%Y-%m-%d')}.json")
    shared_options(parser, default=Path("/tmp/torchacco-gpu-check"))
    parser.add_argument("--dry-run", action="store_true", help="print the plan and check its commands; run nothing")
    args = parser.parse_args(argv)
    steps = MULTI if args.nproc > 1 else STEPS
    names = [s.strip() for s in (args.steps or ",".join(s.name for s in steps)).split(",") if s.strip()]
    unknown = [n for n in names if n not in {s.name for s in steps}]
    wrong = (f"--steps: unknown step {unknown[0]!r}; the steps are {', '.join(s.name for s in steps)}" if unknown
             else f"--steps: no step named; the steps are {', '.join(s.name for s in steps)}" if not names
             else f"--nproc {args.nproc}: the multi-GPU check needs a multiple of 4 (tp 2 × pp 2)"
             if args.nproc > 1 and args.nproc % 4 else None)  # fmt: skip
    if wrong:
        print(error_line(wrong), file=sys.stderr)
        return 2
    chosen = [s for s in steps if s.name in names]  # always in the order above
    args.budget_s = args.budget_s or (780 if args.nproc == 1 else sum(s.limit_s for s in chosen))
    scale = min(1.0, args.budget_s / sum(s.limit_s for s in chosen))
    limits = {s.name: s.limit_s * scale for s in chosen}
    print(f"gpu-check: {len(chosen)} steps within {sum(limits.values()):.0f} s (budget {args.budget_s:.0f} s)")
    print(f"<debug run>: {' '.join(debug_run(args))}")
    problems = []
    for i, s in enumerate(chosen, 1):
        print(f"{i}. {s.name} ({limits[s.name]:.0f} s): {s.what}")
        for label, cmd, env in plan(s.name, args) if s.child is None else [("run", s.child, {})]:
            print(f"   {label}: {shown(cmd, env, args)}")
            problems += [f"{s.name}/{label}: {p}" for p in validate(cmd, env)] if args.dry_run else []
    if args.dry_run:
        for p in problems:
            print(error_line(p), file=sys.stderr)
        return 1 if problems else 0
    site = str(args.work / "site")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")]))}
    summary = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": f"{platform.node()}, {os.cpu_count()} CPUs",
               "command": " ".join(["python -m benchmarks gpu-check", *(argv if argv is not None else sys.argv[1:])]),
               "commit": commit(), "budget_s": args.budget_s, "steps": []}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    for s in chosen:
        result = run_step(s, args, limits[s.name], env)
        print(f"{s.name}: {result['status']} ({result['seconds']:.0f} s)", flush=True)
        summary["steps"].append(result)
        if result.get("gpu"):  # the env step's probe: the machine's GPU and torch
            summary["machine"] += f", {result['gpu']}, torch {result['torch']}, NCCL {result['nccl']}"
        args.out.write_text(json.dumps(summary, indent=1, ensure_ascii=False))
    summary["result"] = ", ".join(f"{sum(r['status'].startswith(k) for r in summary['steps'])} {k}"
                                  for k in ("passed", "failed", "timed out", "skipped"))  # fmt: skip
    args.out.write_text(json.dumps(summary, indent=1, ensure_ascii=False))
    print(f"{summary['result']}; wrote {args.out}")
    return 0


# The steps, each in a process of its own (`python -m benchmarks.gpu_check _step NAME --work DIR`): a step prints
# `PART {json}` as each of its checks ends (a step cut at its limit keeps them), then `RESULT {json}` with its status.

WORDS = (
    "the king and queen of a land far away went to see the sea with their horse dog cat bird "
    "under sun moon and then they sang of old times while rain fell on green hills"
).split()


def outcome(problems: list[str]) -> str:
    return "failed: " + "; ".join(problems) if problems else "passed"


def part(problems: list[str], problem: str, **found) -> bool:
    """Prints a check's `PART` line; where it failed (not found["ok"]), adds `problem` to `problems`."""
    print("PART " + json.dumps(found), flush=True)
    problems += [] if found["ok"] else [problem]
    return found["ok"]


def sh(argv: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    full = {**os.environ, "NPROC": "1", "PYTHON": sys.executable, **(env or {})}
    return subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=full)


def tail(proc: subprocess.CompletedProcess, lines: int = 3) -> str:
    return " | ".join((proc.stderr.strip() or proc.stdout.strip()).splitlines()[-lines:])[-600:]


def has_gpu() -> bool:
    return importlib.import_module("torch").cuda.is_available()  # (torch imported only when asked)


def corpus(work: Path) -> None:
    """The suite's word salad (tests/conftest.py): a 400-token BPE and many 64-token windows, offline."""
    folder = work / "corpus"
    if folder.exists():
        return
    folder.mkdir(parents=True)
    rng = random.Random(0)
    for f in range(8):
        paragraphs = (" ".join(rng.choice(WORDS) for _ in range(60)) + "." for _ in range(60))
        (folder / f"doc{f}.txt").write_text("\n\n".join(paragraphs))


def losses(folder: Path, key: str = "loss") -> list[float]:
    return [r[key] for r in records(folder)]


def rel_gap(a: list[float], b: list[float]) -> float:
    if len(a) != len(b) or not a:
        return float("inf")
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def env_step(ctx) -> dict:
    *installs, (_, probe, _) = plan("env", ctx)  # (the carried wheels), torchacco, the probe
    problems = []
    for label, cmd, env in installs:
        if label == "install" and importlib.util.find_spec("torchacco.models") is not None:
            continue  # an install (editable or not) is already there
        proc = sh(cmd, env)
        if not part(problems, f"{label}: {tail(proc, 1)}", check=label, ok=proc.returncode == 0, output=tail(proc)):
            return {"status": outcome(problems)}
    proc = sh(probe)
    if proc.returncode != 0:
        return {"status": f"failed: probe: {tail(proc, 1)}"}
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    problems = [f"torch {info['torch']} is not a CUDA build (install a +cu torch there)"] * (not info["cuda_build"])
    problems += ["no GPU visible to torch"] * (not info["gpu"])
    problems += [f"missing modules: {', '.join(info['missing'])} (carry them: gpu_wheels.sh)"] * bool(info["missing"])
    return {"status": outcome(problems), **info}


def cuda_tests_step(ctx) -> dict:
    if not has_gpu():
        return {"status": "skipped: no GPU"}
    (label, cmd, env), = plan("cuda-tests", ctx)  # fmt: skip
    proc = sh(cmd, env)
    summary = (proc.stdout.strip().splitlines() or [""])[-1]
    failed = [x for x in proc.stdout.splitlines() if x.startswith(("FAILED", "ERROR"))]
    return {"status": "passed" if proc.returncode == 0 else f"failed: {summary}", "summary": summary,
            "files": cmd[7:], "failures": failed[:5]}  # fmt: skip


def parity_step(ctx) -> dict:
    if not has_gpu():
        return {"status": "skipped: no GPU"}
    corpus(ctx.work)
    runs, problems = plan("parity", ctx), []
    for run in ("start", *(label for label, _, _ in runs[1:-1]), "acco_resumed"):
        shutil.rmtree(ctx.work / run, ignore_errors=True)  # a run would resume from an earlier one's checkpoints
    # the start run first (it also trains the tokenizer every run shares), the pairs side by side
    for batch in (runs[:1], runs[1:-1], runs[-1:]):
        with ThreadPoolExecutor(len(batch)) as pool:
            procs = list(pool.map(lambda r: sh(r[1], r[2]), batch))
        for (label, _, _), proc in zip(batch, procs):
            if proc.returncode != 0:
                why = f"{label}: exit {proc.returncode}: {tail(proc, 1)}"
                part(problems, why, check=label, ok=False, output=tail(proc))
        if problems:
            return {"status": outcome(problems)}
    files = sorted(p.name for p in (ctx.work / "start" / "hf").iterdir())
    exported = "config.json" in files and any(p.endswith(".safetensors") for p in files)
    why = f"the export holds {files}: no config.json with safetensors"
    part(problems, why, check="export", ok=exported, files=files)
    for kind in compared():
        gpu, cpu = losses(ctx.work / f"{kind}_cuda"), losses(ctx.work / f"{kind}_cpu")
        gap = rel_gap(gpu, cpu)
        why = f"{kind}: the CUDA losses are {gap:.3g} from the CPU's (allowed {BF16_REL})"
        part(problems, why, check=f"{kind} cuda vs cpu", ok=gap <= BF16_REL, gap=gap, cuda=gpu, cpu=cpu)
    full, resumed = losses(ctx.work / "acco_cuda")[3:], losses(ctx.work / "acco_resumed")
    gap = rel_gap(resumed, full)
    why = f"resume: steps 4-6 are {gap:.3g} from the uninterrupted run's"
    part(problems, why, check="resume from a CUDA checkpoint", ok=gap <= BF16_REL, gap=gap, full=full, resumed=resumed)
    return {"status": outcome(problems), "tolerance": BF16_REL}


def throughput_step(ctx) -> dict:
    if not has_gpu():
        return {"status": "skipped: no GPU"}
    (_, mfu_cmd, _), (_, overlap_cmd, _) = plan("throughput", ctx)
    ref_mfu = next(r["mfu"] for r in json.loads((ROOT / "bench_results/gpu_mfu.json").read_text())
                   if r["name"] == CASE)  # fmt: skip
    ref_overlap = json.loads((ROOT / "bench_results/gpu_overlap.json").read_text())["overlap"]
    problems = []
    proc = sh(mfu_cmd)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        problems.append(f"{CASE}: {tail(proc, 1)}")
    else:
        got = json.loads(line[7:])
        (ctx.work / "throughput.json").write_text(json.dumps(got))  # step 6 compares against it
        part(problems, f"MFU {got['mfu']:.1%} under {KEPT:.0%} of {ref_mfu:.1%}", check="mfu",
             ok=got["mfu"] >= KEPT * ref_mfu, mfu=got["mfu"], reference=ref_mfu, tokens_per_s=got["tokens_per_s"],
             peak_memory_gib=got["peak_memory_gib"], device=got["device"], torch=got["torch"])  # fmt: skip
    proc = sh(overlap_cmd)
    if proc.returncode != 0:
        problems.append(f"overlap: {tail(proc, 1)}")
    else:
        got = json.loads((ctx.work / "gpu_overlap.json").read_text())["overlap"]
        why = f"overlap {got:.1%} under {KEPT:.0%} of {ref_overlap:.1%}"
        part(problems, why, check="overlap", ok=got >= KEPT * ref_overlap, overlap=got, reference=ref_overlap)
    return {"status": outcome(problems)}


def stall_step(ctx) -> dict:
    if not has_gpu():
        return {"status": "skipped: no GPU"}
    corpus(ctx.work)
    shutil.rmtree(ctx.work / "stall", ignore_errors=True)
    (_, cmd, env), = plan("stall", ctx)  # fmt: skip
    started = time.monotonic()
    proc = sh(cmd, env)
    errors = ERROR.findall(proc.stderr)
    recorder = ctx.work / "stall" / "flight_recorder"
    dumps = sorted(p.name for p in recorder.iterdir()) if recorder.is_dir() else []
    diagnosed, problems = proc.returncode != 0 and len(errors) == 1 and "made no progress" in errors[0], []
    part(problems, f"no one-line diagnosis (exit {proc.returncode}: {tail(proc, 1)})", check="diagnosis",
         ok=diagnosed, lines=errors, traceback="Traceback" in proc.stderr,
         seconds=round(time.monotonic() - started, 1))  # fmt: skip
    part(problems, f"nothing in {recorder}", check="flight recorder", ok=bool(dumps), files=dumps)
    return {"status": outcome(problems)}


# The multi-GPU steps (--nproc N): each runs its plan's commands, then checks what they wrote on node 0.


def dump_folder(cmd: list[str]) -> Path:
    return Path(cmd[cmd.index("--job.dump_folder") + 1])


def workers(marker: str, state: str = "") -> dict[int, int]:
    """rank -> pid of this node's training workers whose command line holds `marker` (their dump folder), those in
    process `state` (e.g. "T": stopped) only if given (the launcher, without a RANK, is left out)."""
    return {int(env[b"RANK"]): pid for pid, cmd, env, now in trainers()
            if marker.encode() in cmd and now.startswith(state) and b"RANK" in env}  # fmt: skip


def disturbed(cmd: list[str], env: dict, target, act, limit_s: float) -> tuple[int | None, str]:
    """Runs `cmd`; the first time `target()` names a pid, `act(pid)`. Returns the exit code and stderr."""
    with open(dump_folder(cmd).with_suffix(".stderr"), "w+") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, cwd=ROOT, start_new_session=True,
                                env={**os.environ, "PYTHON": sys.executable, **env})  # fmt: skip
        done, deadline = None, time.monotonic() + limit_s
        while proc.poll() is None and time.monotonic() < deadline:
            if not done and (done := target()):
                act(done)
            time.sleep(0.2)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if done:
            with contextlib.suppress(ProcessLookupError):
                os.kill(done, signal.SIGKILL)  # a SIGSTOPped worker never exits on its own
        proc.wait()
        log.seek(0)
        return proc.returncode, log.read()


def logged(folder: Path) -> int:
    """Complete lines in metrics.jsonl (read while it is written)."""
    return (folder / "metrics.jsonl").read_text().count("\n") if (folder / "metrics.jsonl").exists() else 0


def hung_check(ctx, problems: list, label: str, cmd: list[str], env: dict) -> None:
    folder = dump_folder(cmd)
    code, err = disturbed(cmd, env, lambda: logged(folder) >= 3 and workers(str(folder)).get(1),
                          lambda pid: os.kill(pid, signal.SIGSTOP), 0.45 * ctx.limit_s)  # fmt: skip
    lines = ERROR.findall(err)
    dumps = sorted(p.name for p in (folder / "flight_recorder").glob("rank_*"))
    missing = [r for r in range(ctx.nproc) if r != 1 and not any(d.startswith(f"rank_{r}") for d in dumps)]
    ok = code not in (0, None) and bool(lines) and "rank 1" in lines[0]
    part(problems, f"{label}: no one-line diagnosis naming rank 1 (exit {code}: {err.strip()[-300:]})",
         check=f"{label} diagnosis", ok=ok, lines=lines)  # fmt: skip
    part(problems, f"{label}: no flight_recorder/rank_* of rank(s) {missing}", check=f"{label} flight recorder",
         ok=not missing, files=dumps)  # fmt: skip


def falling(problems: list, label: str, folder: Path, steps: int) -> list[float]:
    got = losses(folder)
    ok = len(got) == steps and all(x == x for x in got) and got[-1] < got[0]
    part(problems, f"{label}: {len(got)} of {steps} losses, not all finite or not falling", check=label, ok=ok,
         losses=got[:: max(1, steps // 10)])  # fmt: skip
    return got


def multi_step(ctx) -> dict:
    import torch

    if not has_gpu() or torch.cuda.device_count() < ctx.nproc:
        return {"status": f"skipped: {torch.cuda.device_count()} GPUs here, --nproc {ctx.nproc}"}
    if ctx.name == "torchft-nccl" and (ctx.nnodes > 1 or importlib.util.find_spec("torchft") is None):
        return {"status": "skipped: one node's check, with torchft installed (./install.sh ft)"}
    corpus(ctx.work)
    runs, problems = plan(ctx.name, ctx), []
    for _, cmd, _ in runs:
        if "--job.dump_folder" in cmd:
            shutil.rmtree(dump_folder(cmd), ignore_errors=True)
    if ctx.name == "hung-collective" and ctx.node_rank == 0:
        for label, cmd, env in runs:
            hung_check(ctx, problems, label, cmd, env)
        return {"status": outcome(problems)}
    if ctx.name == "torchft-nccl":
        (_, cmd, env), = runs  # fmt: skip
        marker = str(dump_folder(cmd))
        code, err = disturbed(cmd, env, lambda: next(iter(workers(marker, "T").values()), None),
                              lambda pid: os.kill(pid, signal.SIGKILL), 0.9 * ctx.limit_s)  # fmt: skip
        part(problems, f"exit {code}: {err.strip()[-300:]}", check="survivor finished", ok=code == 0,
             replica1_lost="replica(s) 1 failed for good" in err)  # fmt: skip
        falling(problems, "replica 0", dump_folder(cmd), 9)
        return {"status": outcome(problems)}
    first = runs[:1] if ctx.name == "parity" else []  # the start run trains the tokenizer every run shares
    procs = {label: sh(cmd, env) for label, cmd, env in first}
    with ThreadPoolExecutor(1) as pool:  # the CPU references one at a time, beside the GPU runs
        cpu = {label: pool.submit(sh, cmd, env) for label, cmd, env in runs[len(first) :] if env.get("NPROC") == "2"}
        procs |= {label: sh(cmd, env) for label, cmd, env in runs[len(first) :] if label not in cpu}
        procs |= {label: job.result() for label, job in cpu.items()}
    failed = {label: f"exit {p.returncode}: {tail(p, 1)}" for label, p in procs.items() if p.returncode}
    if ctx.node_rank:
        return {"status": f"skipped: node {ctx.node_rank} ran its part; node 0 checks", "exit": failed}
    for label, why in failed.items():
        part(problems, f"{label}: {why}", check=label, ok=False)
    if not failed:
        CHECKS[ctx.name](ctx, problems, runs, procs)
    return {"status": outcome(problems)}


def parity_checks(ctx, problems, runs, procs) -> None:
    """Each GPU run against its CPU reference: four strategies eager and compiled, three of them with Muon."""
    pairs = [(f"{k} {mode}", f"{k}_{mode}", f"{k}_cpu") for k in (DDP, *compared()) for mode in ("eager", "compiled")]
    pairs += [(f"{k} muon", f"muon_{k}", f"muon_{k}_cpu") for k in compared()]
    for name, gpu_run, cpu_run in pairs:
        gpu, cpu = losses(ctx.work / gpu_run), losses(ctx.work / cpu_run)
        gap = rel_gap(gpu, cpu)
        part(problems, f"{name}: {gap:.3g} from the CPU's losses (allowed {BF16_REL})",
             check=f"{name} vs cpu", ok=gap <= BF16_REL, gap=gap, cuda=gpu, cpu=cpu)  # fmt: skip


def memory_checks(ctx, problems, runs, procs) -> None:
    found = re.search(r"peak ([\d.]+) GiB", procs["dry-run"].stdout)
    planned = float(found[1]) if found else float("nan")
    measured = max(losses(ctx.work / "8b", "memory_gib"))
    gap = abs(planned - measured) / measured
    part(problems, f"the dry run's peak {planned} GiB is {gap:.1%} from the {measured:.1f} GiB allocated",
         check="peak vs dry run", ok=gap <= 0.10, dry_run_gib=planned, allocated_gib=measured)  # fmt: skip
    snapshots = [p.name for p in (ctx.work / "8b" / "profile" / "rank0").glob("memory_step*.pickle")]
    part(problems, "no memory snapshot", check="snapshot", ok=bool(snapshots), files=snapshots)


def resume_checks(ctx, problems, runs, procs) -> None:
    full, resumed = losses(ctx.work / "saved")[3:], losses(ctx.work / "resumed")
    part(problems, f"steps 4-6 resumed {resumed}, uninterrupted {full}", check="exact resume", ok=full == resumed)
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # the largest process's peak (KiB)
    said = re.search(r"holds about ([\d,.]+) MiB of host memory per rank", procs["saved"].stdout)
    staged = float(said[1].replace(",", "")) / 2**10 if said else float("nan")  # (nan: no line, a failed check)
    part(problems, f"host RSS {rss:.2f} GiB, {staged:.3f} GiB staged (allowed: 6 GiB more: torch, CUDA, the loader)",
         check="host RSS", ok=staged <= rss <= staged + 6, host_rss_gib=round(rss, 2), staged_gib=staged)  # fmt: skip


CHECKS = {"parity": parity_checks, "memory-8b": memory_checks, "async-save-resume": resume_checks,
          "acco-tp-pp": lambda ctx, problems, runs, _: [falling(problems, r[0], dump_folder(r[1]), 50) for r in runs],
          "diloco-fsdp": lambda ctx, problems, runs, _: falling(problems, "diloco", ctx.work / "diloco", 12),
          "hung-collective": lambda *_: None}  # fmt: skip


def titan_step(ctx) -> dict:
    try:
        titan = version("torchtitan")
    except PackageNotFoundError:
        titan = None
    missing = [m for m in TITAN_NEEDS if importlib.util.find_spec(m) is None]
    assets = [str(ctx.titan_assets / "tests/assets" / a) for a in ("tokenizer", "c4_test")]
    missing += [a for a in assets if not Path(a).is_dir()]
    if missing:
        return {"status": f"skipped: torchtitan cannot run here: missing {', '.join(missing)}"}
    if not has_gpu():
        return {"status": "skipped: no GPU"}
    if titan != TITAN:  # e.g. 0.3.0 imports DataParallelMeshDims, which torch 2.11 lacks
        return {"status": f"skipped: torchtitan {titan} is installed; the comparison is for {TITAN}"}
    probe = subprocess.run([sys.executable, "-c", "import torchtitan.train"], capture_output=True, text=True)
    if probe.returncode != 0:
        why = f"does not import with torch {version('torch')}: {tail(probe, 1)}"
        return {"status": f"skipped: torchtitan {titan} {why}"}
    (_, cmd, _), = plan("torchtitan", ctx)  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    text = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)  # torchtitan colours its log
    tps = [float(t.replace(",", "")) for t in re.findall(r"tps: ([\d,]+)", text)]
    peak = re.search(r"^TITAN_PEAK_GIB ([\d.]+)$", proc.stdout, re.M)
    if proc.returncode != 0 or len(tps) < 5 or not peak:
        return {"status": f"failed: torchtitan {titan}: {tail(proc, 1)}"}
    found = {"titan_version": titan, "titan_tokens_per_s": sum(tps[3:]) / len(tps[3:]),
             "titan_peak_memory_gib": float(peak[1])}  # fmt: skip
    ours = ctx.work / "throughput.json"  # step throughput's measurement of the same case
    if not ours.exists():
        return {"status": "passed: torchtitan measured; no torchacco figure (run step throughput)", **found}
    mine = json.loads(ours.read_text())
    found["tokens_per_s_ratio"] = mine["tokens_per_s"] / found["titan_tokens_per_s"]  # torchacco / torchtitan
    found["peak_memory_ratio"] = mine["peak_memory_gib"] / found["titan_peak_memory_gib"]
    return {"status": "passed", **found}


def titan_run(ctx) -> int:
    """torchtitan on CASE in this process (a world of 1): its Llama 3 8B cut to an 8-layer flavor registered for the
    run, seq 8192 × 2, as its llama3_8b.toml (selective AC by op, lr 3e-4), compiled, as torchacco's case. Its
    defaults keep checkpoints, validation, profiling and TensorBoard off; in a world of 1 it shards nothing and
    autocasts to bf16 over fp32 parameters. Its own test assets hold the tokenizer and the data (no network there)."""
    import torch
    from torchtitan.config import ConfigManager
    from torchtitan.models.llama3 import llama3_args
    from torchtitan.tools.logging import init_logger
    from torchtitan.train import Trainer

    from benchmarks.gpu import cases

    case = next(c for c in cases(quick=False) if c["name"] == CASE)
    local = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29537",
                 HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")  # fmt: skip
    for key, value in local.items():
        os.environ.setdefault(key, value)
    os.chdir(ctx.titan_assets)  # its configs name ./tests/assets/... relative to the working directory
    # torchtitan resets the peak at each log line: kept, it is the whole run's, as torchacco's memory_gib (allocated)
    torch.cuda.reset_peak_memory_stats = lambda *args, **kwargs: None
    flavor = f"8B_{case['layers']}_layers"
    llama3_args[flavor] = dataclasses.replace(llama3_args["8B"], n_layers=case["layers"])
    init_logger()  # its train.py main does this; without it the `tps:` lines are not logged
    cfg = ConfigManager().parse_args([
        "--model.flavor", flavor, "--model.hf_assets_path", "./tests/assets/tokenizer",
        "--training.dataset", "c4_test", "--training.seq_len", str(case["seq"]),
        "--training.local_batch_size", str(case["batch"]), "--training.steps", "12", "--optimizer.lr", "3e-4",
        "--activation_checkpoint.mode", case["ac"], "--activation_checkpoint.selective_ac_option", "op",
        *["--compile.enable"] * case["compile"], "--metrics.log_freq", "1",
        "--job.dump_folder", str(ctx.work / "titan"),
    ])  # fmt: skip
    trainer = Trainer(cfg)
    trainer.train()
    trainer.close()
    print(f"TITAN_PEAK_GIB {torch.cuda.max_memory_allocated() / 2**30:.3f}", flush=True)
    return 0


RUNS = {"env": env_step, "cuda-tests": cuda_tests_step, "parity": parity_step, "throughput": throughput_step,
         "stall": stall_step, "torchtitan": titan_step}  # fmt: skip


# the options that the parent passes on to each step's process (run_step)
SHARED = ("work", "wheels", "titan_assets", "nproc", "nnodes", "node_rank", "master_addr", "master_port")


def shared_options(parser: argparse.ArgumentParser, **work) -> None:
    """The parent's and each step's options: the folders, and the nodes (`work`: how --work is given)."""
    parser.add_argument("--work", type=Path, help="runs, corpus, site", **work)
    parser.add_argument("--wheels", type=Path, default=ROOT / ".whl-gpu", help="wheels to install (gpu_wheels.sh)")
    parser.add_argument("--titan-assets", type=Path, default=ROOT / ".whl-gpu" / "titan",
                        help="holds torchtitan's tests/assets/{tokenizer,c4_test}")  # fmt: skip
    parser.add_argument("--nproc", type=int, default=1, help="GPUs per node: > 1 runs the multi-GPU check")
    parser.add_argument("--nnodes", type=int, default=1, help="nodes, each running this check with its --node-rank")
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--master-addr", default="127.0.0.1", help="node 0's address, with --nnodes > 1")
    parser.add_argument("--master-port", type=int, default=29511)


def child(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=("_step", "_titan"))
    parser.add_argument("name", nargs="?")
    parser.add_argument("--limit-s", type=float, default=600)
    shared_options(parser, required=True)
    ctx = parser.parse_args(argv)
    if ctx.what == "_titan":
        return titan_run(ctx)
    result = (multi_step if ctx.nproc > 1 and ctx.name != "env" else RUNS[ctx.name])(ctx)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(child(sys.argv[1:]) if sys.argv[1:2] in (["_step"], ["_titan"]) else main())
