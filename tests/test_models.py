"""Model specs: flavors, init contract, FLOPs formula, and logit parity with HF transformers."""

from dataclasses import replace

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from torchacco.errors import UserError
from torchacco.spec import available_models, get_model_spec

ALL_FLAVORS = [(m, f) for m in ("gpt_neo", "llama3") for f in get_model_spec(m).flavors]

# the size each flavor is named after (or, for the debug/tiny ones, chosen to be)
EXPECTED_PARAMS = {
    ("gpt_neo", "debug"): 1.74e6,
    ("gpt_neo", "tiny"): 5.85e6,
    ("gpt_neo", "36M"): 36e6,
    ("gpt_neo", "125M"): 125e6,
    ("gpt_neo", "1.3B"): 1.3e9,
    ("gpt_neo", "2.7B"): 2.7e9,
    ("llama3", "debug"): 6e6,
    ("llama3", "1B"): 1.24e9,
    ("llama3", "8B"): 8.03e9,
    ("llama3", "70B"): 70.6e9,
}


def build(name, seed=0, **overrides):
    """Meta build -> to_empty -> init_weights, as the trainer does."""
    spec = get_model_spec(name)
    args = spec.args("debug", **overrides)
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return spec, args, model


def test_registry_lists_both_models():
    assert {"gpt_neo", "llama3"} <= set(available_models())


def test_unknown_model_or_flavor_is_a_user_error():
    with pytest.raises(UserError, match="nope"):
        get_model_spec("nope")
    with pytest.raises(UserError, match="no flavor"):
        get_model_spec("llama3").args("nope")


@pytest.mark.parametrize("name,flavor", ALL_FLAVORS)
def test_flavor_builds_on_meta_with_its_named_size(name, flavor):
    spec = get_model_spec(name)
    args = spec.args(flavor)
    with torch.device("meta"):
        model = spec.model_cls(args)
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert isinstance(model.layers, torch.nn.ModuleList) and len(model.layers) == args.n_layers
    n = sum(p.numel() for p in model.parameters())
    assert n == args.num_params()
    assert n == pytest.approx(EXPECTED_PARAMS[name, flavor], rel=0.05)


@pytest.mark.parametrize("name,flavor", ALL_FLAVORS)
def test_hf_config_round_trips_args(name, flavor):
    spec = get_model_spec(name)
    args = spec.args(flavor)
    assert spec.hf.args_from_hf_config(spec.hf.hf_config(args)) == args


@pytest.mark.parametrize("name,overrides", [("gpt_neo", {}), ("llama3", {}), ("llama3", {"tie_embeddings": True})])
def test_state_dict_round_trips_through_hf_names(name, overrides):
    spec, args, model = build(name, **overrides)
    sd = model.state_dict()
    back = spec.hf.from_hf(spec.hf.to_hf(sd, args), args)
    assert back.keys() == sd.keys()
    assert all(back[k] is sd[k] for k in sd)
    with pytest.raises(UserError, match="unexpected"):
        spec.hf.from_hf({**spec.hf.to_hf(sd, args), "model.extra.weight": torch.zeros(1)}, args)


@pytest.mark.parametrize("name", ["gpt_neo", "llama3"])
def test_init_is_deterministic_given_the_seed(name):
    _, _, a = build(name, seed=1)
    _, _, b = build(name, seed=1)
    _, _, c = build(name, seed=2)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not any(torch.equal(sa[k], sc[k]) for k in sa if sa[k].ndim == 2)


def test_llama_rope_table_is_rebuilt_after_to_empty():
    from torchacco.models.llama3.model import rope_table

    _, args, model = build("llama3", rope_scaling_factor=8.0, rope_original_max_seq_len=64)
    assert torch.equal(model.rope, rope_table(args))
    assert not torch.allclose(model.rope, rope_table(replace(args, rope_scaling_factor=None)))


