"""A reward function that reads token ids as well as text (docs/data.md, "Reward functions").

The digit score of the text, minus 0.05 per sampled token beyond the answer's digits and
one EOS: a length penalty counted in the policy's own tokens, which `solution_str` (decoded
without special tokens) cannot give. Declaring `response_ids` is what asks ratchet for them.
"""

from __future__ import annotations

from ratchet.tasks.rewards import compute_score as digit_score


def compute_score(data_source, solution_str, ground_truth, extra_info=None, response_ids=None) -> dict:
    result = digit_score(data_source, solution_str, ground_truth, extra_info)
    extra_tokens = max(0, len(response_ids) - len(ground_truth) - 1)
    return {**result, "score": result["score"] - 0.05 * extra_tokens, "extra_tokens": float(extra_tokens)}
