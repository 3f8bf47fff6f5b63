import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's signature: 1.0 when the last number is the ground truth (the tiny tokenizer writes 17 as "1 7")."""
    numbers = re.findall(r"\d+", solution_str.replace(" ", ""))
    return float(bool(numbers) and numbers[-1] == ground_truth)


def short(prompts, completions, completion_ids, **kwargs):
    """TRL's signature: a bonus for answers of at most 4 tokens."""
    return [1.0 if len(ids) <= 4 else 0.0 for ids in completion_ids]
