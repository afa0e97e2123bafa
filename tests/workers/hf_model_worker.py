"""A torchrun worker: a tiny random Hugging Face LlamaForCausalLM trained from Python on a list of
texts, with each data-parallel strategy named on the command line, one after the other in one
process group (a launch costs more than a tiny run).

    torchrun --nproc_per_node 2 tests/workers/hf_model_worker.py OUT STRATEGY...

Each strategy's run writes to OUT/<strategy>/ (metrics.jsonl, and hf/ for zero1, whose θ is
exported). Rank 0 writes OUT/<strategy>/facts.json: what the model looked like after train().
zero1 tokenizes with a transformers tokenizer, the others with the same tokenizers.Tokenizer.
"""

import json
import random
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from torchacco.config import Config
from torchacco.data.tokenizer import train_bpe

VOCAB = 300
WORDS = "the king and queen of a land far away went to see the sea with their horse dog cat bird".split()


def texts() -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60))) + "." for _ in range(200)]


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config)


def config(out: Path, strategy: str) -> Config:
    cfg = Config()
    cfg.job.dump_folder = str(out / strategy)
    cfg.parallelism.data_parallel = strategy
    t = cfg.training
    t.steps, t.seq_len, t.local_batch_size, t.global_batch_size = 12, 32, 4, 16  # 2 micro-batches per update
    t.device = "cpu"
    cfg.optimizer.lr = 3e-3
    cfg.lr_schedule.warmup_steps = 2
    cfg.eval.every, cfg.eval.batches = 12, 2
    cfg.metrics.tensorboard, cfg.metrics.log_every = False, 1
    cfg.checkpoint.export_hf = strategy == "zero1"
    return cfg


def main() -> None:
    from torchacco.trainer import train

    out, strategies = Path(sys.argv[1]), sys.argv[2:]
    dist.init_process_group("gloo")
    docs = texts()
    tokenizer_path = out / f"tokenizer-rank{dist.get_rank()}.json"
    tokenizer = train_bpe(docs, VOCAB, tokenizer_path)._tok  # deterministic: the same on both ranks
    for strategy in strategies:
        model = tiny_llama()
        own = (
            PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")
            if strategy == "zero1"
            else tokenizer
        )
        train(config(out, strategy), model=model, datasets=(docs, None), tokenizer=own)
        facts = {"block_class": type(model.model.layers[0]).__name__}
        if strategy != "fsdp":  # an FSDP model's parameters are sharded DTensors over the group
            facts["output"] = type(model(torch.tensor([[1, 2, 3]]))).__name__  # the hooks are gone
        if dist.get_rank() == 0:
            (out / strategy / "facts.json").write_text(json.dumps(facts))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
