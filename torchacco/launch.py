"""torchrun, minus its tracebacks: a failed worker already printed why, and a rendezvous that times out gets one
line saying what to check. A `-m torchacco.train` launch first checks its config here, so a mistake is one line
before any worker starts. With [preemption], torchrun forwards the configured signals to the workers
(`--signals-to-handle`) and waits `--shutdown-timeout` before it SIGKILLs them: the launcher sets both from the
config, and exits with the requeue code."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch.distributed.run as torchrun_module
from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, LogsDest, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousError
from torch.distributed.run import get_args_parser
from torch.distributed.run import main as torchrun

from torchacco import fault_tolerance
from torchacco.config import Config, load_config
from torchacco.data import home_cache_warning
from torchacco.errors import ERRORS_DIR, UserError, print_error
from torchacco.preemption import exit_code, parse_signals
from torchacco.validate import main as validate


def describe(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def _train_args(argv: list[str]):
    """torchrun's parsed `argv` when it launches `-m torchacco.train`; None for another program."""
    args = get_args_parser().parse_args(argv)
    return args if args.module and args.training_script == "torchacco.train" else None


def check_training_config(argv: list[str]) -> int:
    """Validate `-m torchacco.train ARGS` for the world the launch will start; 0 if fine."""
    if (args := _train_args(argv)) is None:
        return 0
    try:
        nodes, per_node = int(str(args.nnodes).rpartition(":")[2]), int(args.nproc_per_node)
    except ValueError:
        return 0  # "auto" or "gpu" process counts: the workers check once they know
    return validate(args.training_script_args, world_size=nodes * per_node, local_world_size=per_node)


def forward_preemption_signals(argv: list[str], cfg: Config) -> list[str]:
    """torchrun options that forward [preemption] signals to the workers and give them grace_s to stop
    before torchrun's SIGKILL (explicit torchrun settings of the user's win)."""
    args = get_args_parser().parse_args(argv)
    handled = [name.strip() for name in args.signals_to_handle.split(",") if name.strip()]
    handled += [s.name for s in parse_signals(cfg.preemption.signals) if s.name not in handled]
    extra = ["--signals-to-handle", ",".join(handled)]
    if not hasattr(args, "shutdown_timeout"):  # an older torchrun: a fixed 30 s before its SIGKILL
        if cfg.preemption.grace_s + 15 > 30:
            print(f"torchacco: warning: this torch's torchrun has no --shutdown-timeout and kills the workers 30 s "
                  f"after a preemption signal; [preemption] grace_s = {cfg.preemption.grace_s:g} may be cut short "
                  "(a newer torch waits it out)", file=sys.stderr)  # fmt: skip
        return extra + argv
    if args.shutdown_timeout is None and "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in os.environ:
        extra += ["--shutdown-timeout", str(math.ceil(cfg.preemption.grace_s) + 15)]  # past the workers' watchdog
    return extra + argv


class RankLogs(DefaultLogsSpecs):
    """Each worker's stdout and stderr in <log_dir>/rank_<global rank>.{out,err} (a restart's under restart_<k>/),
    teed to the console with a `[rank N]: ` prefix; torchrun's own layout names local ranks in random folders."""

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        restart = next(iter(envs.values()), {}).get("TORCHELASTIC_RESTART_COUNT", "0")
        folder = Path(self.root_log_dir) / (f"restart_{restart}" if restart != "0" else "")
        folder.mkdir(parents=True, exist_ok=True)
        base = {local: str(folder / f"rank_{env['RANK']}") for local, env in envs.items()}
        out, err, errors = ({local: b + end for local, b in base.items()} for end in (".out", ".err", ".error.json"))
        for local, env in envs.items():
            env["TORCHELASTIC_ERROR_FILE"] = errors[local]
        return LogsDest(out, err, dict(out), dict(err), errors, os.devnull, os.devnull)


def rank_logs(argv: list[str], cfg: Config) -> list[str]:
    """torchrun options for per-rank logs under <dump_folder>/logs (RANK_LOGS=0, or the user's own --log-dir,
    --tee or --redirects, keeps torchrun's console as it is)."""
    args = get_args_parser().parse_args(argv)
    own = args.log_dir or args.tee != "0" or args.redirects != "0"
    if os.environ.get("RANK_LOGS", "1") == "0" or own or not hasattr(torchrun_module, "_get_logs_specs_class"):
        return argv
    replica = fault_tolerance.replica_of_job()
    folder = Path(cfg.job.dump_folder, "logs", *([f"replica_{replica}"] if replica is not None else []))
    os.environ.setdefault("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[rank${rank}]: ")
    # torchrun picks its LogsSpecs by entry-point name; the launcher's own class stands in for the default
    default = torchrun_module._get_logs_specs_class
    torchrun_module._get_logs_specs_class = lambda name: RankLogs if name is None else default(name)
    return ["--log-dir", str(folder.absolute()), "--tee", "3", *argv]


