"""CUDA checks that run in a process of their own (the suite hides the GPUs from itself):

    python tests/workers/cuda_checks.py NAME

Each check raises on failure; tests/test_cuda.py runs them.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))


def stream_runner_overlaps_and_orders_with_events():
    from torchacco.runners import StreamRunner

    runner = StreamRunner(torch.device("cuda", 0))
    a = torch.randn(4096, 4096, device="cuda")
    a.mul_(2)  # written on the compute stream: the job must see it (ready event)
    out = torch.empty_like(a)

    def job():
        assert torch.cuda.current_stream() == runner.stream
        for _ in range(20):
            torch.mm(a, a, out=out)
        return "done"

    runner.launch(job)
    polls = 0
    while not runner.done():
        polls += 1  # the compute side is free meanwhile
    assert runner.wait() == "done"
    torch.testing.assert_close(out, a @ a, rtol=1e-2, atol=1e-1)  # ordered after the job via the done event
    assert not runner.in_flight()
    runner.close()


def acco_first_commit_equals_zero1():
    import overlap_worker as worker

    from torchacco.device import Device
    from torchacco.loss import TokenLoss
    from torchacco.parallel.process_groups import destroy, init_distributed
    from torchacco.parallel.strategy import Counts

    device = Device("cuda", 0)
    dims = init_distributed(device)
    try:
        thetas = {}
        for kind, periods in (("zero1", 1), ("acco", 3)):  # ACCO's first commit: two periods at θ_0
            cfg = worker.config(kind, "deterministic")
            dp = worker.build(worker.tiny_model().cuda(), cfg, dims, 4, device=device)
            index = 0
            for _ in range(periods):
                tokens, loss_sum, count = 0, 0.0, 0
                for ctx in dp.micro_batches():
                    batch = {k: v.cuda() for k, v in worker.micro_batch(0, index).items()}
                    with ctx:
                        loss, n = TokenLoss().of_batch(dp.model, batch)
                        loss.backward()
                    tokens, loss_sum, index, count = tokens + n.item(), loss_sum + loss.item(), index + 1, count + 1
                dp.step(Counts(tokens, loss_sum, count, float(count * worker.BATCH * worker.SEQ)))
            with dp.evaluation():
                thetas[kind] = torch.cat([p.detach().reshape(-1).float() for p in dp.model.parameters()])
            dp.close()
        torch.testing.assert_close(thetas["acco"], thetas["zero1"], rtol=1e-5, atol=1e-6)
    finally:
        destroy()


def top_k_messages_match_the_cpu_bit_for_bit():
    from torchacco.parallel.diloco.compression import compress, decompress
    from torchacco.parallel.diloco.wire import keep_per_chunk

    g = torch.Generator().manual_seed(0)
    e = torch.randn(5 * 4096 + 300, generator=g) * torch.logspace(-3, 2, 5 * 4096 + 300)
    for topk, wire in ((0.01, "int2"), (0.1, "int4"), (0.6, "bf16")):  # 0.6: the offset code's low bits are 0
        keep = keep_per_chunk(topk)
        message, sent = compress(e, keep, wire)
        on_gpu, sent_on_gpu = compress(e.cuda(), keep, wire)
        assert torch.equal(on_gpu.cpu(), message) and torch.equal(sent_on_gpu.cpu(), sent), (topk, wire)
        assert torch.equal(decompress(on_gpu, e.numel(), keep, wire).cpu(), sent), (topk, wire)


def sparse_mean_on_nccl_is_what_was_sent():
    """The exchange's gathers, scatter-adds and the senders' division on the GPU: one rank's mean is its message."""
    from torchacco.device import Device
    from torchacco.parallel.diloco.compression import compress, sparse_token_weighted_mean
    from torchacco.parallel.diloco.wire import keep_per_chunk
    from torchacco.parallel.process_groups import destroy, init_distributed

    init_distributed(Device("cuda", 0))
    try:
        e = torch.randn(3 * 4096 + 77, generator=torch.Generator().manual_seed(1))
        keep = keep_per_chunk(0.01)
        _, sent = compress(e, keep, "int2")
        for over_senders in (False, True):
            mean, sent_on_gpu = sparse_token_weighted_mean(e.cuda(), 5.0, None, "int2", keep, over_senders)
            assert torch.equal(sent_on_gpu.cpu(), sent) and torch.equal(mean.cpu(), sent), over_senders
    finally:
        destroy()


if __name__ == "__main__":
    globals()[sys.argv[1]]()
    print("ok")
