"""The steps of `python -m benchmarks gpu-check` (benchmarks/gpu_check.py), each run in a process of
its own: `python -m benchmarks.gpu_check _step NAME --work DIR`. A step prints `PART {json}` as each
of its checks ends (a step cut at its limit keeps them) and `RESULT {json}` with its status last."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.gpu_check import BF16_REL, CASE, KEPT, ROOT, TITAN_NEEDS, compared, plan

WORDS = (
    "the king and queen of a land far away went to see the sea with their horse dog cat bird "
    "under sun moon and then they sang of old times while rain fell on green hills"
).split()


def part(**found) -> dict:
    print("PART " + json.dumps(found), flush=True)
    return found


def sh(argv: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    full = {**os.environ, "NPROC": "1", "PYTHON": sys.executable, **(env or {})}
    return subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=full)


def tail(proc: subprocess.CompletedProcess, lines: int = 3) -> str:
    return " | ".join((proc.stderr.strip() or proc.stdout.strip()).splitlines()[-lines:])[-600:]


def has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


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


def fresh(work: Path, *runs: str) -> None:
    """No earlier run's folders: a run finds its own checkpoints there and resumes from them."""
    for run in runs:
        shutil.rmtree(work / run, ignore_errors=True)


def losses(folder: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (folder / "metrics.jsonl").read_text().splitlines()]


def rel_gap(a: list[float], b: list[float]) -> float:
    if len(a) != len(b) or not a:
        return float("inf")
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def env_step(ctx) -> dict:
    cmds = {label: (cmd, env) for label, cmd, env in plan("env", ctx)}
    for label in ("wheels", "install"):
        if label == "install" and importlib.util.find_spec("torchacco.models") is not None:
            continue  # an install (editable or not) is already there
        if label in cmds:
            proc = sh(*cmds[label])
            if part(check=label, ok=proc.returncode == 0, output=tail(proc))["ok"] is False:
                return {"status": f"failed: {label}: {tail(proc, 1)}"}
    proc = sh(*cmds["probe"])
    if proc.returncode != 0:
        return {"status": f"failed: probe: {tail(proc, 1)}"}
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    problems = [f"torch {info['torch']} is not a CUDA build (install a +cu torch there)"] * (not info["cuda_build"])
    problems += ["no GPU visible to torch"] * (not info["gpu"])
    problems += [f"missing modules: {', '.join(info['missing'])} (carry them: gpu_wheels.sh)"] * bool(info["missing"])
    return {"status": "failed: " + "; ".join(problems) if problems else "passed", **info}


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
    runs = plan("parity", ctx)
    fresh(ctx.work, "start", *(label for label, _, _ in runs[1:-1]), "acco_resumed")
    problems = []
    # the start run first (it also trains the tokenizer every run shares), the pairs side by side
    for batch in (runs[:1], runs[1:-1], runs[-1:]):
        with ThreadPoolExecutor(len(batch)) as pool:
            procs = list(pool.map(lambda r: sh(r[1], r[2]), batch))
        for (label, _, _), proc in zip(batch, procs):
            if proc.returncode != 0:
                problems.append(f"{label}: exit {proc.returncode}: {tail(proc, 1)}")
                part(check=label, ok=False, output=tail(proc))
        if problems:
            return {"status": "failed: " + "; ".join(problems)}
    hf = ctx.work / "start" / "hf"
    exported = sorted(p.name for p in hf.iterdir())
    if not part(check="export", ok="config.json" in exported and any(p.endswith(".safetensors") for p in exported),
                files=exported)["ok"]:  # fmt: skip
        problems.append(f"the export holds {exported}: no config.json with safetensors")
    for kind in compared():
        gpu, cpu = losses(ctx.work / f"{kind}_cuda"), losses(ctx.work / f"{kind}_cpu")
        gap = rel_gap(gpu, cpu)
        if not part(check=f"{kind} cuda vs cpu", ok=gap <= BF16_REL, gap=gap, cuda=gpu, cpu=cpu)["ok"]:
            problems.append(f"{kind}: the CUDA losses are {gap:.3g} from the CPU's (allowed {BF16_REL})")
    full, resumed = losses(ctx.work / "acco_cuda")[3:], losses(ctx.work / "acco_resumed")
    gap = rel_gap(resumed, full)
    if not part(check="resume from a CUDA checkpoint", ok=gap <= BF16_REL, gap=gap, full=full, resumed=resumed)["ok"]:
        problems.append(f"resume: steps 4-6 are {gap:.3g} from the uninterrupted run's")
    return {"status": "failed: " + "; ".join(problems) if problems else "passed", "tolerance": BF16_REL}


