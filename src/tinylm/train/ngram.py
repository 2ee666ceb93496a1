"""`tinylm train --model ngram`: an n-gram model's training is counting.

The run goes through the same front door as a Transformer's: the same configuration (the
``[model]`` keys ``order``, ``smoothing`` and ``add_k``; the ``[train]`` corpus and tokenizer
settings), the same prepared shards (a Transformer and an n-gram model trained with the same
settings share one data folder, hence one validation split), and a run folder that `load_run`,
`tinylm eval`, `tinylm sample`, `tinylm compare` and `tinylm serve` read like any other::

    config.toml  tokenizer.json  run.json  metrics.jsonl  ngram.npz

There are no steps, optimizer or checkpoints: the counts are the model. Counting is one pass
(seconds for Shakespeare at n = 5), so there is nothing to resume; a new count replaces the old
one only with ``--force``.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from pathlib import Path

from tinylm.atomic import atomic_write_text
from tinylm.config import Config, dump_toml
from tinylm.data.prepare_run import prepare_data
from tinylm.errors import TinyLMError
from tinylm.evaluate import evaluate_model, split_text
from tinylm.generate.engine import Engine
from tinylm.generate.opening import opening_of_shards
from tinylm.generate.sampling import SamplingParams
from tinylm.model import NGramLM, NGramModel
from tinylm.run import (
    CONFIG_FILE,
    METRICS_FILE,
    NGRAM_FILE,
    TOKENIZER_FILE,
    RunResult,
    check_new_run_folder,
    clear_run_folder,
    data_info,
    empty_prompt_ids,
    start_ids,
    write_metrics,
    write_run_info,
)
from tinylm.tokenizers.base import generation_excluded
from tinylm.train.progress import sample_lines


def count_ngram(
    config: Config,
    out_dir: str | os.PathLike,
    *,
    resume: bool | str = False,
    force: bool = False,
    init_from: str | os.PathLike | None = None,
    log: Callable[[str], None] = print,
) -> RunResult:
    """Count the n-gram model ``config.model`` describes on the configured corpus into the run folder ``out_dir``."""
    if resume:
        raise TinyLMError("an n-gram model is counted in one pass, so there is nothing to resume; "
                          "count it again with --force")
    if init_from is not None:
        raise TinyLMError("--init-from starts from a network's weights; an n-gram model has counts, not weights")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise TinyLMError("an n-gram model is counted in one pass by one process (in seconds); run it without "
                          "torchrun")
    out = Path(out_dir)
    mc, tc = config.model, config.train
    check_new_run_folder(out, force)
    shards = prepare_data(tc, None, log)
    tokenizer = shards.tokenizer()
    config = dataclasses.replace(config, model=dataclasses.replace(mc, vocab_size=tokenizer.vocab_size))
    mc = config.model
    log(f"tinylm train: counting a {mc.order}-gram model ({mc.smoothing} smoothing) into {out}")
    started = time.perf_counter()
    ngram = NGramModel.fit_shards(shards, mc.order, smoothing=mc.smoothing, k=mc.add_k)
    counted = time.perf_counter() - started
    log(f"counted {ngram.train_tokens:,} tokens in {counted:.1f} s: "
        f"{', '.join(f'{len(k):,}' for k in ngram.keys)} distinct n-grams of orders 1..{mc.order}, "
        f"{ngram.nbytes / 2**20:,.0f} MB")
    # scored as `tinylm eval` scores it (an <unk> token's bytes charged too)
    model = NGramLM(ngram, mc, never=generation_excluded(tokenizer))  # as `load_run` gives it back
    val = evaluate_model(model, split_text(shards, "val"), tokenizer, block_size=mc.block_size)
    elapsed = time.perf_counter() - started

    if force:
        clear_run_folder(out, keep=shards.path)  # only now: a mistake found while counting left the old run as it was
    out.mkdir(parents=True, exist_ok=True)
    # run.json first: a folder with tinylm's run.json is a run, and only a run is ever replaced
    write_run_info(out, {"status": "counting", "step": 0, "total_steps": 0, "family": "ngram",
                         "data": data_info(shards)})
    atomic_write_text(out / CONFIG_FILE, dump_toml(config.to_dict()))
    tokenizer.save(out / TOKENIZER_FILE)
    ngram.save(out / NGRAM_FILE)
    final = {"loss": val.loss, "perplexity": val.perplexity, "bits_per_byte": val.bits_per_byte,
             "tokens": val.tokens, "prorated": False}
    write_metrics(out / METRICS_FILE, [{"kind": "final", "step": 0, **val.as_dict(), "elapsed": elapsed}])
    sample, start = _sample(model, config, tokenizer, shards)
    write_run_info(out, {"status": "complete", "step": 0, "total_steps": 0, "family": "ngram",
                         "data": data_info(shards), "train_tokens": ngram.train_tokens, "final": final,
                         "sample": sample, "elapsed": elapsed})
    log(f"validation: loss {val.loss:.4f}, perplexity {val.perplexity:.2f}, {val.bits_per_byte:.4f} bits per byte "
        f"(the whole validation split, {val.tokens:,} tokens)")
    if val.unknown_tokens:
        log(f"  ({val.unknown_tokens:,} <unk> tokens stand for {val.unknown_bytes:,.0f} bytes the tokenizer cannot "
            "spell: bits per byte charges them 8 bits each)")
    log(f"model: {out / NGRAM_FILE}")
    for line in sample_lines(tc, sample, start):
        log(line)
    return RunResult(out, "complete", 0, 0, ngram.train_tokens, None, final, out / NGRAM_FILE, None, None, sample,
                     elapsed)


def _sample(model: NGramLM, config: Config, tokenizer, shards) -> tuple[str, str]:
    """The closing sample and what it started from, drawn by the same engine, settings and opening line as a
    Transformer run's."""
    tc = config.train
    if not tc.sample_tokens:
        return "", ""
    opening = opening_of_shards(shards, tc.seed)
    prompt = (start_ids(config, tokenizer) + tokenizer.encode(opening.text) if opening.text
              else empty_prompt_ids(config, tokenizer))
    params = SamplingParams(max_new_tokens=tc.sample_tokens, temperature=tc.sample_temperature,
                            top_k=tc.sample_top_k or None, seed=tc.seed)
    (completion,) = Engine(model, params, tokenizer).generate([prompt])
    return opening.text + completion.text, opening.describe()
