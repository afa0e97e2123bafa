"""The cluster on this machine: builds a plan's namespaces, links and cgroups, runs commands inside a
node, and always tears everything down (in `finally`, on SIGINT/SIGTERM and at exit)."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.cluster import host
from benchmarks.cluster.plan import ClusterPlan

ROOT = Path(__file__).resolve().parents[2]


class Cluster:
    def __init__(self, plan: ClusterPlan, verbose: bool = False):
        self.plan, self.verbose, self._built, self._old_handlers = plan, verbose, False, {}
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Cluster:
        quotas = any(self.plan.cores(i) is not None for i in range(self.plan.nodes))
        kind = host.preflight(need_cgroup=quotas, need_netem=bool(self.plan.latency_ms))
        if kind:
            self.plan.cgroup = kind
        for name in host.stale_namespaces():
            host.run_quietly(["ip", "netns", "del", name])
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        atexit.register(self.teardown)
        self._built = True
        try:
            for cmd in self.plan.setup_commands():
                if self.verbose:
                    print("+", " ".join(cmd), file=sys.stderr)
                host.run(cmd)
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def _on_signal(self, signum, frame):
        self.teardown()
        raise KeyboardInterrupt if signum == signal.SIGINT else SystemExit(128 + signum)

    def launch(self, i: int, argv: list[str], env: dict | None = None, log: Path | None = None) -> subprocess.Popen:
        """Run argv inside node i's namespace (and CPU cgroup); a new session so it is killed as a group."""
        procs_file = str(self.plan.cgroup_dir(i) / "cgroup.procs") if self.plan.cores(i) is not None else None

        def enter_cgroup():  # runs in the child before exec: everything it starts inherits the quota
            if procs_file:
                with open(procs_file, "w") as f:
                    f.write(str(os.getpid()))

        out = open(log, "w") if log else subprocess.DEVNULL
        try:
            proc = subprocess.Popen(self.plan.node_command(i, argv), env=env, cwd=ROOT, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    preexec_fn=enter_cgroup)  # fmt: skip
        finally:
            if log:
                out.close()
        self.procs.append(proc)
        return proc

    def teardown(self) -> None:
        """Kill the launched process groups (SIGTERM, then SIGKILL after 10 s), remove what was built."""
        if not self._built:
            return
        self._built = False
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs = []
        for cmd in self.plan.teardown_commands():
            host.run_quietly(cmd)
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers = {}
        atexit.unregister(self.teardown)
