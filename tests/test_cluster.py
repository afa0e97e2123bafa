"""The emulated cluster: plans (pure data → commands), teardown, result parsing, error lines; and a
2-node smoke run over real namespaces when root and network namespaces are available."""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, tiny_args

from benchmarks import cluster as cl
from benchmarks.cluster import ClusterError, ClusterPlan, format_rate, host, launch, parse_rate
from torchacco.errors import UserError


def test_parse_and_format_rate():
    assert parse_rate("50mbit") == 50e6
    assert parse_rate("1.5Gbit") == 1.5e9
    assert parse_rate("10gbit") == 10e9
    assert parse_rate(2e8) == 2e8
    for unshaped in (None, "", "unshaped", "none"):
        assert parse_rate(unshaped) is None
    for bad in ("fast", "-1mbit", "0mbit", "10 parsecs"):
        with pytest.raises(UserError, match="link rate"):
            parse_rate(bad)
    assert format_rate(50e6) == "50mbit" and format_rate(1e9) == "1gbit" and format_rate(None) == "unshaped"
    assert parse_rate(format_rate(137e6)) == 137e6


def test_plan_builds_isolated_namespaces_and_shapes_both_directions():
    plan = ClusterPlan(nodes=3, rate_bps=100e6, prefix="t1")
    cmds = [" ".join(c) for c in plan.setup_commands()]
    # a switch namespace with a bridge; nothing is created in the host's namespace
    assert cmds[0] == "ip netns add t1sw"
    assert "ip -n t1sw link add br0 type bridge" in cmds
    for i in range(3):
        assert f"ip netns add t1n{i}" in cmds
        assert f"ip -n t1sw link add p{i} type veth peer name eth0 netns t1n{i}" in cmds
        assert f"ip -n t1n{i} addr add 10.77.0.{i + 1}/24 dev eth0" in cmds
        assert f"ip -n t1n{i} link set lo up" in cmds
        # upload (node side) and download (switch side) are both shaped
        assert any(
            c.startswith(f"ip netns exec t1n{i} tc qdisc add dev eth0 root") and "tbf rate 100000000bit" in c
            for c in cmds
        )
        assert any(c.startswith(f"ip netns exec t1sw tc qdisc add dev p{i} root") and "tbf" in c for c in cmds)
    for c in plan.setup_commands():
        if c[0] == "ip" and c[1] != "netns":
            assert c[1] == "-n", c  # every link/addr command names a namespace
    assert not any("cgroup" in c for c in cmds)  # no quota asked


def test_plan_without_shaping_or_quota_has_no_tc_and_no_cgroup():
    plan = ClusterPlan(nodes=2, prefix="t2")
    assert not any("tc" in c for c in plan.setup_commands())
    assert all(plan.cores(i) is None for i in range(2))
    assert [" ".join(c) for c in plan.teardown_commands()] == [
        "ip netns del t2n0",
        "ip netns del t2n1",
        "ip netns del t2sw",
    ]


def test_tcp_slow_start_after_idle_is_linux_default_unless_turned_off_on_every_node():
    sysctl = "net.ipv4.tcp_slow_start_after_idle=0"
    assert not any(sysctl in c for c in ClusterPlan(nodes=2, prefix="t3").setup_commands())
    plan = ClusterPlan(nodes=2, prefix="t3", tcp_slow_start_after_idle=False)
    assert [c[:4] for c in plan.setup_commands() if sysctl in c] == [["ip", "netns", "exec", f"t3n{i}"] for i in (0, 1)]
    assert "no TCP slow start after idle" in plan.describe()


def test_tbf_burst_is_at_least_rate_over_hz():
    (cmd,) = ClusterPlan(nodes=2, rate_bps=10e9, prefix="t3").shaping_commands("x", "eth0")
    burst = int(cmd[cmd.index("burst") + 1])
    assert burst >= 10e9 / 8 / 250  # enough tokens for a 250 Hz kernel tick
    (slow,) = ClusterPlan(nodes=2, rate_bps=1e6, prefix="t3").shaping_commands("x", "eth0")
    assert int(slow[slow.index("burst") + 1]) >= 1514  # at least one frame


