"""Pretrain → export (safetensors that transformers loads) → finetune from it → generate."""

import json
import math
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, read_metrics, run_train, tiny_args

pytestmark = pytest.mark.integration  # every test here starts processes (docs/testing.md)


@pytest.fixture(scope="module")
def pretrained(tiny_corpus, cache_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("pretrain")
    proc = run_train(
        tiny_args(
            tiny_corpus,
            cache_dir,
            out,
            "--parallelism.data_parallel",
            "acco",
            "--training.global_batch_size",
            "16",
            "--checkpoint.enable",
            "true",
            "--checkpoint.export_hf",
            "true",
        )
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_export_loads_in_transformers_with_the_same_logits(pretrained):
    from transformers import AutoModelForCausalLM

    from torchacco.build import build_model
    from torchacco.config import load_config
    from torchacco.device import Device
    from torchacco.spec import get_model_spec

    folder = pretrained / "hf"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in folder.iterdir()}
    hf = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    cfg = load_config(["--config", str(pretrained / "config.toml"), "--model.init_from", str(folder)])
    ours = build_model(get_model_spec(cfg.model.name), cfg.model, 0, 0, Device("cpu")).eval()
    tokens = torch.randint(0, ours.args.vocab_size, (2, 64))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ours(tokens), atol=1e-4, rtol=1e-4)


def test_export_from_a_checkpoint_equals_the_end_of_training_export(pretrained, tmp_path):
    from safetensors.torch import load_file

    proc = subprocess.run(
        [sys.executable, "-m", "torchacco", "export", str(pretrained), "--out", str(tmp_path / "re")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    a, b = load_file(pretrained / "hf" / "model.safetensors"), load_file(tmp_path / "re" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_finetune_from_the_export_on_alpaca_data_then_generate(pretrained, cache_dir, tmp_path):
    records = [
        {"instruction": f"Name the animal number {i}.", "input": "", "output": "the horse and the dog"}
        for i in range(300)
    ]
    data = tmp_path / "alpaca.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    hf = pretrained / "hf"

    def finetune(out, *extra):
        return run_train(
            [
                "--data.dataset",
                str(data),
                "--data.format",
                "alpaca",
                "--data.cache_dir",
                str(cache_dir),
                "--tokenizer.path",
                str(hf / "tokenizer.json"),
                "--training.seq_len",
                "64",
                "--training.local_batch_size",
                "4",
                "--training.global_batch_size",
                "16",
                "--training.steps",
                "4",
                "--metrics.log_every",
                "1",
                "--metrics.tensorboard",
                "false",
                "--eval.every",
                "0",
                "--parallelism.data_parallel",
                "acco",
                "--job.dump_folder",
                str(out),
                "--checkpoint.enable",
                "true",
                "--checkpoint.export_hf",
                "true",
                *extra,
            ]
        )

    tuned = finetune(tmp_path / "ft", "--model.init_from", str(hf))
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    # Starting from the pretrained weights, the first loss is already far below a random model's,
    # which is ln(vocabulary) (test_train.py checks that of a fresh model).
    vocab = len(json.loads((hf / "tokenizer.json").read_text())["model"]["vocab"])
    assert read_metrics(tmp_path / "ft")[0]["loss"] < math.log(vocab) - 0.5

    gen = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchacco",
            "generate",
            "--model",
            str(tmp_path / "ft" / "hf"),
            "--prompt",
            "the king",
            "--max-tokens",
            "8",
            "--temperature",
            "0",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert gen.returncode == 0, gen.stderr[-2000:]
    assert gen.stdout.startswith("the king") and len(gen.stdout.strip()) > len("the king")


def test_init_from_a_folder_without_config_is_one_clear_error(tiny_corpus, cache_dir, tmp_path):
    proc = run_train(tiny_args(tiny_corpus, cache_dir, tmp_path / "out", "--model.init_from", str(tmp_path)))
    assert proc.returncode != 0
    assert "is not a Hugging Face folder with a config.json" in proc.stderr and "Traceback" not in proc.stderr
