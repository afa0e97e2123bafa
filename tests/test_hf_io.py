"""Hugging Face export/import (torchacco.hf_io) and sampling (torchacco.generate)."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, WORDS

from torchacco.errors import UserError
from torchacco.generate import generate
from torchacco.hf_io import load_hf, load_into, save_hf
from torchacco.spec import get_model_spec

transformers = pytest.importorskip("transformers")

TINY = {
    "gpt_neo": dict(vocab_size=300, max_seq_len=64, dim=64, n_layers=4, n_heads=4, window_size=16),
    "llama3": dict(vocab_size=300, max_seq_len=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2),
    "llama3_tied": dict(vocab_size=300, max_seq_len=64, dim=64, n_layers=2, n_heads=4, tie_embeddings=True),
}


def build(key: str, seed: int = 0, **overrides):
    """A tiny random model as the trainer makes it (meta -> to_empty -> init_weights), norms and
    biases perturbed off their 1/0 init so that every tensor's mapping shows in the logits."""
    name = key.removesuffix("_tied")
    spec = get_model_spec(name)
    args = spec.args("debug", **{**TINY[key], **overrides})
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p), alpha=0.1)
    return name, args, model.eval()


def from_pretrained(folder, **kw):
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="eager", output_loading_info=True, **kw
    )


def tokens(args, T=48, seed=1):
    return torch.randint(0, args.vocab_size, (2, T), generator=torch.Generator().manual_seed(seed))


# --- export: transformers reads what we write ---


@pytest.mark.parametrize("key", ["gpt_neo", "llama3", "llama3_tied"])
def test_export_loads_in_transformers_with_the_same_logits(key, tmp_path):
    name, args, model = build(key)
    folder = save_hf(tmp_path / "hf", name, args, model.state_dict())
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    hf, info = from_pretrained(folder)
    assert hf.dtype == torch.float32
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    x = tokens(args)  # 48 positions: beyond GPT-Neo's local window of 16
    with torch.no_grad():
        ours, theirs = model(x), hf(x).logits
    assert ours.abs().max() > 0.1
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("key", ["gpt_neo", "llama3"])
def test_bf16_export_loads_as_bf16_with_close_logits(key, tmp_path):
    name, args, model = build(key)
    folder = save_hf(tmp_path / "hf", name, args, model.state_dict(), dtype=torch.bfloat16)
    config = json.loads((folder / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    hf, _ = from_pretrained(folder)
    assert hf.dtype == torch.bfloat16  # from the config: transformers' dtype="auto"
    x = tokens(args)
    with torch.no_grad():
        ours, theirs = model(x), hf(x).logits.float()
    scale = ours.abs().max()
    assert (theirs - ours).abs().max() < 0.05 * scale
    # and load_hf gives fp32 tensors equal to the bf16-rounded originals
    _, _, sd = load_hf(folder)
    for k, v in model.state_dict().items():
        assert sd[k].dtype == torch.float32 and torch.equal(sd[k], v.bfloat16().float())


def test_sharded_export_has_an_index_and_round_trips_exactly(tmp_path):
    name, args, model = build("llama3")
    sd = model.state_dict()
    folder = save_hf(tmp_path / "hf", name, args, sd, max_shard_bytes=100_000)
    shards = sorted(folder.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and not (folder / "model.safetensors").exists()
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    assert index["metadata"]["total_size"] == sum(v.numel() * 4 for v in sd.values())
    assert len(index["weight_map"]) == len(sd)

    hf, info = from_pretrained(folder)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    x = tokens(args)
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x), atol=1e-4, rtol=1e-4)

    loaded_name, loaded_args, back = load_hf(folder)
    assert (loaded_name, loaded_args) == (name, args)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)