def test_latency_uses_netem_under_tbf():
    cmds = ClusterPlan(nodes=2, rate_bps=1e8, latency_ms=5, prefix="t4").shaping_commands("x", "eth0")
    assert "netem delay 5ms" in " ".join(cmds[0])
    assert cmds[1][cmds[1].index("add") + 3 : cmds[1].index("add") + 5] == ["parent", "1:1"]


def test_slow_node_gets_a_cpu_quota_v1_and_v2():
    plan = ClusterPlan(nodes=4, slow_node=3, slow_factor=4, cpu_per_node=0.5, prefix="t5")
    assert [plan.cores(i) for i in range(4)] == [0.5, 0.5, 0.5, 0.125]
    writes = {c[1]: c[2] for c in plan.setup_commands() if c[0] == "write"}
    assert writes["/sys/fs/cgroup/cpu/t5n3/cpu.cfs_quota_us"] == "12500"
    assert writes["/sys/fs/cgroup/cpu/t5n0/cpu.cfs_quota_us"] == "50000"
    assert writes["/sys/fs/cgroup/cpu/t5n0/cpu.cfs_period_us"] == "100000"
    assert ["rmdir", "/sys/fs/cgroup/cpu/t5n3"] in plan.teardown_commands()
    v2 = ClusterPlan(nodes=2, slow_node=1, slow_factor=4, prefix="t6", cgroup="v2")
    assert v2.cores(0) is None and v2.cores(1) == 0.25
    writes = {c[1]: c[2] for c in v2.setup_commands() if c[0] == "write"}
    assert writes == {"/sys/fs/cgroup/t6n1/cpu.max": "25000 100000"}


def test_a_short_cpu_period_grants_the_same_share_in_finer_slices_and_refuses_a_quota_under_1_ms():
    plan = ClusterPlan(nodes=2, slow_node=1, slow_factor=8, prefix="t7", cgroup="v2", cpu_period_us=10_000)
    writes = {c[1]: c[2] for c in plan.setup_commands() if c[0] == "write"}
    assert writes == {"/sys/fs/cgroup/t7n1/cpu.max": "1250 10000"}
    assert "node1 0.125 cores per 10 ms" in plan.describe()
    v1 = ClusterPlan(nodes=2, cpu_per_node=0.5, prefix="t7", cpu_period_us=20_000)
    writes = {c[1]: c[2] for c in v1.setup_commands() if c[0] == "write"}
    assert writes["/sys/fs/cgroup/cpu/t7n0/cpu.cfs_period_us"] == "20000"
    assert writes["/sys/fs/cgroup/cpu/t7n0/cpu.cfs_quota_us"] == "10000"
    with pytest.raises(ClusterError, match="node 1's 0.125 cores are under the kernel's 1 ms quota"):
        ClusterPlan(nodes=2, slow_node=1, slow_factor=8, prefix="t7", cpu_period_us=5000)
    with pytest.raises(ClusterError, match="between 1 and 1000"):
        ClusterPlan(nodes=2, prefix="t7", cpu_period_us=500)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(nodes=0), "--nodes"),
        (dict(slow_node=5), "--slow-node"),
        (dict(slow_factor=0.5), "--slow-factor"),
        (dict(cpu_per_node=0), "--cpu-per-node"),
        (dict(prefix="Bad-Name"), "prefix"),
        (dict(subnet="192.168.1"), "subnet"),
        (dict(latency_ms=-1), "--latency-ms"),
        (dict(ranks_per_node=0), "--ranks-per-node"),
    ],
)
def test_plan_rejects_mistakes_with_one_line(kwargs, message):
    with pytest.raises(ClusterError, match=message):
        ClusterPlan(**{"prefix": "t7", **kwargs})


