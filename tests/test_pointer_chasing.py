"""pointer_chasing: the generated path follows the context's facts, answers are long, the reward counts hops in
order, and the same seed gives the same prompts."""

from __future__ import annotations

import re

import pytest

from schemas import rewards
from schemas.errors import SmdInputError
from schemas.params import load_params
from stages.common.model import build_tiny_tokenizer
from stages.learner.objectives import objective_spec
from stages.prepare.synthetic import ANSWER_CUE, POINTER_NODE_WORDS, count_tokens, filler_sentence, generate

TASK = "pointer_chasing"


def cfg(*overrides: str):
    return load_params(None, [f"prepare.task={TASK}", *overrides]).prepare


def facts_of(prompt: str) -> dict[str, str]:
    """Every "a b ." fact of a prompt (two node words) as {a: b}; fails when a node has two outgoing facts."""
    found: dict[str, str] = {}
    nodes = set(POINTER_NODE_WORDS)
    for a, b in re.findall(r"(?<![\w])(\w+) (\w+) \.", prompt):
        if a not in nodes or b not in nodes:
            continue  # a filler sentence's end ("the rope ."), not a fact
        assert a not in found, f"{a} has two facts"
        found[a] = b
    return found


def test_answer_is_the_path_through_the_context_facts():
    c = cfg("prepare.pointer_hops=17", "prepare.pointer_distractors=3", "prepare.context_tokens=200")
    for prompt, reference in generate(TASK, c, seed=3, split="eval", n=25):
        facts = facts_of(prompt)
        assert len(facts) == 17 + 3
        hops = [unit.split(" ") for unit in reference.split(" ; ")]
        assert len(hops) == 17
        start = re.search(r"query : from (\w+) \. " + ANSWER_CUE + "$", prompt).group(1)
        assert hops[0][0] == start
        for (a, b), (next_a, _) in zip(hops, [*hops[1:], (None, None)], strict=True):
            assert facts[a] == b  # each hop restates a fact of the context ...
            assert next_a in (b, None)  # ... and starts where the previous one ended
        assert hops[-1][1] not in facts  # the path ends at a node without an outgoing fact
        path = [hops[0][0]] + [b for _, b in hops]
        assert len(set(path)) == 18  # no node visited twice
        # Facts are not written in path order (else the answer could copy the context in sequence).
        order = [prompt.index(f" {a} {b} .") for a, b in hops]
        assert order != sorted(order)


def test_answers_are_long_and_use_only_tiny_vocabulary():
    c = cfg("prepare.context_tokens=200")
    tok = build_tiny_tokenizer()
    lengths = []
    for prompt, reference in generate(TASK, c, seed=0, split="train", n=40):
        ids = tok(prompt + " " + reference, add_special_tokens=False)["input_ids"]
        assert tok.unk_token_id not in ids
        lengths.append(count_tokens(reference))
    assert set(lengths) == {50}  # default 17 hops: 17 * 3 tokens, less the last separator
    # A response is the reference plus EOS: 51 tokens, over the 48 the issue asks for.


def test_node_words_never_occur_in_filler():
    import random

    rng = random.Random(0)
    filler_words = {w for _ in range(2000) for w in filler_sentence(rng).split()}
    assert not filler_words & set(POINTER_NODE_WORDS)
    assert len(set(POINTER_NODE_WORDS)) == len(POINTER_NODE_WORDS) == 40


def test_same_seed_same_prompts_other_seed_or_split_other_prompts():
    c = cfg("prepare.context_tokens=150")
    a = generate(TASK, c, seed=11, split="train", n=8)
    assert a == generate(TASK, c, seed=11, split="train", n=8)
    assert a != generate(TASK, c, seed=12, split="train", n=8)
    assert a != generate(TASK, c, seed=11, split="eval", n=8)
    # The first eval prompt of seed 0 at the default sizes, read by hand (pins the generator's draws): it starts
    # "track each key . ant star . chair hill . table seal ." and asks "query : from ball . answer :"; from ball
    # the facts lead ball -> deer -> bird -> horse -> ... -> owl -> chair -> hill, and hill has no fact.
    prompt, reference = generate(TASK, cfg(), seed=0, split="eval", n=1)[0]
    assert prompt.startswith("track each key . ant star . chair hill . table seal . ")
    assert prompt.endswith(f"sky river . owl chair . it was bright and quiet at the town . query : from ball . {ANSWER_CUE}")
    assert reference == ("ball deer ; deer bird ; bird horse ; horse tree ; tree window ; window duck ; duck sky ; "
                         "sky river ; river fox ; fox ant ; ant star ; star dog ; dog swan ; swan rock ; rock owl ; "
                         "owl chair ; chair hill")
    assert 100 <= count_tokens(prompt) <= 120