def test_gpt_neo_export_leaves_the_tied_head_to_transformers(tmp_path):
    from safetensors import safe_open

    name, args, model = build("gpt_neo")
    folder = save_hf(tmp_path / "hf", name, args, model.state_dict())
    with safe_open(folder / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "lm_head.weight" not in keys and "transformer.wte.weight" in keys
    hf, _ = from_pretrained(folder)
    assert torch.equal(hf.lm_head.weight, model.wte.weight)
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()  # tied, not copied


def test_export_records_eos_and_tokenizer_and_replaces_an_earlier_export(tmp_path, tiny_tokenizer):
    name, args, model = build("gpt_neo", vocab_size=tiny_tokenizer.vocab_size)
    folder = tmp_path / "hf"
    save_hf(folder, name, args, model.state_dict(), max_shard_bytes=50_000)
    assert (folder / "model.safetensors.index.json").exists()
    save_hf(folder, name, args, model.state_dict(), tokenizer_path=tiny_tokenizer.path, eos_id=tiny_tokenizer.eos_id)
    assert not (folder / "model.safetensors.index.json").exists() and not list(folder.glob("model-*"))
    config = json.loads((folder / "config.json").read_text())
    assert config["eos_token_id"] == config["bos_token_id"] == tiny_tokenizer.eos_id
    assert (folder / "tokenizer.json").read_bytes() == tiny_tokenizer.path.read_bytes()
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    assert hf_tok.eos_token_id == tiny_tokenizer.eos_id
    assert hf_tok("the king").input_ids == tiny_tokenizer.encode("the king")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folders left

    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(UserError, match="holds other files"):
        save_hf(tmp_path / "notes", name, args, model.state_dict())


def test_export_without_an_adapter_is_a_user_error(tmp_path, monkeypatch):
    import dataclasses

    import torchacco.hf_io as hf_io

    spec = dataclasses.replace(get_model_spec("gpt_neo"), hf=None)
    monkeypatch.setattr(hf_io, "get_model_spec", lambda name: spec)
    name, args, model = build("gpt_neo")
    with pytest.raises(UserError, match=r"model gpt_neo has no Hugging Face adapter \(models/gpt_neo/hf.py\)"):
        save_hf(tmp_path / "hf", name, args, model.state_dict())
    assert not (tmp_path / "hf").exists()


# --- import errors ---


@pytest.fixture
def exported(tmp_path):
    name, args, model = build("llama3")
    return save_hf(tmp_path / "hf", name, args, model.state_dict(), max_shard_bytes=100_000), model


def test_load_hf_missing_folder_or_config(tmp_path, exported):
    folder, _ = exported
    with pytest.raises(UserError, match="folder not found"):
        load_hf(tmp_path / "nope")
    (folder / "config.json").unlink()
    with pytest.raises(UserError, match="has no config.json"):
        load_hf(folder)


def test_load_hf_missing_shard_or_weights(exported):
    folder, _ = exported
    sorted(folder.glob("model-*.safetensors"))[1].unlink()
    with pytest.raises(UserError, match=r"lists shard model-00002-of-\d+\.safetensors, which is missing"):
        load_hf(folder)
    for p in folder.glob("*safetensors*"):
        p.unlink()
    with pytest.raises(UserError, match="no safetensors weights"):
        load_hf(folder)


def test_load_hf_corrupted_shard(exported):
    folder, _ = exported
    shard = sorted(folder.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(UserError, match=f"cannot read .*{shard.name}.*corrupted"):
        load_hf(folder)


def test_load_hf_names_a_missing_tensor(tmp_path):
    name, args, model = build("llama3")
    sd = model.state_dict()
    del sd["layers.1.feed_forward.w2.weight"]
    save_hf(tmp_path / "hf", name, args, sd)
    with pytest.raises(UserError, match="lacks tensor 'layers.1.feed_forward.w2.weight'"):
        load_hf(tmp_path / "hf")


def test_load_hf_unknown_or_contradicting_model_type(exported):
    folder, _ = exported
    with pytest.raises(UserError, match=r"holds a llama model \(llama3\).*'gpt_neo'"):
        load_hf(folder, "gpt_neo")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "mamba"}))
    with pytest.raises(UserError, match="model_type 'mamba' is not supported"):
        load_hf(folder)


def test_load_into_names_the_mismatching_tensor(exported):
    folder, _ = exported
    _, _, sd = load_hf(folder)
    _, _, other = build("llama3", vocab_size=400)
    with pytest.raises(
        UserError,
        match=r"'tok_embeddings.weight' has shape \(300, 64\).*configured model: "
        r"\(400, 64\); check \[model\] flavor / vocab_size",
    ):
        load_into(other, sd)
    _, _, deeper = build("llama3", n_layers=3)
    with pytest.raises(UserError, match="lack tensor 'layers.2."):
        load_into(deeper, sd)
    _, _, model = build("llama3", seed=5)
    load_into(model, sd)
    assert all(torch.equal(model.state_dict()[k], sd[k]) for k in sd)