def test_32_ranks_as_8_nodes_of_4_with_the_link_inside_a_node_shaped_apart():
    plan = ClusterPlan(nodes=8, ranks_per_node=4, rate_bps=100e6, node_rate_bps=2e9, prefix="t32")
    cmds = [" ".join(c) for c in plan.setup_commands()]
    assert plan.world_size == 32 and plan.describe().startswith("8 nodes of 4 ranks (2gbit inside)")
    for i in range(8):
        inside = [c for c in cmds if c.startswith(f"ip netns exec t32n{i} tc qdisc add dev lo root")]
        assert len(inside) == 1 and "tbf rate 2000000000bit" in inside[0]
        assert int(inside[0].split(" burst ")[1].split()[0]) >= 65_536  # loopback's packets pass its bucket
        assert any(c.startswith(f"ip netns exec t32n{i} tc qdisc add dev eth0 root") and "rate 100000000bit" in c
                   for c in cmds)  # fmt: skip
        argv = " ".join(launch.train_argv(plan, i, [], 29400, python="py"))
        assert f"--nnodes 8 --node_rank {i} --nproc_per_node 4" in argv
    unshaped = ClusterPlan(nodes=2, ranks_per_node=4, rate_bps=100e6, prefix="t33")
    assert not any("dev lo" in " ".join(c) for c in unshaped.setup_commands())


def test_train_argv_rendezvous_at_node0_with_the_plans_ranks_per_node():
    plan = ClusterPlan(nodes=3, prefix="t8")
    argv = launch.train_argv(plan, 2, ["--config", "x.toml"], port=29411, python="py")
    text = " ".join(argv)
    assert text.startswith("py -m torchacco.launch --nnodes 3 --node_rank 2 --nproc_per_node 1")
    assert "--rdzv_endpoint 10.77.0.1:29411" in text and "--local_addr 10.77.0.3" in text
    assert "is_host=0" in text and "is_host=1" in " ".join(launch.train_argv(plan, 0, [], 1, python="py"))
    assert argv[-2:] == ["--config", "x.toml"]
    assert plan.node_command(2, ["a"]) == ["ip", "netns", "exec", "t8n2", "a"]
    two = ClusterPlan(nodes=3, ranks_per_node=2, prefix="t8")
    assert "--nproc_per_node 2" in " ".join(launch.train_argv(two, 1, [], 1, python="py")) and two.world_size == 6
    assert two.describe().startswith("3 nodes of 2 ranks")
    env = launch.node_env(1)
    assert env["GLOO_SOCKET_IFNAME"] == "eth0" and env["OMP_NUM_THREADS"] == "1" and "MASTER_ADDR" not in env


def test_teardown_runs_every_command_even_when_some_fail(monkeypatch):
    ran = []

    def run(cmd, **kwargs):  # every other command fails, as a namespace already gone would
        ran.append(cmd)
        if len(ran) % 2:
            raise subprocess.TimeoutExpired(cmd, 30)  # a hung `ip`: run_quietly must go on

    monkeypatch.setattr(host.subprocess, "run", run)
    plan = ClusterPlan(nodes=2, slow_node=1, prefix="t9")
    cluster = cl.Cluster(plan)
    cluster._built = True
    cluster.teardown()
    assert ran == plan.teardown_commands()
    cluster.teardown()  # idempotent: nothing more
    assert len(ran) == len(plan.teardown_commands())


def test_setup_failure_tears_down_what_was_built(monkeypatch):
    calls = []
    monkeypatch.setattr(host, "preflight", lambda **kw: "v1")
    monkeypatch.setattr(host, "stale_namespaces", lambda: [])

    def fake_run(cmd, what=None):
        calls.append(("setup", cmd))
        if len(calls) == 3:
            raise ClusterError("boom")

    monkeypatch.setattr(host, "run", fake_run)
    monkeypatch.setattr(host, "run_quietly", lambda cmd: calls.append(("teardown", cmd)))
    with pytest.raises(ClusterError, match="boom"):
        with cl.Cluster(ClusterPlan(nodes=2, prefix="t10")):
            pass
    assert [c for kind, c in calls if kind == "teardown"] == ClusterPlan(nodes=2, prefix="t10").teardown_commands()


def test_preflight_says_root_is_needed(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ClusterError, match="needs root"):
        cl.preflight()


