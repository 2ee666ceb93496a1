"""EleutherAI's lm-evaluation-harness on any tinylm run: the harness's model API for every model family.

`TinyLMHarness` is a ``lm_eval.api.model.LM``, registered under the model name ``tinylm``, that answers the
harness's three kinds of request with a run's own model and tokenizer (a GPT, an LSTM or RNN, or an n-gram):

- ``loglikelihood(context, continuation)``: the summed log-probability of the continuation's tokens after the
  context's, and whether greedy decoding would have written exactly them (multiple choice, cloze);
- ``loglikelihood_rolling(text)``: the log-probability of a whole text (perplexity, bits per byte);
- ``generate_until(context, {"until": [...], ...})``: greedy (or sampled) text up to a stop string.

It tokenizes as the harness's ``HFLM`` does with a `tinylm export --format hf` folder, so the numbers are the
same as the export's under ``HFLM``:

- a text's ids are the run's `tinylm.run.Run.start_ids` (EOS for tinylm's own tokenizers: the separator
  documents followed in training; the BOS of an imported Llama) followed by the tokenizer's ids;
- a (context, continuation) pair moves the context's trailing spaces to the continuation, encodes context and
  context + continuation, and takes the continuation's ids as what the longer one has beyond the context's;
  an empty context is the start token alone;
- a pair longer than the model's context (block_size) keeps its last block_size + 1 tokens (the last one is
  only predicted);
- a text is read in the harness's rolling windows (``get_rolling_token_windows``): disjoint windows of
  block_size targets, the first read after the start token, the last one given a full window of context.
  Unlike ``HFLM``, the start token is only read, never scored as the text's first target, so a text's
  log-likelihood is the one `tinylm eval` sums (`tinylm.evaluate`). An n-gram model's windows overlap by its
  order - 1 tokens, so every target keeps its whole n-gram context, as in `tinylm eval`;
- a generation's context keeps its last block_size - max_gen_toks tokens, so that prompt and generation fit
  the model's context as they do in ``HFLM``.

From Python (``pip install -e ".[harness]"``)::

    from tinylm.harness import TinyLMHarness, run_harness

    out = run_harness("runs/tiny-shakespeare", ["shakespeare_cloze"], include_path="examples/harness", shots=5)
    print(out["results"]["shakespeare_cloze"]["acc,none"])

    lm = TinyLMHarness("runs/tiny-shakespeare", batch_size=16)      # the harness's own call takes it too
    out = lm_eval.simple_evaluate(model=lm, tasks=["hellaswag"])

Once this module is imported the harness also finds it by name: ``lm_eval.simple_evaluate(model="tinylm",
model_args="run=runs/x")``, and ``python -m tinylm.harness --model tinylm --model_args run=runs/x --device cpu
--batch_size 16 --tasks ...`` is the harness's own command line with it (whose default device is cuda:0).
``tinylm eval --run R --harness TASKS`` runs tasks through `run_harness`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tinylm.device import use_threads
from tinylm.errors import TinyLMError

HARNESS_MISSING = 'lm-evaluation-harness is not installed; install it with: pip install -e ".[harness]"'

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import model_registry, register_model
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError:  # an optional extra: say how to get it, in one line
    raise TinyLMError(HARNESS_MISSING) from None

from tinylm.generate.engine import Engine
from tinylm.generate.sampling import SamplingParams
from tinylm.model import NGramLM
from tinylm.run import Run, load_run
from tinylm.scoring import encode_pair, loglikelihoods

# Requests per forward pass when the caller does not choose (the harness's own default is 1).
DEFAULT_BATCH_SIZE = 16
# New tokens a generation may write when its task does not say (the harness's own default).
DEFAULT_MAX_GEN_TOKS = 256


class TinyLMHarness(LM):
    """A tinylm run (any family) behind lm-evaluation-harness's model API (see the module docstring).

    ``run`` is a run folder (``checkpoint`` "best", "latest" or a checkpoint folder) or a `tinylm.run.Run`
    already loaded; ``device`` as for `tinylm eval` (default "auto": the GPU when there is one). ``batch_size``
    is how many requests share a forward pass ("auto" and None: 16); ``max_length`` caps the context read
    (default and most: the run's block_size). The harness's ``--model_args`` give these as text:
    ``run=runs/x,batch_size=8,device=cpu``; its ``max_batch_size`` (for its own "auto" search) plays no part.
    """

    def __init__(self, run: str | os.PathLike | Run, checkpoint: str = "best", batch_size: int | str | None = None,
                 device: str | None = None, max_length: int | str | None = None, max_batch_size: Any = None) -> None:
        super().__init__()
        self.run = run if isinstance(run, Run) else load_run(run, checkpoint=checkpoint, device=device or "auto")
        self.model = self.run.model.eval()
        self.tokenizer = self.run.tokenizer
        self.batch_size = _whole(batch_size, "batch_size", default=DEFAULT_BATCH_SIZE)
        block_size = self.run.config.model.block_size
        self.max_length = min(_whole(max_length, "max_length", default=block_size), block_size)
        self.start_ids = list(self.run.start_ids)
        # the token a text is read after: the last start token, or EOS where texts start with nothing
        self.prefix_id = self.start_ids[-1] if self.start_ids else self.tokenizer.eos_id
        self._device = next(self.model.parameters()).device

    # ----- tokens ---------------------------------------------------------------------------------

    def tok_encode(self, text: str, *, start: bool = True) -> list[int]:
        """``text``'s ids, after the run's start ids (as the exported tokenizer puts them) unless ``start`` is False."""
        return (self.start_ids if start else []) + self.tokenizer.encode(text)

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context ids, continuation ids) of a loglikelihood request, split as the harness splits them."""
        return encode_pair(self.tokenizer, context, continuation, self.start_ids)

    def fit(self, context: list[int], continuation: list[int]) -> tuple[list[int], list[int]]:
        """The pair cut from the left to the model's context: at most max_length + 1 tokens in all."""
        if len(continuation) > self.max_length:
            raise TinyLMError(f"a continuation of {len(continuation)} tokens does not fit the model's context of "
                              f"{self.max_length}; score shorter continuations")
        keep = self.max_length + 1 - len(continuation)
        return context[-keep:], continuation

    # ----- the harness's three requests ------------------------------------------------------------

    def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(log p(continuation | context), whether greedy decoding writes the continuation) per request."""
        pairs = [self.fit(*self.encode_pair(*r.args)) for r in requests]
        return self.score(pairs)

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """log p(text) per request, read in the harness's rolling windows after the start token."""
        windows, owner = [], []
        for i, request in enumerate(requests):
            for window in self.rolling_windows(request.args[0]):
                windows.append(window)
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, self.score(windows)):
            totals[i] += logprob
        return totals

    def rolling_windows(self, text: str) -> list[tuple[list[int], list[int]]]:
        """(context, targets) of each window a text is scored in: every token of it a target once."""
        ids = self.tok_encode(text, start=False)
        return [make_disjoint_window(w) for w in get_rolling_token_windows(
            token_list=ids, prefix_token=self.prefix_id, max_seq_len=self.max_length, context_len=self.overlap)]

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """The text written after each context up to its first stop string (greedy unless the task samples)."""
        out: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(repr(sorted(request.args[1].items())), []).append(i)
        for members in groups.values():
            kwargs = requests[members[0]].args[1]
            texts = self.generate([requests[i].args[0] for i in members], kwargs)
            for i, text in zip(members, texts):
                out[i] = text
        return out

    def generate(self, contexts: Sequence[str], gen_kwargs: dict) -> list[str]:
        """Completions of ``contexts`` under one set of the harness's generation settings, batch by batch."""
        kwargs = normalize_gen_kwargs(gen_kwargs, DEFAULT_MAX_GEN_TOKS)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=self.tokenizer.decode([self.tokenizer.eos_id]))
        max_new = kwargs.pop("max_gen_toks")
        room = self.max_length - max_new
        if room <= 0:
            raise TinyLMError(f"the task asks for up to {max_new} new tokens, but the model's context holds "
                              f"{self.max_length}; give the task a smaller generation_kwargs max_gen_toks")
        params = sampling_params(kwargs, max_new, until)
        engine = Engine(self.model, params, self.tokenizer, long_prompts="cut")
        texts = []
        for start in range(0, len(contexts), self.batch_size):
            prompts = [self.tok_encode(c)[-room:] for c in contexts[start:start + self.batch_size]]
            for completion in engine.generate(prompts):
                texts.append(postprocess_generated_text(completion.text, until, None))
        return texts

    # ----- scoring ---------------------------------------------------------------------------------

    def score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(summed log-probability of the continuation, whether it is the greedy one) for (context, continuation)
        id pairs that fit the model's context."""
        return loglikelihoods(self.model, pairs, batch_size=self.batch_size)

    @property
    def overlap(self) -> int:
        """Tokens each rolling window reads before its first target: 1 for a network (disjoint windows, as in
        `tinylm eval`), n - 1 for an n-gram model (its whole context, as in `tinylm eval`)."""
        return max(1, self.model.ngram.order - 1) if isinstance(self.model, NGramLM) else 1

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def tokenizer_name(self) -> str:
        return str(self.run.path)


