"""The whole path for weights people already have: a `transformers` checkpoint imported into a run, fine-tuned, sampled.

The checkpoint is a tiny random Llama written by `transformers`' own ``save_pretrained``; it becomes a
run directory (`import_hf_into_run`), trains for a few steps on Shakespeare with ``init_from`` (what
``tinylm train --init-from RUN`` calls), and the tuned run samples text. Training starts from the
imported weights: after a few small steps they are still close to them, and far from a fresh init.
"""

from __future__ import annotations

import pytest
import torch
from exportkit import randomize

from tinylm.config import Config, TrainConfig, build_config, load_config_file
from tinylm.export import import_hf_into_run
from tinylm.generate.engine import generate
from tinylm.generate.sampling import SamplingParams
from tinylm.model import GPT
from tinylm.run import load_run
from tinylm.tokenizers.formats import save_hf_tokenizer_json
from tinylm.train import train

import transformers


@pytest.mark.slow  # tokenizing Shakespeare takes a few seconds
def test_import_fine_tune_on_shakespeare_and_sample(tmp_path, tokenizer, shakespeare_corpus):
    config = transformers.LlamaConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = randomize(transformers.LlamaForCausalLM(config))
    hf.save_pretrained(tmp_path / "hf")
    save_hf_tokenizer_json(tokenizer, tmp_path / "hf" / "tokenizer.json")

    imported = import_hf_into_run(tmp_path / "hf", tmp_path / "imported")
    start = load_run(imported).model.state_dict()
    run_config = build_config(load_config_file(imported / "config.toml"))
    settings = TrainConfig(corpus="shakespeare", data_dir=str(tmp_path / "data"), max_steps=3, batch_size=2,
                           lr=1e-3, warmup_steps=1, eval_interval=3, eval_tokens=512, final_eval_tokens=512,
                           sample_tokens=0, threads=1, device="cpu")
    result = train(Config(model=run_config.model, train=settings), tmp_path / "tuned", init_from=imported,
                   progress=False, log=lambda line: None)
    assert result.status == "complete" and result.step == 3

    tuned = load_run(tmp_path / "tuned")
    assert tuned.tokenizer.fingerprint() == tokenizer.fingerprint()
    after = tuned.model.state_dict()
    with torch.random.fork_rng(devices=[]):
        fresh = GPT(run_config.model).state_dict()
    moved = max((after[k] - start[k]).abs().max().item() for k in start)
    assert 0 < moved < 0.01  # three steps of lr 1e-3 from the imported weights...
    assert (fresh["E.weight"] - start["E.weight"]).abs().max() > 0.5  # ...which are not what a fresh init gives

    (completion,) = generate(tuned.model, tuned.tokenizer, "", SamplingParams(max_new_tokens=20, seed=0),
                             start_ids=tuned.start_ids)
    assert len(completion.token_ids) > 0 and isinstance(completion.text, str)


@pytest.mark.slow
def test_the_train_command_fine_tunes_an_imported_run_without_a_config(tmp_path, tokenizer, shakespeare_corpus):
    """`tinylm train --init-from RUN` takes the model's shape from RUN (not the tiny preset's), then samples."""
    import subprocess
    import sys

    config = transformers.GPT2Config(vocab_size=tokenizer.vocab_size, n_embd=32, n_layer=2, n_head=2, n_positions=64)
    torch.manual_seed(0)
    randomize(transformers.GPT2LMHeadModel(config)).save_pretrained(tmp_path / "hf")
    save_hf_tokenizer_json(tokenizer, tmp_path / "hf" / "tokenizer.json")

    def tinylm(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tinylm", *args], capture_output=True, text=True, cwd=tmp_path)

    assert tinylm("import", "--from", "hf", "--out", "imported").returncode == 0
    tuned = tinylm("train", "--init-from", "imported", "--out", "tuned", "--max-steps", "2", "--batch-size", "2",
                   "--eval-tokens", "256", "--final-eval-tokens", "256", "--sample-tokens", "0", "--threads", "1",
                   "--no-progress")
    assert tuned.returncode == 0, tuned.stderr
    assert "2 layers, d_model 32" in tuned.stdout
    sample = tinylm("sample", "--run", "tuned", "--prompt", "To be", "--max-new-tokens", "8", "--seed", "0")
    assert sample.returncode == 0 and sample.stdout.startswith("To be")