def test_result_parsing(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "loss": 2.0}) + "\n\n" + json.dumps({"step": 2, "loss": 1.5}) + "\n"
    )
    (tmp_path / "rank10.json").write_text(json.dumps({"rank": 10, "peak_rss_gib": 0.5}))
    (tmp_path / "rank2.json").write_text(json.dumps({"rank": 2, "peak_rss_gib": 0.4}))
    (tmp_path / "rank3.json").write_text("{not json")
    assert [r["step"] for r in launch.read_records(tmp_path)] == [1, 2]
    assert [r["rank"] for r in launch.read_rank_reports(tmp_path)] == [2, 10]
    with pytest.raises(ClusterError, match="no metrics.jsonl"):
        launch.read_records(tmp_path / "missing")
    log = tmp_path / "node1.log"
    log.write_text("noise\ntorchacco: error: the link broke\nTraceback ...\nmore\n")
    assert launch._last_error(log) == "the link broke"


def test_summaries_and_curves():
    from benchmarks.cluster import summarize
    from benchmarks.yardstick.end_to_end import val_curve

    recs = [
        {
            "step": i,
            "tokens": 1000 * i,
            "tokens_per_update": 1000,
            "tokens_per_s": 500.0,
            "share_sync": 0.25,
            "loss": 3.0 - i / 10,
            **({"val_loss": 3.5 - i / 10} if i % 2 == 0 else {}),
        }
        for i in range(1, 5)
    ]
    s = summarize(recs, 1)
    assert s["steps"] == 3 and s["tokens_per_s"] == pytest.approx(500) and s["step_time_s"] == pytest.approx(2.0)
    assert s["exposed_comm_s"] == pytest.approx(0.5)
    curve = val_curve(recs)
    assert [(p["tokens"], p["wall_s"]) for p in curve] == [(2000, 4.0), (4000, 8.0)]


@pytest.mark.integration
def test_cli_errors_are_one_line():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.cluster", "--rate", "fast", "--dry-run"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 1 and proc.stderr.strip().count("\n") == 0
    assert proc.stderr.startswith("torchacco: error: cannot read link rate")
    dry = subprocess.run(
        [sys.executable, "-m", "benchmarks.cluster", "--nodes", "2", "--rate", "1gbit", "--dry-run"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=60,
    )
    assert dry.returncode == 0 and "tbf rate 1000000000bit" in dry.stdout and "ip netns del" in dry.stdout


_NETNS = []


def _netns_available() -> str | None:
    if not _NETNS:
        _NETNS.append(_check_netns())
    return _NETNS[0]


def _check_netns() -> str | None:
    if sys.platform != "linux" or os.geteuid() != 0:
        return "needs root (network namespaces, tc)"
    try:
        cl.preflight(need_cgroup=True)  # the smoke test throttles a slow node
    except ClusterError as e:
        return str(e)
    return None


_SINK = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); print('ready', flush=True)
c, _ = s.accept(); n = 0
while True:
    b = c.recv(1 << 20)
    if not b: break
    n += len(b)
c.sendall(b'k'); print(n, flush=True)
"""
_SOURCE = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
buf = b'x' * (1 << 20); total = int(float(sys.argv[3]) * 2**20); t = time.perf_counter(); sent = 0
while sent < total:
    c.sendall(buf); sent += len(buf)
c.shutdown(socket.SHUT_WR); c.recv(1); print(sent * 8 / (time.perf_counter() - t), flush=True)
"""


