"""Activation checkpointing and the chunked loss change memory, never numbers: the same loss and
gradients as without them, and fewer bytes kept for backward (counted, not timed)."""

import copy

import pytest
import torch

from torchacco.activation_checkpoint import apply_activation_checkpoint
from torchacco.errors import UserError
from torchacco.loss import TokenLoss
from torchacco.spec import get_model_spec

VOCAB = 300


def _model(name: str):
    spec = get_model_spec(name)
    torch.manual_seed(0)
    model = spec.model_cls(spec.args("debug", vocab_size=VOCAB))
    model.init_weights()
    return model


def _batch():
    tokens = torch.randint(0, VOCAB, (2, 129), generator=torch.Generator().manual_seed(0))
    labels = tokens[:, 1:].clone()
    labels[:, :10] = -100  # a masked prompt
    return {"input_ids": tokens[:, :-1], "labels": labels}


def _loss_grads_and_saved_bytes(model, loss_fn: TokenLoss):
    """(loss, gradients, bytes of the tensors autograd keeps for backward outside checkpoints)."""
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    model.zero_grad()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = loss_fn.of_batch(model, _batch())
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()], sum(saved.values())


@pytest.mark.parametrize("name", ["llama3", "gpt_neo"])
@pytest.mark.parametrize("mode, selective", [("full", "op"), ("selective", "op"), ("selective", "2")])
def test_activation_checkpointing_keeps_loss_and_gradients_and_saves_memory(name, mode, selective):
    reference = _model(name)
    loss, grads, kept = _loss_grads_and_saved_bytes(reference, TokenLoss())
    model = copy.deepcopy(reference)
    assert apply_activation_checkpoint(model.layers, mode, selective) == (
        len(model.layers) // 2 if selective == "2" else len(model.layers)
    )
    loss_ac, grads_ac, kept_ac = _loss_grads_and_saved_bytes(model, TokenLoss())
    assert torch.equal(loss_ac, loss)
    for ours, theirs in zip(grads_ac, grads):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    # Everything a checkpointed block saved is gone from what backward keeps (the selective-op
    # policy's matmul outputs are kept inside the checkpoint, where these hooks do not count).
    assert kept_ac < (0.8 if selective == "2" else 0.6) * kept, (kept_ac, kept)


@pytest.mark.parametrize("name", ["llama3", "gpt_neo"])
def test_chunked_loss_has_the_same_loss_and_gradients_without_full_fp32_logits(name):
    """bf16 compute (as on GPUs): unchunked, backward keeps the fp32 log-softmax of all logits;
    chunked, it keeps the bf16 logits and makes fp32 one piece at a time."""
    model = _model(name).to(torch.bfloat16)
    loss, grads, kept = _loss_grads_and_saved_bytes(model, TokenLoss())
    loss_c, grads_c, kept_c = _loss_grads_and_saved_bytes(model, TokenLoss(chunks=4))
    torch.testing.assert_close(loss_c, loss, rtol=1e-6, atol=0)  # the sum runs in another order
    for ours, theirs in zip(grads_c, grads):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    logits = 2 * 128 * VOCAB  # elements of [batch × seq × vocab]
    assert kept - kept_c >= 0.9 * logits * (4 - 2), (kept, kept_c)


def test_an_unknown_selective_setting_is_one_clear_error():
    with pytest.raises(UserError, match=r"selective_checkpoint = 'layers' is neither 'op' nor a whole number"):
        apply_activation_checkpoint([], "selective", "layers")
