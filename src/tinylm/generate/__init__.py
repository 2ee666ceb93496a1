"""Generation: turning a trained model's next-token distributions into text.

- `generate_naive`: ancestral sampling that recomputes the whole context at every step, with
  temperature, top-k, a seed, and a stop at EOS. The readable reference every faster sampler
  is tested against (`tinylm.generate.naive`).
- `next_token_distribution`: logits -> probabilities after temperature and top-k.
"""

from tinylm.generate.naive import generate_naive, next_token_distribution

__all__ = ["generate_naive", "next_token_distribution"]