def measure_link(cluster, src: int = 1, dst: int = 0, megabytes: float = 8, port: int = 29399) -> float:
    """Bits per second of one TCP stream from node src to node dst (checks the shaping)."""
    plan = cluster.plan
    sink = subprocess.Popen(plan.node_command(dst, [sys.executable, "-c", _SINK, plan.address(dst), str(port)]),
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        sink.stdout.readline()
        source = [sys.executable, "-c", _SOURCE, plan.address(dst), str(port), str(megabytes)]
        out = subprocess.run(plan.node_command(src, source), capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, f"node {src} cannot reach node {dst} at {plan.address(dst)}:{port}: {out.stderr}"
        return float(out.stdout.strip())
    finally:
        sink.kill()
        sink.wait()


@pytest.mark.integration
@pytest.mark.slow  # two emulated nodes built, trained on and removed
@pytest.mark.skipif(_netns_available() is not None, reason=str(_netns_available()))
def test_two_node_cluster_smoke(tiny_corpus, cache_dir, tmp_path):
    """2 namespaces, shaped links, rendezvous over 10.77.0.0/24, gloo between them; everything removed after."""
    plan = ClusterPlan(nodes=2, rate_bps=500e6, slow_node=1, slow_factor=2)
    with cl.Cluster(plan) as cluster:
        goodput = measure_link(cluster, megabytes=8)
        assert 0.5 * 500e6 < goodput < 1.3 * 500e6  # the tbf burst lets a short transfer exceed the rate a little
    args = tiny_args(tiny_corpus, cache_dir, tmp_path / "unused")
    args = args[: args.index("--job.dump_folder")]  # run_training chooses the folder
    args += ["--parallelism.data_parallel", "acco", "--training.global_batch_size", "16", "--training.steps", "4"]
    result = cl.run_training(plan, args, tmp_path / "run", timeout_s=240, port=29433)
    assert [r["step"] for r in result["records"]] == [1, 2, 3, 4]
    assert "overlap" in result["records"][-1]  # ACCO ran
    assert "val_loss" in result["records"][-1]
    assert sorted(r["rank"] for r in result["ranks"]) == [0, 1]
    assert {r["node_addr"] for r in result["ranks"]} == {"10.77.0.1", "10.77.0.2"}
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert plan.prefix not in names
    assert not plan.cgroup_dir(1).exists()  # v1 or v2, whichever the cluster used


def test_collective_probe_times_the_chosen_rings_until_every_rank_is_done(tmp_path):
    """One gloo rank (the rings fall back to gloo's own collectives), so it needs no namespaces."""
    import json
    import os
    import subprocess
    import sys

    from conftest import ROOT

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29000 + os.getpid() % 1000), "RANK": "0"}
    env |= {"WORLD_SIZE": "1", "TORCHACCO_NODE_REPORT_DIR": str(tmp_path)}
    argv = ["--numel", "4096", "--repeats", "2", "--ops", "ring_all_gather"]
    argv += ["--until", "all", "--stat", "mean"]
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.workers.collective_probe", *argv], env=env, cwd=ROOT, capture_output=True
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "collectives.json").read_text())
    assert result["until"] == "all"
    assert result["ring_all_gather_s"] > 0 and "all_reduce_s" not in result
    assert result["stat"] == "mean" and result["repeats"] == 2
    bad = subprocess.run([sys.executable, "-m", "benchmarks.workers.collective_probe", "--ops", "ring_all_gathr"],
                         env=env, cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    assert bad.returncode == 2 and "unknown collective 'ring_all_gathr'" in bad.stderr.splitlines()[-1]


def test_virtual_compute_runs_pass_the_scaled_calibration_and_name_the_slow_node(monkeypatch, tmp_path):
    found = {}
    monkeypatch.setattr(
        launch,
        "calibrate",
        lambda args, threads: {
            "forward_s": 0.01,
            "backward_s": 0.02,
            "block_share": 0.7,
            "optimizer_s_per_param": 1e-9,
        },
    )
    monkeypatch.setattr(launch.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, "", ""))

    def fake_nodes(plan, module, args, folder, timeout_s, port, threads, verbose, env):
        found.update(plan=plan, args=args, env=env)
        (folder / "metrics.jsonl").write_text('{"step": 1}\n')
        return 1.0

    monkeypatch.setattr(launch, "run_nodes", fake_nodes)
    plan = ClusterPlan(nodes=2, slow_node=1, slow_factor=3.0, cpu_per_node=1.0, prefix="tv")
    result = launch.run_training(plan, ["--config", "x.toml"], tmp_path, virtual_compute=True, virtual_scale=4.0)
    args = found["args"]
    assert args[args.index("--emulation.forward_s") + 1] == repr(0.04) and "--emulation.virtual_compute" in args
    assert args[args.index("--emulation.block_share") + 1] == repr(0.7)  # a share, not scaled
    assert found["env"]["TORCHACCO_SLOW_NODE"] == "1" and found["env"]["TORCHACCO_SLOW_FACTOR"] == "3.0"
    assert found["plan"].cores(1) == 1.0  # the slow node keeps its CPU: its waits are what is slow
    assert result["calibration"]["scale"] == 4.0