def throughput_step(ctx) -> dict:
    if not has_gpu():
        return {"status": "skipped: no GPU"}
    (_, mfu_cmd, _), (_, overlap_cmd, _) = plan("throughput", ctx)
    ref_mfu = next(r["mfu"] for r in json.loads((ROOT / "bench_results/gpu_mfu.json").read_text())
                   if r["name"] == CASE["name"])  # fmt: skip
    ref_overlap = json.loads((ROOT / "bench_results/gpu_overlap.json").read_text())["overlap"]
    problems = []
    proc = sh(mfu_cmd)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        problems.append(f"{CASE['name']}: {tail(proc, 1)}")
    else:
        got = json.loads(line[7:])
        (ctx.work / "throughput.json").write_text(json.dumps(got))  # step 6 compares against it
        ok = got["mfu"] >= KEPT * ref_mfu
        part(check="mfu", ok=ok, mfu=got["mfu"], reference=ref_mfu, tokens_per_s=got["tokens_per_s"],
             peak_memory_gib=got["peak_memory_gib"], device=got["device"], torch=got["torch"])  # fmt: skip
        problems += [] if ok else [f"MFU {got['mfu']:.1%} under {KEPT:.0%} of {ref_mfu:.1%}"]
    proc = sh(overlap_cmd)
    if proc.returncode != 0:
        problems.append(f"overlap: {tail(proc, 1)}")
    else:
        got = json.loads((ctx.work / "gpu_overlap.json").read_text())
        ok = got["overlap"] >= KEPT * ref_overlap
        part(check="overlap", ok=ok, overlap=got["overlap"], reference=ref_overlap)
        problems += [] if ok else [f"overlap {got['overlap']:.1%} under {KEPT:.0%} of {ref_overlap:.1%}"]
    return {"status": "failed: " + "; ".join(problems) if problems else "passed"}


def stall_step(ctx) -> dict:
    if not has_gpu():
        return {"status": "skipped: no GPU"}
    corpus(ctx.work)
    fresh(ctx.work, "stall")
    (_, cmd, env), = plan("stall", ctx)  # fmt: skip
    started = time.monotonic()
    proc = sh(cmd, env)
    errors = [x for x in proc.stderr.splitlines() if x.startswith("torchacco: error:")]
    recorder = ctx.work / "stall" / "flight_recorder"
    dumps = sorted(p.name for p in recorder.iterdir()) if recorder.is_dir() else []
    diagnosed = proc.returncode != 0 and len(errors) == 1 and "made no progress" in errors[0]
    part(check="diagnosis", ok=diagnosed, lines=errors, traceback="Traceback" in proc.stderr,
         seconds=round(time.monotonic() - started, 1))  # fmt: skip
    part(check="flight recorder", ok=bool(dumps), files=dumps)
    problems = [] if diagnosed else [f"no one-line diagnosis (exit {proc.returncode}: {tail(proc, 1)})"]
    problems += [] if dumps else [f"nothing in {recorder}"]
    return {"status": "failed: " + "; ".join(problems) if problems else "passed"}


