"""The TOML config: typed sections, CLI overrides, errors that say what to fix."""

from pathlib import Path

import pytest
import torch

from torchacco.config import config_from_dict, load_config, load_toml
from torchacco.errors import UserError
from torchacco.spec import get_model_spec

CONFIGS = sorted(Path(__file__).parent.parent.joinpath("train_configs").glob("*.toml"))


def test_overrides_convert_types():
    cfg = load_config(
        [
            "--training.steps",
            "20",
            "--optimizer.lr",
            "3e-4",
            "--metrics.tensorboard",
            "false",
            "--training.max_tokens=1e6",
            "--parallelism.data_parallel",
            "fsdp",
        ]
    )
    assert cfg.training.steps == 20 and cfg.optimizer.lr == 3e-4 and cfg.metrics.tensorboard is False
    assert cfg.training.max_tokens == 1_000_000 and cfg.parallelism.data_parallel == "fsdp"


def test_override_beats_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[training]\nsteps = 5\nseq_len = 64\n")
    cfg = load_config(["--config", str(path), "--training.steps", "7"])
    assert (cfg.training.steps, cfg.training.seq_len) == (7, 64)


def test_unknown_key_lists_valid_keys(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[training]\nstepz = 5\n")
    with pytest.raises(
        UserError,
        match=r"c.toml: unknown key 'stepz' in \[training\]; did you mean 'steps'\? valid keys: seq_len, .*steps",
    ):
        load_config(["--config", str(path)])


def test_unknown_section_lists_sections():
    with pytest.raises(
        UserError, match=r"unknown section \[trainer\]; did you mean 'training'\? valid sections: job, model"
    ):
        load_config(["--trainer.steps", "3"])
    with pytest.raises(UserError, match=r"unknown section \[xyz\]; valid sections: job, model"):  # nothing close
        load_config(["--xyz.steps", "3"])


def test_wrong_type_names_file_key_and_type(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[training]\nsteps = "many"\n')
    with pytest.raises(UserError, match=r"c.toml: \[training\] steps: expected int, got str 'many'"):
        load_config(["--config", str(path)])
    with pytest.raises(UserError, match=r"--optimizer.lr: \[optimizer\] lr: expected float, got 'fast'"):
        load_config(["--optimizer.lr", "fast"])
    with pytest.raises(UserError, match="expected int"):
        load_config(["--training.steps", "2.5"])


def test_choices_are_checked():
    with pytest.raises(UserError, match="is not one of: ddp, zero1, fsdp, hsdp, acco, dpu, wp"):
        load_config(["--parallelism.data_parallel", "zero2"])


def test_missing_file_and_syntax_error(tmp_path):
    with pytest.raises(UserError, match="config file not found"):
        load_config(["--config", str(tmp_path / "nope.toml")])
    bad = tmp_path / "bad.toml"
    bad.write_text("[training\nsteps = 1\n")
    with pytest.raises(UserError, match="TOML syntax error"):
        load_config(["--config", str(bad)])


def test_malformed_cli():
    with pytest.raises(UserError, match="needs a value"):
        load_config(["--training.steps"])
    with pytest.raises(UserError, match="--section.key VALUE"):
        load_config(["--steps", "3"])
    with pytest.raises(UserError, match="unexpected argument"):
        load_config(["steps"])


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(["--training.steps", "11", "--job.name", "x y", "--optimizer.lr", "0.5"])
    dumped = tmp_path / "resolved.toml"
    dumped.write_text(cfg.to_toml())
    assert config_from_dict(load_toml(dumped)) == cfg


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads_and_builds_on_meta(path):
    cfg = load_config(["--config", str(path)])
    spec = get_model_spec(cfg.model.name)
    args = spec.args(cfg.model.flavor, vocab_size=cfg.model.vocab_size or None)
    assert cfg.training.seq_len <= args.max_seq_len
    with torch.device("meta"):
        model = spec.model_cls(args)
    assert sum(p.numel() for p in model.parameters()) > 0
    assert len(model.layers) == args.n_layers


def test_data_parallel_choices_are_the_registered_strategies_whose_lines_match_their_classes():
    from torchacco.config import choices
    from torchacco.parallel.registry import BUILT_IN, strategies

    assert set(choices("parallelism", "data_parallel")) == set(strategies())
    for name, cls in strategies().items():
        assert cls.name == name and cls.traits.communication in (
            "all_reduce_in_backward",
            "per_micro_batch",
            "sharded_job",
        )
        assert cls.traits.options is BUILT_IN[name][1]  # the config reads a strategy's section before its class


def test_configuration_reference_is_the_one_generated_from_the_config():
    from torchacco.config import reference_markdown

    doc = Path(__file__).parent.parent / "docs" / "configuration.md"
    assert doc.read_text(encoding="utf-8") == reference_markdown(), (
        "docs/configuration.md is out of date: python -m torchacco config > docs/configuration.md"
    )


def test_every_key_has_a_line_of_help_and_a_literal_for_fixed_choices():
    import dataclasses

    from torchacco.config import _sections

    for name, section in _sections().items():  # the strategies' sections ([acco]) included
        for f in dataclasses.fields(section):
            assert f.metadata.get("help"), f"[{name}] {f.name} has no help"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_multi_gpu_recipe_checkpoints_at_an_interval_and_keeps_a_few(path):
    """A cluster job restarts from its latest checkpoint (MAX_RESTARTS): one that never saves starts over."""
    cfg = load_config(["--config", str(path)])
    nodes, gpus = map(int, cfg.job.cluster.split("x"))
    if nodes * gpus <= 2:
        return  # the CPU defaults: minutes long
    c = cfg.checkpoint
    assert c.enable and 0 < c.every <= cfg.training.steps // 10 and c.keep > 0, (c.enable, c.every, c.keep)
