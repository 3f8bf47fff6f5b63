"""fact_recall scored strictly (issue 42, item 3): 1 when the response's numbers are exactly the asked ones, in
order, and nothing else; 0 otherwise.

The task's built-in reward (`kv_fraction`, schemas/rewards.py) credits the asked number at its position and ignores
what follows, so "The fox has number 56. The bear has number 52." earns full reward for the fox. This reward
gives it 0: a run-on that names another animal's number is wrong. It is the task's own exact match
(`schemas.rewards.exact_match`), used as the training reward; the spec's `-em` arms train on it
(experiments/smollm2_fact_recall.yaml). verl's signature (`compute_score`), so any verl-style runner reads it.
"""

from schemas.rewards import exact_match


def exact_numbers(data_source, solution_str, ground_truth, extra_info=None):
    return float(exact_match("fact_recall", solution_str, ground_truth))