# --- generation ---


def test_greedy_generation_is_deterministic_and_top_k_1_is_greedy():
    _, args, model = build("gpt_neo", max_seq_len=16)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    greedy = generate(model, prompt, max_tokens=20, temperature=0, top_k=None, eos_id=None)
    assert len(greedy) == 20  # runs past max_seq_len: the context is truncated
    assert generate(model, prompt, 20, 0, None, None) == greedy
    assert generate(model, prompt, 20, 1.0, 1, None, torch.Generator().manual_seed(3)) == greedy
    sample = [generate(model, prompt, 20, 1.5, 0, None, torch.Generator().manual_seed(s)) for s in (1, 1, 2)]
    assert sample[0] == sample[1] != sample[2]
    assert all(0 <= t < args.vocab_size for t in sample[0])


def test_a_model_trained_to_say_k_says_k_and_stops_at_eos():
    k = 42
    _, args, model = build("llama3")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(15):
        x = torch.randint(0, args.vocab_size, (4, 16))
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), torch.full((64,), k))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert generate(model, [1, 2, 3], 6, temperature=0, top_k=None, eos_id=None) == [k] * 6
    gen = torch.Generator().manual_seed(0)
    assert generate(model, [1, 2, 3], 6, temperature=0.5, top_k=5, eos_id=None, generator=gen) == [k] * 6
    assert generate(model, [1, 2, 3], 6, temperature=0, top_k=None, eos_id=k) == []


# --- the command line ---


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    from torchacco.data.tokenizer import train_bpe

    lines = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))]
    return train_bpe(lines, 300, tmp_path_factory.mktemp("tok") / "tokenizer.json")


def run_generate(*args):
    return subprocess.run(
        [sys.executable, "-m", "torchacco", "generate", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )


@pytest.mark.integration
def test_cli_prints_prompt_and_continuation(tmp_path, tiny_tokenizer, capsys):
    from torchacco.generate import main

    name, args, model = build("gpt_neo", vocab_size=tiny_tokenizer.vocab_size)
    folder = save_hf(
        tmp_path / "hf",
        name,
        args,
        model.state_dict(),
        tokenizer_path=tiny_tokenizer.path,
        eos_id=tiny_tokenizer.eos_id,
    )
    prompt = "the king and queen"
    ids = tiny_tokenizer.encode(prompt)
    expected = generate(model, ids, 8, 0, None, tiny_tokenizer.eos_id)
    out = run_generate("--model", folder, "--prompt", prompt, "--max-tokens", 8, "--temperature", 0, "--device", "cpu")
    assert out.returncode == 0, out.stderr
    assert out.stdout == tiny_tokenizer.decode(ids + expected) + "\n"
    assert out.stdout.startswith(prompt)
    # sampling with the defaults (temperature 0.8, top-k 50), in-process: the same seed, the same text
    texts = []
    for _ in range(2):
        assert main(["--model", str(folder), "--prompt", prompt, "--max-tokens", "8", "--seed", "1"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].startswith(prompt)


@pytest.mark.integration
def test_cli_error_is_one_line_and_exit_1(tmp_path):
    out = run_generate("--model", tmp_path / "missing", "--prompt", "hi")
    assert out.returncode == 1
    assert out.stderr == f"torchacco: error: model folder not found: {tmp_path / 'missing'}\n"


def test_cli_refuses_a_folder_without_tokenizer_and_an_empty_prompt(tmp_path, tiny_tokenizer, capsys):
    from torchacco.generate import main

    (tmp_path / "no_tok").mkdir()
    tiny_tokenizer.save(tmp_path / "tok_only")
    for folder, prompt, message in [
        (tmp_path / "no_tok", "hi", "no tokenizer.json; pass a folder exported with its tokenizer"),
        (tmp_path / "tok_only", "", "--prompt is empty"),
    ]:
        assert main(["--model", str(folder), "--prompt", prompt]) == 1
        err = capsys.readouterr().err
        assert err.startswith("torchacco: error: ") and message in err and err.count("\n") == 1