def test_gpt_neo_head_stays_tied_to_wte_after_to_empty():
    _, args, model = build("gpt_neo")
    shapes = [p.shape for p in model.parameters()]
    assert shapes.count(model.wte.weight.shape) == 1  # no second vocab x dim matrix
    final = {}
    model.ln_f.register_forward_hook(lambda m, i, o: final.update(h=o))
    logits = model(torch.randint(0, args.vocab_size, (2, 16)))
    torch.testing.assert_close(logits, final["h"] @ model.wte.weight.T)


def test_gpt_neo_local_layer_sees_only_its_window():
    window, T = 8, 32
    _, args, model = build("gpt_neo", n_layers=1, attention_pattern=("local",), window_size=window)
    tokens = torch.randint(0, args.vocab_size, (1, T))
    changed = tokens.clone()
    changed[0, 0] = (tokens[0, 0] + 1) % args.vocab_size
    with torch.no_grad():
        diff = (model(tokens) - model(changed)).abs().amax(-1)[0]
    assert (diff[:window] > 0).all()  # positions 0..window-1 see token 0
    assert (diff[window:] == 0).all()  # later positions do not


@pytest.mark.parametrize("name,overrides", [
    ("llama3", {}),
    ("llama3", {"tie_embeddings": True}),
    ("gpt_neo", {"window_size": 1024}),  # all-global: kernels count the full causal square
])  # fmt: skip
def test_flops_per_token_matches_counted_flops(name, overrides):
    _, args, model = build(name, **overrides)
    B, T = 2, 128
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        model(torch.randint(0, args.vocab_size, (B, T))).sum().backward()
    # the formula counts norm/bias parameters as matmul weights: a hair above the count
    assert counter.get_total_flops() / (B * T) == pytest.approx(args.flops_per_token(T), rel=0.01)


# --- parity with Hugging Face transformers (fp32, eager attention as the reference) ---


def hf_model(cfg: dict, cls_name: str):
    transformers = pytest.importorskip("transformers")
    config_cls = {"GPTNeoForCausalLM": transformers.GPTNeoConfig, "LlamaForCausalLM": transformers.LlamaConfig}
    config = config_cls[cls_name](**cfg)
    config._attn_implementation = "eager"
    return getattr(transformers, cls_name)(config).eval()


def assert_logits_match(name, overrides, T, expected_missing=()):
    spec, args, model = build(name, **overrides)
    with torch.no_grad():  # O(1) activations, non-trivial norms and biases: every mapping matters
        for p in model.parameters():
            p.normal_(1.0, 0.2) if p.ndim == 1 else p.normal_(0.0, 0.1)
    cfg = spec.hf.hf_config(args)
    hf = hf_model(cfg, cfg["architectures"][0])
    missing, unexpected = hf.load_state_dict(spec.hf.to_hf(model.state_dict(), args), strict=False)
    assert (sorted(missing), unexpected) == (sorted(expected_missing), [])
    tokens = torch.randint(0, args.vocab_size, (2, T))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    assert ours.abs().max() > 0.1  # not a trivially small output
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    # and back: HF's full state dict (tied head and all) loads into ours unchanged
    back = spec.hf.from_hf(hf.state_dict(), args)
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())


def test_gpt_neo_logits_match_hf_beyond_the_local_window():
    # 4 layers global/local/global/local, window 16, sequence 100
    assert_logits_match(
        "gpt_neo", dict(vocab_size=500, dim=64, n_layers=4, window_size=16), T=100, expected_missing=["lm_head.weight"]
    )


def test_llama_logits_match_hf_with_gqa_and_rope_scaling():
    # short original context so the 3.1 scaling changes the frequencies that 160 positions use
    overrides = dict(vocab_size=500, dim=64, n_heads=8, n_kv_heads=2, n_layers=2,
                     rope_theta=10000.0, rope_scaling_factor=8.0, rope_original_max_seq_len=32)  # fmt: skip
    assert_logits_match("llama3", overrides, T=160)


def test_llama_logits_match_hf_without_scaling_and_with_tied_head():
    overrides = dict(vocab_size=500, dim=64, n_heads=4, n_layers=2, tie_embeddings=True)
    assert_logits_match("llama3", overrides, T=64, expected_missing=["lm_head.weight"])
