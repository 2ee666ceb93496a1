"""A seeded sample of a prompt is the same text whatever other prompts come with it, in `tinylm sample`,
in the library and in one request to the server holding several prompts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tinylm.generate import SamplingParams, generate

PROMPTS = ["To be, or", "Naïve café", "東京 and"]


def sample(run_dir, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "tinylm", "sample", "--run", str(run_dir), "--seed", "1", "--temperature", "1.0",
                           "--max-new-tokens", "12", *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.slow
def test_the_sample_command_gives_a_prompt_its_text_alone_or_among_others(run_dir):
    alone = sample(run_dir, "--prompt", "東京 and")
    together = sample(run_dir, *[a for p in PROMPTS for a in ("--prompt", p)])
    assert alone.startswith("東京 and") and alone in together  # the third prompt's block is the lone run's text
    assert together.count("--- prompt") == 3


def test_library_and_server_agree_per_prompt(run, client):
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=7, num_samples=2)
    together = generate(run.model, run.tokenizer, PROMPTS, params)
    for i, prompt in enumerate(PROMPTS):
        alone = generate(run.model, run.tokenizer, [prompt], params)
        assert [c.token_ids for c in alone] == [c.token_ids for c in together if c.prompt_index == i]
    # two samples of one prompt differ from each other (each has its own generator)
    assert together[0].token_ids != together[1].token_ids
    # the server, one request with all prompts, and one request per prompt
    batch = client.completions.create(model="tiny-run", prompt=PROMPTS, max_tokens=12, temperature=1.0, seed=7, n=2)
    by_prompt = {}
    for choice in batch.choices:
        by_prompt.setdefault(choice.index // 2, []).append(choice.text)
    for i, prompt in enumerate(PROMPTS):
        single = client.completions.create(model="tiny-run", prompt=prompt, max_tokens=12, temperature=1.0, seed=7, n=2)
        assert [c.text for c in single.choices] == by_prompt[i]
