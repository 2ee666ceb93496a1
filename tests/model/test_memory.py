"""Sizes that cannot fit are refused before allocation, in one line with the numbers (`tinylm.model.memory`),
whichever way the model is built; sizes that fit, the presets among them, still build."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from tinylm.cli import main
from tinylm.config import Config, GPTConfig, TrainConfig, resolve_config
from tinylm.errors import TinyLMError
from tinylm.model import GPT, build_model, memory
from tinylm.model.memory import check_fits, count_params, format_bytes, machine_memory, memory_parts
from tinylm.run import checkpoint_path, load_checkpoint, save_checkpoint, write_run_info
from tinylm.tokenizers import CharTokenizer

SMALL = dict(vocab_size=64, block_size=16, n_layer=2, d_model=16, n_head=2)


def refusal(config: GPTConfig) -> str:
    with pytest.raises(TinyLMError) as caught:
        build_model(config)
    message = str(caught.value)
    assert "\n" not in message
    return message


# each far beyond any machine's memory; a width's refusal names the field that is out of scale
@pytest.mark.parametrize("settings, field", [
    (dict(n_layer=10**8), "n_layer"),
    (dict(d_model=10**7, n_head=1), "d_model"),
    (dict(d_ff=10**12), "d_ff"),
    (dict(d_head=10**11), "d_head"),
    (dict(bigram_hash=10**13), "bigram_hash"),
    (dict(vocab_size=10**12), "vocab_size"),
    (dict(block_size=10**13), "block_size"),  # learned positions: a table of block_size rows
    (dict(family="lstm", n_layer=10**9, n_head=1), "n_layer"),
], ids=lambda value: next(iter(value)) if isinstance(value, dict) else None)
def test_weights_that_cannot_fit_are_refused_with_their_size(settings, field):
    config = GPTConfig(**{**SMALL, **settings})
    message = refusal(config)
    assert f"the model would need {format_bytes(4 * count_params(config))} for its weights alone" in message
    assert f"({count_params(config):,} parameters of 4 bytes), more than this machine's " \
           f"{format_bytes(machine_memory())} of memory" in message
    assert f"lower {field} (now {getattr(config, field)}" in message


@pytest.mark.parametrize("positions", ["rope", "none"])
def test_a_context_too_long_for_its_tables_and_cache_is_refused(positions):
    # the weights are small; RoPE's tables and the KV cache, both block_size long, are not
    config = GPTConfig(**{**SMALL, "block_size": 10**12, "positions": positions})
    message = refusal(config)
    parts = memory_parts(config)
    assert f"the model would need {format_bytes(sum(parts.values()))} before any activation" in message
    assert f"KV cache {format_bytes(parts['KV cache'])}" in message and "lower block_size (now 1000000000000" in message
    assert ("position tables" in message) == (positions == "rope")
    most = int(re.search(r"at most ([\d,]+) could fit", message)[1].replace(",", ""))
    fits = [sum(memory_parts(dataclasses.replace(config, block_size=n)).values()) <= machine_memory()
            for n in (most, most + 1)]
    assert fits == [True, False]


def test_a_narrow_model_of_absurd_depth_is_refused_for_the_time_it_would_take():
    message = refusal(GPTConfig(**{**SMALL, "n_layer": memory.MAX_LAYERS + 1}))
    assert message.startswith(f"n_layer {memory.MAX_LAYERS + 1} is more layers than any language model has")


@pytest.mark.parametrize("preset", ["tiny", "classic", "small", "medium", "gpt2-124m", "llama", "lstm", "rnn"])
def test_the_presets_fit_and_build(preset):
    config = resolve_config(preset=preset)
    check_fits(config.model, config.train)  # training them, optimizer and step batch included
    with torch.device("meta"):  # the shapes, through the same check, without the memory
        model = build_model(config.model)
    assert sum(p.numel() for p in model.parameters()) > 0


def test_on_a_smaller_machine_the_numbers_say_what_does_not_fit(monkeypatch):
    config = resolve_config(preset="gpt2-124m")
    training = sum(memory_parts(config.model, config.train).values())
    inference = sum(memory_parts(config.model).values())
    assert inference < training
    monkeypatch.setattr(memory, "machine_memory", lambda: (inference + training) // 2)
    with torch.device("meta"):
        GPT(config.model)  # sampling fits
    with pytest.raises(TinyLMError) as caught:
        check_fits(config.model, config.train)  # training does not: gradients and AdamW's or Muon's state
    message = str(caught.value)
    assert message.startswith(f"training the model with {config.train.optimizer} would need "
                              f"{format_bytes(training)} before any activation (weights ")
    assert f"more than this machine's {format_bytes((inference + training) // 2)} of memory" in message


def test_the_gpu_is_measured_by_its_own_memory_and_fsdp_shards_count(monkeypatch):
    config = resolve_config(preset="gpt2-124m")
    on_gpu = sum(size for name, size in memory_parts(config.model, config.train).items()
                 if name != "a step's token ids")
    monkeypatch.setattr(memory, "gpu_memory", lambda device: on_gpu - 1)
    with pytest.raises(TinyLMError, match=rf"more than the GPU's {format_bytes(on_gpu - 1)} \(cuda:0\)"):
        check_fits(config.model, config.train, "cuda:0")
    check_fits(config.model, config.train, "cuda:0", shards=2)  # each GPU keeps half of the weights and state


def test_a_checkpoint_whose_configuration_cannot_fit_is_refused_by_load_and_by_the_commands(tmp_path, capsys):
    tokenizer = CharTokenizer.train("to be or not to be")
    small = Config(GPTConfig(**{**SMALL, "vocab_size": tokenizer.vocab_size}), TrainConfig())
    huge = dataclasses.replace(small, model=dataclasses.replace(small.model, n_layer=10**8))
    run = tmp_path / "run"
    # weights of a small model under a configuration edited by hand to 100 million layers
    save_checkpoint(checkpoint_path(run, "latest"), model_state=GPT(small.model).state_dict(), optimizer_state=None,
                    rng_state={}, state={"step": 1}, config=huge, tokenizer=tokenizer)
    (run / "config.toml").write_text((checkpoint_path(run, "latest") / "config.toml").read_text())
    tokenizer.save(run / "tokenizer.json")
    write_run_info(run, {"status": "complete"})
    with pytest.raises(TinyLMError, match=r"for its weights alone .* lower n_layer \(now 100000000"):
        load_checkpoint(checkpoint_path(run, "latest")).build_model()
    for argv in (["sample", "--run", str(run), "--prompt", "to", "--max-new-tokens", "2"],
                 ["eval", "--run", str(run)]):
        code = main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and "for its weights alone" in err[0], err
