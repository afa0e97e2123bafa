"""`python -m benchmarks gpu-check`: the CUDA paths checked in one short GPU lease (about 13 minutes).

    python3 -m benchmarks gpu-check [--dry-run] [--steps env,parity,...] [--budget-s 780] [--out FILE]
                                    [--wheels DIR] [--titan-assets DIR] [--work DIR]

Six steps, in this order, each a process group of its own with its own time limit (a hang costs
that step's limit, not the lease); one JSON summary (bench_results/gpu_check_<date>.json) is
rewritten after each step, so a cut run keeps the steps it finished:
1. env: the carried wheels (--wheels, made by benchmarks/gpu_wheels.sh) and torchacco installed
   without the network, then the torch build (+cu), the GPU's name and NCCL's version;
2. cuda-tests: the suite's CUDA tests (the test files that skip on `not HAS_CUDA`), stopping at
   the first failure;
3. parity: ACCO, ZeRO-1 and FSDP on the GPU against the same runs on the CPU, bf16, from one model
   exported on the GPU through safetensors; ACCO resumed from its step-3 checkpoint saved on the GPU;
4. throughput: benchmarks.gpu's 8B×8 compiled case and ACCO's overlap in a trace, against the
   figures in bench_results/gpu_mfu.json and gpu_overlap.json (2026-11-22);
5. stall: ACCO's collectives stalled (TORCHACCO_FAULT): the one-line diagnosis, the flight recorder;
6. torchtitan: torchtitan 0.3.0 on step 4's 8B×8 case: tokens/s and peak memory as ratios.
A step whose needs are absent (no GPU, no torchtitan) is recorded as "skipped: <reason>"; the
rest go on. `--dry-run` prints the plan and checks, without a GPU, that every command would start:
its programs, modules and files exist, and its training overrides parse.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from torchacco.errors import error_line

ROOT = Path(__file__).resolve().parents[1]
# The relative loss gap allowed between bf16 runs on two devices over the 6 updates: on the CPU,
# bf16 against fp32 differed by 4e-4 (2026-11-26); the rest is room for two devices' kernels.
BF16_REL = 0.01
KEPT = 0.95  # a throughput figure passes at 95% of its 2026-11-22 value (run-to-run spread is a few %)
CASE = dict(
    name="8B×8 fsdp compiled, selective AC, batch 2",
    model="llama3",
    flavor="8B",
    seq=8192,
    layers=8,
    strategy=None,
    batch=2,
    compile=True,
    ac="selective",
    chunks=8,
)  # fmt: skip  (strategy: FSDP's name)
TITAN_NEEDS = ("torchtitan", "torchdata", "torch_checkpointing", "datasets", "tyro", "einops", "spmd_types")
NEEDS = ("torch", "torchdata", "tokenizers", "safetensors", "tensorboard", "torchacco.models", "pytest")


@dataclasses.dataclass
class Step:
    name: str
    limit_s: float
    what: str
    child: list[str] | None = None  # the step's process; None: this module's `_step NAME`


STEPS = [
    Step("env", 40, "carried wheels and torchacco installed offline; torch +cu, GPU name, NCCL version"),
    Step("cuda-tests", 210, "the suite's CUDA tests, -x"),
    Step("parity", 140, "acco/zero1/fsdp on CUDA vs CPU in bf16; resume from a CUDA checkpoint; safetensors"),
    Step("throughput", 200, "8B×8 compiled MFU and ACCO's overlap against 2026-11-22"),
    Step("stall", 75, "a stalled collective: the one-line diagnosis and flight_recorder/"),
    Step("torchtitan", 115, "torchtitan 0.3.0 on the 8B×8 case: tokens/s and peak memory ratios"),
]


def step_argv(step: Step, ctx) -> list[str]:
    own = [sys.executable, "-m", "benchmarks.gpu_check", "_step", step.name, "--work", str(ctx.work)]
    return step.child or own + ["--titan-assets", str(ctx.titan_assets), "--wheels", str(ctx.wheels)]


# Each step's commands: (label, argv, extra environment). The dry run prints and checks them.


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


def case() -> dict:
    return {**CASE, "strategy": compared()[2]}


BF16 = ("--training.mixed_precision", "bf16")  # auto would be fp32 on the CPU
PROBE = (
    "import importlib.util as u, json, torch; c = torch.cuda.is_available(); print(json.dumps({"
    "'torch': torch.__version__, 'cuda_build': torch.version.cuda, 'gpu': torch.cuda.get_device_name() if c else None, "
    "'nccl': '.'.join(map(str, torch.cuda.nccl.version())) if c else None, "
    f"'missing': [m for m in {NEEDS!r} if u.find_spec(m) is None]}}))"
)


def cuda_test_files() -> list[str]:
    tests = (ROOT / "tests").glob("test_*.py")
    return sorted(str(p.relative_to(ROOT)) for p in tests if "not HAS_CUDA" in p.read_text())


def plan(name: str, ctx) -> list[tuple[str, list[str], dict]]:
    """A step's commands: (label, argv, extra environment). The dry run prints and checks them."""
    py, hf = sys.executable, str(ctx.work / "start" / "hf")
    acco = ("--parallelism.data_parallel", compared()[0])
    if name == "env":
        pip = [py, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
        wheels = sorted(str(w) for w in Path(ctx.wheels).glob("*.whl"))
        carried = [("wheels", [*pip, "--no-compile", "--upgrade", "--target", str(ctx.work / "site"), *wheels], {})]
        return carried * bool(wheels) + [
            ("install", [*pip, "--no-build-isolation", "-e", str(ROOT)], {}),
            ("probe", [py, "-c", PROBE], {}),
        ]
    if name == "cuda-tests":
        return [("pytest", [py, "-m", "pytest", "-x", "-q", "-m", "not faults", *cuda_test_files()], {})]
    if name == "parity":
        start = train(ctx, "start", *acco, "--training.steps", "1", "--checkpoint.export_hf", "true")
        runs = [
            (f"{k}_{d}", train(ctx, f"{k}_{d}", "--parallelism.data_parallel", k, "--model.init_from", hf, *BF16,
                               *SAVE * (k == acco[1] and d == "cuda"), device=d), CPU if d == "cpu" else {})
            for k in compared() for d in ("cuda", "cpu")
        ]  # fmt: skip
        step3 = str(ctx.work / "acco_cuda" / "checkpoint" / "step-00000003")
        resumed = train(
            ctx, "acco_resumed", *acco, "--model.init_from", hf, *BF16, *SAVE, "--checkpoint.load_path", step3
        )
        return [("start", start, {}), *runs, ("resumed", resumed, {})]
    if name == "throughput":
        gpu = [py, "-m", "benchmarks.gpu"]
        return [
            ("mfu", [*gpu, "case", json.dumps(case(), ensure_ascii=False), "--steps", "12"], {}),
            ("overlap", [*gpu, "overlap", "--steps", "8", "--out", str(ctx.work)], {}),
        ]
    if name == "stall":
        extra = (*acco, "--training.steps", "40", "--training.collective_timeout_s", "30")
        return [("stall", train(ctx, "stall", *extra), {"TORCHACCO_FAULT": "stall@rank0:step3"})]
    if name == "torchtitan":
        titan = [py, "-m", "benchmarks.gpu_check", "_titan", "--work", str(ctx.work)]
        return [("titan", [*titan, "--titan-assets", str(ctx.titan_assets)], {})]
    return []


def shown(cmd: list[str], env: dict, ctx) -> str:
    """A command as printed: the debug run's shared arguments as <debug run>, the probe's code elided."""
    text = (
        " ".join(f"{k}={v!r}" for k, v in env.items())
        + " "
        + " ".join("'<probe: torch build, GPU, NCCL, modules>'" if a == PROBE else a for a in cmd)
    )
    return text.strip().replace(" ".join(debug_run(ctx)), "<debug run>")


def validate(argv: list[str]) -> list[str]:
    """What would stop `argv` from starting: a missing program, module, file or config key."""
    problems = []
    if not (Path(argv[0]).exists() if "/" in argv[0] else shutil.which(argv[0])):
        problems.append(f"{argv[0]} not found")
    if argv[1:2] == ["-m"] and importlib.util.find_spec(argv[2]) is None:
        problems.append(f"module {argv[2]} not found")
    for arg in argv[1:]:
        if arg.endswith((".py", ".sh", ".toml")) and not (ROOT / arg).exists():
            problems.append(f"{arg} not found")
    if argv[0].endswith("run_train.sh"):
        from torchacco.config import load_config

        try:
            load_config(argv[1:])
        except Exception as e:  # the trainer's own check, which would fail the run at its start
            problems.append(f"run_train.sh overrides: {e}")
    if argv[2:4] == ["benchmarks.gpu", "case"]:
        from benchmarks.gpu import cases

        if json.loads(argv[4]) not in cases(quick=False):
            problems.append(f"benchmarks.gpu has no case {CASE['name']!r} as gpu_check.CASE states it")
    return problems


# The parent: each step in a process group of its own, killed at its limit.


def run_step(step: Step, ctx, limit: float, env: dict) -> dict:
    started = time.monotonic()
    proc = subprocess.Popen(step_argv(step, ctx), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env=env, start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=limit)
        timed_out = False
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
    final = next((json.loads(x[7:]) for x in reversed(lines) if x.startswith("RESULT ")), None)
    if timed_out:
        result["status"] = f"timed out after {limit:.0f} s"
    elif final is None:
        result["status"] = f"failed: exit code {proc.returncode}, no result"
    result = {**result, **(final or {})} if not timed_out else result
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
    parser = argparse.ArgumentParser(prog="python -m benchmarks gpu-check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--steps", default=",".join(s.name for s in STEPS), help="a comma-separated subset")
    parser.add_argument("--budget-s", type=float, default=780, help="all steps' limits together (a 15-min lease)")
    parser.add_argument("--out", default=ROOT / "bench_results" / f"gpu_check_{time.strftime('%Y-%m-%d')}.json")
    parser.add_argument("--work", type=Path, default=Path("/tmp/torchacco-gpu-check"), help="runs, corpus, site")
    parser.add_argument("--wheels", type=Path, default=ROOT / ".whl-gpu", help="wheels to install (gpu_wheels.sh)")
    parser.add_argument("--titan-assets", type=Path, default=ROOT / ".whl-gpu" / "titan",
                        help="holds torchtitan's tests/assets/{tokenizer,c4_test}")  # fmt: skip
    parser.add_argument("--dry-run", action="store_true", help="print the plan and check its commands; run nothing")
    args = parser.parse_args(argv)
    names = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = [n for n in names if n not in {s.name for s in STEPS}]
    if unknown or not names:
        print(error_line(f"--steps: unknown step {unknown[0]!r}" if unknown else "--steps: no step named")
              + f"; the steps are {', '.join(s.name for s in STEPS)}", file=sys.stderr)  # fmt: skip
        return 2
    chosen = [s for s in STEPS if s.name in names]  # always in the order above
    scale = min(1.0, args.budget_s / sum(s.limit_s for s in chosen))
    limits = {s.name: s.limit_s * scale for s in chosen}
    print(f"gpu-check: {len(chosen)} steps within {sum(limits.values()):.0f} s (budget {args.budget_s:.0f} s)")
    print(f"<debug run>: {' '.join(debug_run(args))}")
    problems = []
    for i, s in enumerate(chosen, 1):
        print(f"{i}. {s.name} ({limits[s.name]:.0f} s): {s.what}")
        for label, cmd, env in plan(s.name, args) if s.child is None else [("run", s.child, {})]:
            print(f"   {label}: {shown(cmd, env, args)}")
            problems += [f"{s.name}/{label}: {p}" for p in validate(cmd)] if args.dry_run else []
    if args.dry_run:
        for p in problems:
            print(error_line(p), file=sys.stderr)
        return 1 if problems else 0
    site = str(args.work / "site")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")]))}
    summary = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": f"{platform.node()}, {os.cpu_count()} CPUs",
               "command": " ".join(["python -m benchmarks gpu-check", *(argv if argv is not None else sys.argv[1:])]),
               "commit": commit(), "budget_s": args.budget_s, "steps": []}  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    for s in chosen:
        result = run_step(s, args, limits[s.name], env)
        print(f"{s.name}: {result['status']} ({result['seconds']:.0f} s)", flush=True)
        summary["steps"].append(result)
        if result.get("gpu"):  # the env step's probe: the machine's GPU and torch
            summary["machine"] += f", {result['gpu']}, torch {result['torch']}, NCCL {result['nccl']}"
        out.write_text(json.dumps(summary, indent=1, ensure_ascii=False))
    summary["result"] = ", ".join(f"{sum(r['status'].startswith(k) for r in summary['steps'])} {k}"
                                  for k in ("passed", "failed", "timed out", "skipped"))  # fmt: skip
    out.write_text(json.dumps(summary, indent=1, ensure_ascii=False))
    print(f"{summary['result']}; wrote {out}")
    return 0


if __name__ == "__main__" and sys.argv[1:2] in (["_step"], ["_titan"]):
    from benchmarks.gpu_check_steps import child

    sys.exit(child(sys.argv[1:]))
elif __name__ == "__main__":
    sys.exit(main())
