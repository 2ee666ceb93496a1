"""Generation: turning a trained model's next-token distributions into text.

- `generate` (engine.py): the one call behind `tinylm sample`: prompts in, completions out, through
  a preallocated KV cache, with batches of prompts of different lengths (left padding).
- `SamplingParams` (sampling.py): greedy, temperature, top-k, top-p, min-p, seeds, stops, beams;
  the filters apply in that order.
- `reference_generate` (reference.py): the naive generator that recomputes every step; the
  oracle the engine is tested against, and what `train` uses for its closing sample.
- `stream` (engine.py, with stream.py's `TextStream`): text pieces as tokens arrive, never splitting a
  character.
- `next_token_candidates` (inspect.py): the next-token distribution, for learners.
"""

from tinylm.generate.engine import Completion, generate, stream
from tinylm.generate.inspect import next_token_candidates
from tinylm.generate.reference import reference_generate
from tinylm.generate.sampling import SamplingParams

__all__ = ["Completion", "SamplingParams", "generate", "next_token_candidates", "reference_generate", "stream"]