def test_unit_fraction_hand_checked():
    ref = "fox owl ; owl bee ; bee moon ; moon cat"
    score = lambda text: rewards.score(TASK, text, ref)  # noqa: E731
    assert rewards.metric_name(TASK) == "unit_fraction"
    assert score(ref) == 1.0 and rewards.exact_match(TASK, ref, ref)
    assert score("fox  owl;owl bee ; bee moon ; moon cat") == 1.0  # whitespace is not a unit's
    # A wrong hop derails the next one (it starts at the wrong node); the one after is back on the path.
    assert score("fox owl ; owl ant ; ant moon ; moon cat") == pytest.approx(2 / 4)
    # Derailed for good: only the hops before the error count.
    assert score("fox owl ; owl ant ; ant sun ; sun dog") == pytest.approx(1 / 4)
    assert score("owl bee ; bee moon ; moon cat") == 0.0  # order matters: hop 1 missing shifts all
    assert score("fox owl ; owl bee") == pytest.approx(2 / 4)  # stopped early
    extra = ref + " ; cat dog"
    assert score(extra) == 1.0 and not rewards.exact_match(TASK, extra, ref)  # an extra hop: full score, no EM
    assert score("fox") == 0.0 and score("") == 0.0
    assert rewards.score(TASK, "anything", "") == 0.0 and not rewards.exact_match(TASK, "", "")


def test_tiny_tokenizer_decode_scores_like_the_reference():
    tok = build_tiny_tokenizer()
    _, reference = generate(TASK, cfg(), seed=1, split="eval", n=1)[0]
    decoded = tok.decode(tok(reference, add_special_tokens=False)["input_ids"] + [tok.eos_token_id],
                         skip_special_tokens=True)
    assert rewards.score(TASK, decoded, reference) == 1.0 and rewards.exact_match(TASK, decoded, reference)


def test_too_many_nodes_is_one_line_naming_the_field():
    with pytest.raises(SmdInputError) as err:
        cfg("prepare.pointer_hops=30", "prepare.pointer_distractors=10")
    assert "\n" not in str(err.value)
    assert re.search(r"prepare: .*pointer_distractors: 30 hops and 10 distractors need 41 distinct node words; "
                     r"there are 40$", str(err.value)), str(err.value)
    cfg("prepare.pointer_hops=30", "prepare.pointer_distractors=9")  # 40 nodes: fits exactly


def test_comparison_spec_has_every_arm_the_issue_asks_for():
    from pathlib import Path

    from schemas.compare import load_compare_spec

    root = Path(__file__).resolve().parents[1]
    spec = load_compare_spec(root / "experiments" / "pointer_chasing_comparison.yaml")
    paper = load_compare_spec(root / "experiments" / "paper_comparison.yaml")
    assert spec.iterations >= 30 and len(spec.seeds) >= 3
    assert set(paper.arms) <= set(spec.arms)  # the paper's arms, with the same overrides
    assert all(spec.arms[a] == paper.arms[a] for a in paper.arms)
    arms = {a: load_params(root / "params.yaml", spec.overrides(a)) for a in spec.arms}
    assert all(p.prepare.task == TASK and p.rollout.max_new_tokens >= 51 for p in arms.values())
    at_half = [p for p in arms.values() if p.rollout.eviction.keep_ratio == 0.5]
    selection = {(p.learner.objective, p.rollout.eviction.policy) for p in at_half}
    assert {("smd", "recent"), ("naive", "recent"), ("smd", "random"), ("naive", "random")} <= selection
    lambdas = {0.0 if p.learner.objective == "shadow" else p.learner.kl_lambda
               for p in at_half if objective_spec(p.learner.objective).masked_forward and p.rollout.eviction.policy == "snapkv"}
    assert lambdas == {0.0, 0.01, 0.1, 0.8}
