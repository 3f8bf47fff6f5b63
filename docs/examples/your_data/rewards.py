import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's signature: 1.0 when the last number is the ground truth, 0.1 for another number (verl's gsm8k
    `format_score`). The tiny word-level tokenizer writes 17 as "1 7"."""
    numbers = re.findall(r"\d+", solution_str.replace(" ", ""))
    return 1.0 if numbers and numbers[-1] == ground_truth else 0.1 if numbers else 0.0


def distinct(prompts, completions, completion_ids, **kwargs):
    """TRL's signature: the fraction of distinct tokens; None (no reward) for an empty response."""
    return [len(set(ids)) / len(ids) if ids else None for ids in completion_ids]
