"""Two nodes on this machine (two torchrun agents on loopback), each with a dump folder of its own
(as on node-local disks) or one shared folder."""

import pytest
from conftest import read_metrics, tiny_args, two_nodes

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # two nodes' runs, compared


def test_nodes_with_folders_of_their_own_train_and_refuse_checkpoints_there(tiny_corpus, cache_dir, tmp_path):
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    args = tiny_args(tiny_corpus, cache_dir, "run", "--training.steps", "2", "--eval.every", "0")
    profiled = ["--profiling.enable", "true", "--profiling.start_step", "2", "--profiling.active_steps", "1"]
    trained = two_nodes(nodes, *args, *profiled)
    assert [p.returncode for p in trained] == [0, 0], trained[1].stderr[-3000:]
    assert [r["step"] for r in read_metrics(nodes[0] / "run")] == [1, 2]  # node 0 keeps the run's outputs
    assert not (nodes[1] / "run" / "metrics.jsonl").exists()
    for rank, node in enumerate(nodes):  # each node writes its ranks' traces on its own disk
        assert list((node / "run" / "profile" / f"rank{rank}").glob("trace_step*.json")), rank

    refused = two_nodes(nodes, *tiny_args(tiny_corpus, cache_dir, "ckpt"), "--checkpoint.enable", "true")
    assert [p.returncode for p in refused] == [1, 1]
    # one line on each node's console: node 0's from its rank, node 1's launcher prints its rank's own (rank 1)
    errors = [[line for line in p.stderr.splitlines() if line.startswith("torchacco: error:")] for p in refused]
    assert [len(e) for e in errors] == [1, 1], errors
    named = f"ckpt/checkpoint ({nodes[1] / 'ckpt' / 'checkpoint'} on node 1)"  # as node 1 resolves it
    for (line,) in errors:
        assert f"the checkpoint folder {named} is not shared: node 1" in line, errors
        assert "enable = false" in line and "Traceback" not in refused[0].stderr
    assert not (nodes[0] / "ckpt" / "metrics.jsonl").exists()  # refused before training


def test_nodes_sharing_a_folder_checkpoint_there(tiny_corpus, cache_dir, tmp_path):
    shared = tmp_path / "shared"
    args = tiny_args(tiny_corpus, cache_dir, shared, "--training.steps", "2", "--eval.every", "0")
    runs = two_nodes([tmp_path / "node0", tmp_path / "node1"], *args, "--checkpoint.enable", "true")
    assert [p.returncode for p in runs] == [0, 0], runs[1].stderr[-3000:]
    assert (shared / "checkpoint" / "step-00000002").is_dir()
    assert not list((shared / "checkpoint").glob(".torchacco-*"))  # the check leaves nothing behind