def launch_replicas(args, cfg: Config) -> int:
    """[diloco] fault_tolerant on one machine: torchft's lighthouse in this process, then one torchrun agent per
    replica (each restarts its replica's ranks up to --max-restarts times); 0 once a replica finished the run."""
    replicas, d = cfg.parallelism.replicas, cfg.diloco
    nodes, per_node = int(str(args.nnodes).rpartition(":")[2]), int(args.nproc_per_node)
    if nodes > 1:
        print_error("[diloco] fault_tolerant over several nodes: launch each replica's nodes as a job of their own, "
                    f"with {fault_tolerance.ENV_REPLICA}=r and {fault_tolerance.ENV_LIGHTHOUSE} set "
                    "(docs/reliability.md)")  # fmt: skip
        return 1
    server = fault_tolerance.start_lighthouse(d.min_replicas, d.join_timeout_s)
    print(f"torchacco: lighthouse at {server.address()}; {replicas} replicas of {per_node // replicas} ranks, each "
          f"restarted up to {args.max_restarts} times", flush=True)  # fmt: skip
    jobs = []
    for r in range(replicas):
        env = {**os.environ, fault_tolerance.ENV_REPLICA: str(r), fault_tolerance.ENV_LIGHTHOUSE: server.address()}
        agent = ["--standalone", "--nnodes", "1", "--nproc_per_node", str(per_node // replicas),
                 "--max-restarts", str(args.max_restarts), "-m", "torchacco.train"]  # fmt: skip
        agent += args.training_script_args
        jobs.append(subprocess.Popen([sys.executable, "-m", "torchacco.launch", *agent], env=env))
    try:
        codes = [job.wait() for job in jobs]
    except KeyboardInterrupt:
        for job in jobs:
            job.terminate()
        codes = [job.wait() for job in jobs]
    finally:
        server.shutdown()
    failed = [r for r, code in enumerate(codes) if code]
    if len(failed) == replicas:
        return codes[0]
    if failed:
        print(f"torchacco: warning: replica(s) {', '.join(map(str, failed))} failed for good; the others finished the "
              "run (their messages are above)", file=sys.stderr, flush=True)  # fmt: skip
    return 0


def unprinted_errors(folder: Path) -> list[str]:
    """The workers' error lines (torchacco.errors.record_error) that no rank printed, each once with its ranks."""
    found = {int(p.stem[5:]): json.loads(p.read_text()) for p in folder.glob("rank_*.json")}
    printed, ranks = {e["line"] for e in found.values() if e["printed"]}, defaultdict(list)
    for rank, e in sorted(found.items()):
        if e["line"] not in printed:
            ranks[e["line"]].append(str(rank))
    return [f"{line} (rank{'s' * (len(r) > 1)} {', '.join(r)})" for line, r in ranks.items()]


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="torchacco-errors-") as folder:
        os.environ[ERRORS_DIR] = folder
        return launch(Path(folder))


def launch(errors: Path) -> int:
    argv = sys.argv[1:]
    if check_training_config(argv):
        return 1
    args, requeue = _train_args(argv), {}
    with contextlib.suppress(UserError):  # a config the workers will reject: they say why
        cfg = load_config(args.training_script_args) if args else None
        ft = cfg is not None and cfg.diloco.fault_tolerant and cfg.parallelism.replicas > 1
        if ft and fault_tolerance.replica_of_job() is None:
            return launch_replicas(args, cfg)
        if cfg is not None:
            argv = rank_logs(argv, cfg)
            if warning := home_cache_warning(cfg.data):
                print(f"torchacco: warning: {warning}", file=sys.stderr, flush=True)
        if cfg is not None and cfg.preemption.enable:
            argv = forward_preemption_signals(argv, cfg)
            signals = parse_signals(cfg.preemption.signals)
            requeue = {s: exit_code(cfg.preemption, cfg.checkpoint.enable, s) for s in signals}  # a stop's exit code
    try:
        torchrun(argv)
    except SignalException as e:
        # torchrun forwarded the signal and waited for the workers; rank 0 said where they stopped.
        return requeue.get(e.sigval, 128 + e.sigval)
    except ChildFailedError as e:
        # The workers got a preemption signal without the launcher (or before it) and stopped on their own.
        stopped = [f.exitcode for f in e.failures.values() if f.exitcode in requeue.values()]
        if stopped:
            return stopped[0]
        for line in unprinted_errors(errors):
            print(line, file=sys.stderr)
        rank, failure = min(e.failures.items())
        print(f"torchacco: {len(e.failures)} worker(s) failed (first: rank {rank}, "
              f"{describe(failure.exitcode)}); see the messages above", file=sys.stderr)  # fmt: skip
        return 1
    except RendezvousError as e:
        print_error(f"the nodes did not all join the rendezvous ({type(e).__name__}: "
                    f"{str(e).strip().splitlines()[0][:200] if str(e).strip() else 'no detail'}); "
                    "check that NNODES nodes were started with the same MASTER_ADDR, MASTER_PORT and "
                    "RDZV_ID, that node 0 is reachable on MASTER_PORT, and RDZV_TIMEOUT")  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":  # torchrun's agent, started by path (torchacco/__main__.py says why this entry stays)
    from torchacco.__main__ import finish

    finish(main())