# the harness finds the adapter by name (once: a second import of this module leaves the first class there)
if "tinylm" not in model_registry:
    register_model("tinylm")(TinyLMHarness)


def _whole(value: int | str | None, name: str, *, default: int) -> int:
    """A positive whole-number setting given as a number or as text (the harness's model_args); None, "" and
    "auto" are ``default``."""
    if value is None or str(value).strip() in ("", "auto"):
        return default
    try:
        number = int(str(value).strip())
    except ValueError:
        number = 0
    if number < 1:
        raise TinyLMError(f"{name} must be a positive whole number, got {value!r}")
    return number


def sampling_params(kwargs: dict, max_new: int, until: list[str]) -> SamplingParams:
    """tinylm's `SamplingParams` for the harness's normalised generation settings: greedy unless do_sample."""
    if not kwargs.get("do_sample"):
        return SamplingParams(max_new_tokens=max_new, temperature=0.0, stop=tuple(until))
    return SamplingParams(max_new_tokens=max_new, temperature=float(kwargs.get("temperature", 1.0)),
                          top_k=kwargs.get("top_k"), top_p=kwargs.get("top_p"), seed=kwargs.get("seed"),
                          stop=tuple(until))


# the builders of `datasets` that read local files: a task of one of these reads no hub
LOCAL_BUILDERS = ("json", "csv", "text", "parquet", "arrow")