def titan_step(ctx) -> dict:
    missing = [m for m in TITAN_NEEDS if importlib.util.find_spec(m) is None]
    assets = [str(ctx.titan_assets / "tests/assets" / a) for a in ("tokenizer", "c4_test")]
    missing += [a for a in assets if not Path(a).is_dir()]
    if missing:
        return {"status": f"skipped: torchtitan cannot run here: missing {', '.join(missing)}"}
    if not has_gpu():
        return {"status": "skipped: no GPU"}
    from importlib.metadata import version

    if version("torchtitan") != "0.3.0":
        return {"status": f"skipped: torchtitan {version('torchtitan')} is installed; the comparison is for 0.3.0"}
    (_, cmd, _), = plan("torchtitan", ctx)  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    text = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)  # torchtitan colours its log
    tps = [float(t.replace(",", "")) for t in re.findall(r"tps: ([\d,]+)", text)]
    peak = re.search(r"^TITAN_PEAK_GIB ([\d.]+)$", proc.stdout, re.M)
    if proc.returncode != 0 or len(tps) < 5 or not peak:
        return {"status": f"failed: torchtitan: {tail(proc, 1)}"}
    found = {"titan_tokens_per_s": sum(tps[3:]) / len(tps[3:]), "titan_peak_memory_gib": float(peak[1])}
    ours = ctx.work / "throughput.json"  # step throughput's measurement of the same case
    if not ours.exists():
        return {"status": "passed: torchtitan measured; no torchacco figure (run step throughput)", **found}
    mine = json.loads(ours.read_text())
    found["tokens_per_s_ratio"] = mine["tokens_per_s"] / found["titan_tokens_per_s"]  # torchacco / torchtitan
    found["peak_memory_ratio"] = mine["peak_memory_gib"] / found["titan_peak_memory_gib"]
    return {"status": "passed", **found}


def titan_run(ctx) -> int:
    """torchtitan 0.3.0 on CASE in this process (a world of 1): its Llama 3 8B config cut to 8 layers,
    seq 8192 × 2, selective AC, compiled, bf16 compute with fp32 parameters, as torchacco's case.
    Its own test assets hold the tokenizer and the data (the machine has no network)."""
    from torchtitan.config import CompileConfig
    from torchtitan.models.llama3.config_registry import llama3_8b

    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1").items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", "29537")
    os.chdir(ctx.titan_assets)  # its configs name ./tests/assets/... relative to the working directory
    cfg = llama3_8b()
    cfg.model_spec.model.layers = cfg.model_spec.model.layers[: CASE["layers"]]
    cfg.hf_assets_path, cfg.dataloader.dataset = "./tests/assets/tokenizer", "c4_test"
    cfg.training.seq_len, cfg.training.local_batch_size, cfg.training.steps = CASE["seq"], CASE["batch"], 12
    cfg.compile = CompileConfig(enable=CASE["compile"])
    cfg.profiler.enable_profiling, cfg.metrics.enable_tensorboard, cfg.metrics.log_freq = False, False, 1
    cfg.checkpoint.enable, cfg.validator.enable, cfg.dump_folder = False, False, str(ctx.work / "titan")
    import torch

    # torchtitan resets the peak at each log line; kept, the peak is the whole run's, as torchacco's
    # memory_gib (the most allocated, not reserved)
    torch.cuda.reset_peak_memory_stats = lambda *args, **kwargs: None
    trainer = cfg.build()
    trainer.train()
    trainer.close()
    print(f"TITAN_PEAK_GIB {torch.cuda.max_memory_allocated() / 2**30:.3f}", flush=True)
    return 0


STEPS = {"env": env_step, "cuda-tests": cuda_tests_step, "parity": parity_step, "throughput": throughput_step,
         "stall": stall_step, "torchtitan": titan_step}  # fmt: skip


def child(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=("_step", "_titan"))
    parser.add_argument("name", nargs="?")
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--wheels", type=Path, default=ROOT / ".whl-gpu")
    parser.add_argument("--titan-assets", type=Path, default=ROOT / ".whl-gpu" / "titan")
    ctx = parser.parse_args(argv)
    if ctx.what == "_titan":
        return titan_run(ctx)
    result = STEPS[ctx.name](ctx)
    print("RESULT " + json.dumps(result), flush=True)
    return 0
