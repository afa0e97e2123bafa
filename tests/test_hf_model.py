"""A user's own Hugging Face model and texts, trained from Python: `train(cfg, model=..., datasets=...,
tokenizer=...)` (torchacco/user_model.py, data/texts.py)."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
from conftest import read_metrics
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).parent / "workers"))
import hf_model_worker as worker  # noqa: E402

from torchacco import blocks, user_model  # noqa: E402
from torchacco.config import Config  # noqa: E402
from torchacco.data import python_datasets  # noqa: E402
from torchacco.data.dataset import SplitWriter, read_split  # noqa: E402
from torchacco.data.tokenizer import Tokenizer, as_tokenizer, train_bpe  # noqa: E402
from torchacco.errors import UserError  # noqa: E402
from torchacco.trainer import train  # noqa: E402

ROOT = Path(__file__).parent.parent
SEQ = 32


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """zero1, acco and fsdp over the same tiny LlamaForCausalLM and texts, on 2 gloo ranks."""
    out = tmp_path_factory.mktemp("hf-runs")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
        + [str(Path(__file__).parent / "workers" / "hf_model_worker.py"), str(out), "zero1", "acco", "fsdp"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def _losses(runs: Path, strategy: str) -> list[float]:
    return [r["loss"] for r in read_metrics(runs / strategy)]


@pytest.mark.integration
def test_zero1_and_acco_train_a_hugging_face_llama_on_texts(runs):
    zero1, acco = _losses(runs, "zero1"), _losses(runs, "acco")
    assert len(zero1) == len(acco) == 12
    assert acco[0] == pytest.approx(zero1[0], rel=1e-5)  # the same θ0, data split and first batches
    for losses in (zero1, acco):
        assert losses[0] == pytest.approx(np.log(worker.VOCAB), rel=0.05)  # a random model
        assert losses[-1] < losses[0] - 1.0
    for strategy in ("zero1", "acco"):
        assert read_metrics(runs / strategy)[-1]["val_loss"] < zero1[0] - 1.0
        facts = (runs / strategy / "facts.json").read_text()
        assert '"output": "CausalLMOutputWithPast"' in facts  # train() removed its hooks


@pytest.mark.integration
def test_fsdp_shards_each_decoder_layer_and_agrees_with_zero1(runs):
    assert '"block_class": "FSDPLlamaDecoderLayer"' in (runs / "fsdp" / "facts.json").read_text()
    assert _losses(runs, "fsdp") == pytest.approx(_losses(runs, "zero1"), rel=1e-4)


@pytest.mark.integration
def test_export_is_the_trained_model_as_a_hugging_face_folder(runs):
    from transformers import AutoTokenizer, LlamaForCausalLM

    model, info = LlamaForCausalLM.from_pretrained(runs / "zero1" / "hf", output_loading_info=True)
    assert not any(info.values()), info  # no missing or unexpected tensors
    initial = worker.tiny_llama().state_dict()
    assert not torch.equal(
        model.state_dict()["model.layers.0.mlp.up_proj.weight"], initial["model.layers.0.mlp.up_proj.weight"]
    )
    tok = AutoTokenizer.from_pretrained(runs / "zero1" / "hf")
    text = worker.texts()[0]
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"][: SEQ + 1]])
    loss = nn.functional.cross_entropy(model(ids[:, :-1]).logits[0], ids[0, 1:])
    assert loss.item() < np.log(worker.VOCAB) - 1.0  # it learned the texts


def _config(tmp_path, **parallelism) -> Config:
    cfg = Config()
    cfg.job.dump_folder = str(tmp_path / "run")
    cfg.training.steps, cfg.training.seq_len, cfg.training.local_batch_size = 3, SEQ, 4
    cfg.training.device = "cpu"
    cfg.metrics.tensorboard = False
    cfg.eval.every = 0
    for key, value in parallelism.items():
        setattr(cfg.parallelism, key, value)
    return cfg


@pytest.mark.parametrize("degree", ["tensor_parallel_degree", "pipeline_parallel_degree"])
def test_tensor_or_pipeline_parallelism_asks_for_a_model_folder(tmp_path, degree):
    cfg = _config(tmp_path, data_parallel="zero1", **{degree: 2})
    with pytest.raises(UserError) as error:
        train(cfg, model=worker.tiny_llama(), datasets=(worker.texts(), None), tokenizer=_tokenizer(tmp_path))
    message = str(error.value)
    assert "\n" not in message
    assert "need a torchacco model folder" in message and "TensorParallelPlan / PipelinePlan" in message
    assert "tensor_parallel_degree = 1 and pipeline_parallel_degree = 1" in message
    assert not (tmp_path / "run").exists()  # before anything was built


def test_activation_checkpointing_of_hugging_face_layers_keeps_the_losses(tmp_path):
    """Full checkpointing wraps LlamaDecoderLayer.forward, which HF calls with keyword arguments."""
    losses = {}
    for mode in ("none", "full"):
        cfg = _config(tmp_path / mode, data_parallel="ddp")
        cfg.training.activation_checkpoint = mode
        cfg.metrics.log_every = 1
        train(cfg, model=worker.tiny_llama(), datasets=(worker.texts(), None), tokenizer=_tokenizer(tmp_path))
        losses[mode] = [r["loss"] for r in read_metrics(tmp_path / mode / "run")]
    assert len(losses["full"]) == 3
    assert losses["full"] == pytest.approx(losses["none"], rel=1e-5)


@pytest.mark.exact
def test_a_run_on_texts_resumes_exactly(tmp_path):
    """ACCO over a Hugging Face model: 4 steps, then on to 8 from the step-4 checkpoint, as one 8-step run."""

    def run(folder: Path, steps: int) -> list[float]:
        cfg = _config(folder, data_parallel="acco")
        cfg.training.steps, cfg.training.global_batch_size, cfg.training.max_tokens = steps, 8, 8 * 8 * SEQ
        cfg.metrics.log_every = 1
        cfg.checkpoint.enable, cfg.checkpoint.every = True, 2
        train(cfg, model=worker.tiny_llama(), datasets=(worker.texts(), None), tokenizer=_tokenizer(tmp_path))
        return [r["loss"] for r in read_metrics(folder / "run")]

    straight = run(tmp_path / "straight", 8)
    run(tmp_path / "resumed", 4)
    assert run(tmp_path / "resumed", 8) == straight


# Data ---------------------------------------------------------------------------------------------


class HFStyleDataset:
    """What train() uses of a `datasets.Dataset` (the library is not a dependency): `column_names`
    and iteration over rows as dicts."""

    def __init__(self, rows: list[dict]):
        self.rows, self.column_names = rows, list(rows[0])

    def __iter__(self):
        return iter(self.rows)


def _tokenizer(tmp_path) -> Tokenizer:
    path = tmp_path / "tok" / "tokenizer.json"
    return Tokenizer(path) if path.is_file() else train_bpe(worker.texts(), worker.VOCAB, path)


def _packed(datasets, tokenizer, rank=0, world=1, **data):
    cfg = Config()
    for key, value in data.items():
        setattr(cfg.data, key, value)
    return python_datasets(datasets, tokenizer, cfg.data, cfg.tokenizer, SEQ, rank, world, 0, True)


def test_texts_are_packed_like_torchaccos_own_token_cache(tmp_path):
    docs = worker.texts()
    tok = _tokenizer(tmp_path)
    _, train_set, _ = _packed((docs, docs[:10]), tok)
    with SplitWriter(tmp_path, "train", tok) as writer:  # what the token cache writes
        for doc in docs:
            writer.add(doc)
        info = writer.close()
    cached, _ = read_split(tmp_path, "train", info, tok.vocab_size)
    assert train_set.tokens == info["tokens"]
    assert np.array_equal(train_set._ids, cached)  # EOS after every document, as in the cache
    assert np.sum(cached == tok.eos_id) == len(docs)


def test_a_datasets_dataset_dicts_and_strings_give_the_same_windows(tmp_path):
    docs, tok = worker.texts(), _tokenizer(tmp_path)
    rows = [{"id": i, "content": d} for i, d in enumerate(docs)]
    _, train_set, val_set = _packed((docs, None), tok)
    for source in (HFStyleDataset(rows), rows):
        _, same_train, same_val = _packed((source, None), tok, text_field="content")
        assert np.array_equal(same_train._ids, train_set._ids) and np.array_equal(same_val._ids, val_set._ids)


def test_each_rank_gets_its_own_windows_and_val_is_held_out(tmp_path):
    docs, tok = worker.texts(), _tokenizer(tmp_path)
    (_, train0, val0), (_, train1, val1) = (_packed((docs, None), tok, rank, 2) for rank in (0, 1))
    assert train0.num_windows == train1.num_windows > 0
    assert set(train0.windows(0).tolist()).isdisjoint(train1.windows(0).tolist())
    assert val0.num_windows == val1.num_windows > 0 and not val0.train
    _, whole, _ = _packed((docs, docs), tok)
    assert train0.tokens + val0.tokens == whole.tokens  # val_fraction of the documents held out


def test_torch_datasets_are_still_used_as_they_are(tmp_path):
    train_set, val_set = torch.utils.data.TensorDataset(torch.zeros(2)), torch.utils.data.TensorDataset(torch.ones(2))
    assert _packed((train_set, val_set), None) == (None, train_set, val_set)


@pytest.mark.parametrize(
    "datasets, text_field, expected",
    [
        ("some text", "text", "pass a pair: datasets=(train, val)"),
        (("some text", None), "text", "the training data is a single string; pass a list of texts"),
        ((HFStyleDataset([{"body": "x"}]), None), "text", "has no column 'text' (its columns: body); set [data]"),
        (([{"body": "x"}], None), "text", "item 0 of the training data has no field 'text' (its fields: body)"),
        ((["a", 3], None), "text", "item 1 of the training data is a int; each item must be a text"),
        (([{"input_ids": [1], "labels": [2]}], None), "text", "is a window of token ids, not a document; pass windows"),
        (([""], None), "text", "the training data holds no text"),
        ((["a b c"], None), "text", "holds a single document, so none can be held out for validation"),
        ((["a b c", "d e f"], ["x"]), "text", "the training texts give"),
        ((42, None), "text", "the training data is a int; pass a torch dataset of windows"),
    ],
)
def test_data_mistakes_are_one_line_errors(tmp_path, datasets, text_field, expected):
    with pytest.raises(UserError) as error:
        _packed(datasets, _tokenizer(tmp_path), text_field=text_field)
    assert expected in str(error.value) and "\n" not in str(error.value)


def test_texts_without_a_tokenizer_say_how_to_pass_one(tmp_path):
    with pytest.raises(UserError, match=r"texts need a tokenizer: train\(cfg, model, datasets, tokenizer=...\)"):
        _packed((worker.texts(), None), None)


def test_every_tokenizer_form_encodes_alike(tmp_path):
    tok = _tokenizer(tmp_path)
    forms = [
        tok.path,
        str(tok.path.parent),
        tok._tok,
        PreTrainedTokenizerFast(tokenizer_object=tok._tok, eos_token="<|endoftext|>"),
    ]
    text = worker.texts()[0]
    for form in forms:
        wrapped = as_tokenizer(form)
        assert (wrapped.encode_batch([text]), wrapped.eos_id, wrapped.vocab_size) == (
            [tok.encode(text)],
            tok.eos_id,
            tok.vocab_size,
        ), form
    with pytest.raises(UserError, match="no tokenizer.json there"):
        as_tokenizer(tmp_path / "nowhere")
    with pytest.raises(UserError, match="has no eos_token; set one"):
        as_tokenizer(PreTrainedTokenizerFast(tokenizer_object=tok._tok))
    with pytest.raises(UserError, match="tokenizer is a int; pass a tokenizer.json path"):
        as_tokenizer(3)


# The model adapter ----------------------------------------------------------------------------------


def _gpt2() -> GPT2LMHeadModel:
    return GPT2LMHeadModel(GPT2Config(vocab_size=worker.VOCAB, n_embd=32, n_layer=3, n_head=2, n_positions=64))


class Plain(nn.Module):
    """Neither blocks nor save_pretrained: token ids to logits through two linear maps."""

    def __init__(self):
        super().__init__()
        self.embedding, self.head = nn.Embedding(10, 4), nn.Linear(4, 10)

    def forward(self, ids):
        return (self.head(self.embedding(ids)),)


def test_blocks_are_found_without_knowing_the_architecture():
    llama, gpt2 = worker.tiny_llama(), _gpt2()
    assert blocks.blocks_of(llama) is llama.model.layers
    assert blocks.blocks_of(gpt2) is gpt2.transformer.h
    assert blocks.compile_units(gpt2) == list(gpt2.transformer.h)
    nested = nn.Sequential(nn.ModuleList([nn.Linear(2, 2)]), nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)]))
    assert blocks.blocks_of(nested) is nested[1]  # the largest list of one class
    assert blocks.blocks_of(Plain()) is None
    plain = Plain()
    assert blocks.compile_units(plain) == [plain]
    assert blocks.block_list(plain) == []
    plain.layers = nn.ModuleDict({"0": nn.Linear(2, 2), "1": nn.Linear(2, 2)})  # torchtitan's layout
    assert blocks.block_list(plain) == blocks.compile_units(plain) == list(plain.layers.values())


def test_the_adapter_returns_logits_and_gives_the_model_back():
    model, ids = _gpt2().eval(), torch.tensor([[1, 2, 3]])
    adapter = user_model.adapt(model)
    assert model.training  # dropout on while training
    model.eval()  # (to compare outputs)
    logits = model(ids)
    assert isinstance(logits, torch.Tensor) and logits.shape == (1, 3, worker.VOCAB)
    adapter.remove()
    assert torch.equal(model(ids).logits, logits)
    plain = Plain()
    user_model.adapt(plain)
    assert plain(ids).shape == (1, 3, 10)  # the first element of a tuple


def test_flops_per_token_count_matmul_weights_and_attention():
    llama, gpt2 = worker.tiny_llama(), _gpt2()
    n = sum(p.numel() for p in llama.parameters()) - llama.model.embed_tokens.weight.numel()  # untied head
    assert user_model.flops_per_token(llama, SEQ) == 6 * n + 12 * 2 * 64 * SEQ
    lookups = gpt2.transformer.wpe.weight.numel()  # wte is the tied head's weight: a matmul
    n = sum(p.numel() for p in gpt2.parameters()) - lookups
    assert user_model.flops_per_token(gpt2, SEQ) == 6 * n + 12 * 3 * 32 * SEQ
    assert user_model.flops_per_token(Plain(), SEQ) == 6 * sum(p.numel() for p in Plain().parameters())


def test_what_a_foreign_model_cannot_do_is_one_line(tmp_path):
    with pytest.raises(UserError, match=r"input embedding has 300 rows; .* model.resize_token_embeddings\(400\)"):
        user_model.check_vocabulary(worker.tiny_llama(), 400)
    cfg = _config(tmp_path)
    cfg.training.seq_len = 128
    with pytest.raises(UserError, match="exceeds the 64 positions of the LlamaForCausalLM"):
        user_model.check(worker.tiny_llama(), cfg.parallelism, cfg.training, cfg.checkpoint)
    cfg = _config(tmp_path)
    cfg.training.activation_checkpoint = "full"
    with pytest.raises(UserError, match="the Plain has no nn.ModuleList of decoder layers"):
        user_model.check(Plain(), cfg.parallelism, cfg.training, cfg.checkpoint)
    cfg = _config(tmp_path)
    cfg.checkpoint.export_hf = True
    with pytest.raises(UserError, match="the Plain is neither: set export_hf = false"):
        user_model.check(Plain(), cfg.parallelism, cfg.training, cfg.checkpoint)
    user_model.check(worker.tiny_llama(), cfg.parallelism, cfg.training, cfg.checkpoint)  # save_pretrained: exported