def run_harness(run: str | os.PathLike | Run, tasks: Sequence[str], *, include_path: str | None = None,
                shots: int | None = None, limit: int | None = None, checkpoint: str = "best", device: str = "cpu",
                batch_size: int | None = None, threads: int | None = None,
                log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """lm_eval.simple_evaluate on ``tasks`` (the harness's task names) with the run behind `TinyLMHarness`;
    returns the harness's results (its "results" hold each task's metrics, "n-shot" the shots).

    ``include_path`` is a folder of task YAMLs of one's own. Relative ``data_files`` in them are read beside
    their YAML (the harness alone reads them from the working folder). When every task is such a local task
    reading local files (``dataset_path: json``, csv, ...), `datasets` and the hub client are told to stay
    offline (HF_DATASETS_OFFLINE=1, HF_HUB_OFFLINE=1, unless already set), so they never wait on the network.
    ``shots``: examples before each question (default: each task's own num_fewshot); ``limit``: the first
    ``limit`` items of each task; ``threads``: CPU threads (`tinylm.device.use_threads`, which says its choice
    to ``log``)."""
    import lm_eval

    if shots is not None and shots < 0:
        raise TinyLMError(f"--shots must be 0 or more examples, got {shots}")

    manager = _task_manager(tasks, include_path)
    specs = [_local_config(manager, name) or name for name in tasks]
    if all(isinstance(spec, dict) for spec in specs):
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    lm = TinyLMHarness(run, checkpoint=checkpoint, batch_size=batch_size, device=device)
    with use_threads(device, threads, log=log):
        return lm_eval.simple_evaluate(model=lm, tasks=specs, num_fewshot=shots, limit=limit, task_manager=manager)


def results_table(results: dict[str, Any]) -> str:
    """The harness's own table of each task's metrics (value and standard error)."""
    from lm_eval.utils import make_table

    return make_table(results).rstrip()


def _task_manager(tasks: Sequence[str], include_path: str | None):
    """The harness's task index: ``include_path`` alone when it holds every task asked for (indexing the
    harness's thousands of built-in tasks takes seconds), else with the built-in tasks too."""
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        if not Path(include_path).is_dir():
            raise TinyLMError(f"--include-path {include_path} is not a folder of task YAMLs")
        local = TaskManager(include_path=include_path, include_defaults=False)
        if all(name in local.task_index for name in tasks):
            return local
    manager = TaskManager(include_path=include_path)
    unknown = [name for name in tasks if name not in manager.task_index]
    if unknown:
        where = f" in {include_path} or" if include_path else ""
        raise TinyLMError(f"no lm-evaluation-harness task named {', '.join(unknown)}{where} among the harness's "
                          "own tasks (list them with `lm_eval ls tasks`)")
    return manager


def _local_config(manager, name: str) -> dict[str, Any] | None:
    """The config of task ``name`` when it is one YAML reading local files, with its relative data_files made
    paths beside the YAML; None for anything else (a built-in task, a group, a dataset on the hub)."""
    from lm_eval.tasks._index import Kind
    from lm_eval.tasks._yaml_loader import load_yaml

    entry = manager.task_index[name]
    if entry.yaml_path is None or entry.kind is not Kind.TASK:
        return None
    config = load_yaml(entry.yaml_path, resolve_func=True)
    if config.get("dataset_path") not in LOCAL_BUILDERS:
        return None
    folder = Path(entry.yaml_path).parent
    files = (config.get("dataset_kwargs") or {}).get("data_files")
    if files is not None:
        config["dataset_kwargs"] = {**config["dataset_kwargs"], "data_files": _beside(files, folder)}
    return config


def _beside(files: str | list | dict, folder: Path) -> str | list | dict:
    """data_files (a path, a list or a split -> paths mapping) with each relative path that names a file in
    ``folder`` made that file's path."""
    if isinstance(files, dict):
        return {split: _beside(paths, folder) for split, paths in files.items()}
    if isinstance(files, list):
        return [_beside(path, folder) for path in files]
    here = folder / files
    return str(here) if not Path(files).is_absolute() and here.exists() else files


if __name__ == "__main__":  # the harness's own command line, with the tinylm model registered
    from lm_eval.__main__ import cli_evaluate

    try:
        cli_evaluate()
    except TinyLMError as e:  # a mistake in the run or its settings: one line, as tinylm's commands say it
        raise SystemExit(f"tinylm: error: {e}") from None
