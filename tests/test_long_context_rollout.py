"""The long-context rollout (issue 54): the prefill under a token budget (`rollout.prefill_chunk_tokens`, a
layer-by-layer prefill in chunks) and amortized decode-time eviction (`rollout.eviction.interval`).

- The chunked prefill equals one forward of the model, in float64: the same first-token logits (to rounding),
  the same slots and shadow masks, for every policy, padded and unpadded, shared prompts and per sample.
- An interval k > 1 evicts every k steps: each query sees at most `schemas.raw_masks.budget` with the interval
  (and more than the every-step budget in between), the compaction stage accepts the masks, and the learner's
  replay of them gives the rollout's log-probs.
- SnapKV at k >= window scores with its buffered window's attention recomputed at the eviction: the same
  tokens and masks as its every-step ring at that interval.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from schemas.errors import SmdInputError
from schemas.params.rollout import POLICIES, EvictionParams
from schemas.raw_masks import budget, visible_counts
from stages.common.kvcache.policies import snapkv
from stages.common.kvcache.sampler import (
    BatchStore,
    EvictingCache,
    generate_batch,
    new_state,
    prefill,
    prefill_chunks,
    supports_layerwise_prefill,
)
from stages.common.kvcache.schedule import budget_array, budget_schedule
from stages.common.model import attention_implementation, load_policy
from stages.compaction.compact import validate_rows
from stages.learner.objectives import token_logprobs
from stages.learner.shadow_attention import response_logits
from tests.helpers import make_model_dir, random_prompts, replay_batch

TOL = 1e-5  # the replay tolerance of tests/test_rollout.py


@pytest.fixture(scope="module")
def model64(tmp_path_factory):
    return load_policy(make_model_dir(tmp_path_factory.mktemp("long-rollout"), "gqa")).double()


def grouped_prompts(seed: int = 3) -> list[list[int]]:
    a, b, c = random_prompts([30, 23, 17], seed=seed)
    return [a, a, a, b, b, c, a]  # groups of 3, 2 and 1, left-padded to 30


def _eviction(policy: str, **kw) -> EvictionParams:
    return EvictionParams(policy=policy, keep_ratio=kw.pop("keep_ratio", 0.5), sinks=2, window=4, **kw)


def test_prefill_chunks_plan():
    # a prompt longer than the budget: one row at a time, query chunks; shorter: several rows at once
    assert prefill_chunks(2, 10, 4) == [(0, 1, 0, 4), (0, 1, 4, 8), (0, 1, 8, 10),
                                        (1, 2, 0, 4), (1, 2, 4, 8), (1, 2, 8, 10)]
    assert prefill_chunks(5, 10, 25) == [(0, 2, 0, 10), (2, 4, 0, 10), (4, 5, 0, 10)]
    assert prefill_chunks(3, 10, 10) == [(0, 1, 0, 10), (1, 2, 0, 10), (2, 3, 0, 10)]


def _prefill(model, prompts, ev, share: bool, chunk: int):
    state = new_state(model, prompts, ev, 6)
    cache = EvictingCache(state)
    kwargs = {"smd_rollout_state": state, "smd_rollout_cache": cache}
    with torch.no_grad(), attention_implementation(model, "smd_rollout"):
        logits = prefill(model, prompts, state, cache, 0, kwargs, share, chunk)
    return logits, state, cache


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("policy", POLICIES)
def test_chunked_prefill_equals_one_forward_float64(model64, policy, share):
    """Layer by layer in chunks of 7 (query chunks of one row) and 64 (several rows at once) against one forward of
    the model: first-token logits within 1e-10 (H2O: its float32 softmax's rounding), identical shadow masks and
    slot positions, kept keys alike; padded (three prompt lengths) and unpadded (one prompt repeated)."""
    assert supports_layerwise_prefill(model64)
    # H2O's prefill takes its output from the explicit softmax it scores with, float32 by design
    # (`_attend_grouped`), in query chunks that now fall elsewhere: float32 rounding, not float64's.
    tol = 1e-5 if policy == "h2o" else 1e-10
    for prompts in (grouped_prompts(), [random_prompts([26], seed=9)[0]] * 3):
        ev = _eviction(policy)
        want_logits, want_state, want_cache = _prefill(model64, prompts, ev, share, 0)
        for chunk in (7, 64):
            logits, state, cache = _prefill(model64, prompts, ev, share, chunk)
            assert (logits - want_logits).abs().max().item() <= tol
            assert torch.equal(state.evict_at, want_state.evict_at)
            for layer, want_layer in zip(cache.layers, want_cache.layers, strict=True):
                i = cache.layers.index(layer)
                assert torch.equal(state.slots[i].slot_pos, want_state.slots[i].slot_pos)
                assert state.slots[i].extra.keys() == want_state.slots[i].extra.keys()
                for name, want_extra in want_state.slots[i].extra.items():  # the policy's per-slot state
                    assert (state.slots[i].extra[name] - want_extra).abs().max().item() <= tol
                assert (layer.keys - want_layer.keys).abs().max().item() <= tol
                if want_layer.prompt_keys is not None:
                    assert (layer.prompt_keys - want_layer.prompt_keys).abs().max().item() <= tol


@pytest.mark.parametrize("share", [True, False])
def test_chunked_prefill_runs_row_group_by_row_group(model64, share, monkeypatch):
    """The prefill's hidden states exist for one row group at a time: the embedding runs once per group of the
    plan (chunk 64 over 30-token prompts: 2 rows a group; chunk 7: one row), never on the whole batch."""
    prompts = grouped_prompts()
    embed = model64.model.embed_tokens
    seen: list[int] = []
    monkeypatch.setattr(embed, "forward", lambda ids, _f=embed.forward: seen.append(ids.shape[0]) or _f(ids))
    for chunk, per_group in ((64, 2), (7, 1)):
        seen.clear()
        _prefill(model64, prompts, _eviction("snapkv"), share, chunk)
        rows = 3 if share else len(prompts)  # the distinct prompts, or every row
        assert seen == [min(per_group, rows - g) for g in range(0, rows, per_group)]


def _block_row(block: torch.Tensor, t: torch.Tensor) -> int | None:
    """Which layer's entry of `block` the tensor `t` lies in (a view of that entry), else None."""
    if t.untyped_storage().data_ptr() != block.untyped_storage().data_ptr():
        return None
    offset = t.storage_offset() - block.storage_offset()
    per_layer = block[0].numel()
    return offset // per_layer if offset % per_layer + t.numel() <= per_layer else None


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("chunk", [0, 7])
@pytest.mark.parametrize("policy", ["snapkv", "dense", "random"])
def test_batch_store_holds_every_layer_in_one_block_per_kind(model64, policy, share, chunk):
    """What the batch keeps (each row's own keys and values, the shared prompts' kept ones, the slot positions) is
    layer i's entry of one block per kind, whichever prefill path and policy filled it."""
    _, state, cache = _prefill(model64, grouped_prompts(), _eviction(policy), share, chunk)
    blocks = cache.store.blocks
    assert blocks["own"].shape[0] == blocks["slot_pos"].shape[0] == len(cache.layers)
    assert ("prompt" in blocks) == state.shares_storage == share
    for i, layer in enumerate(cache.layers):
        assert _block_row(blocks["own"], layer.keys) == _block_row(blocks["own"], layer.values) == i
        assert layer.values.data_ptr() - layer.keys.data_ptr() == layer.keys.nbytes  # keys, then values
        assert _block_row(blocks["slot_pos"], state.slots[i].slot_pos) == i
        if share:
            assert _block_row(blocks["prompt"], layer.prompt_keys) == i
            assert _block_row(blocks["prompt"], layer.prompt_values) == i


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("chunk", [0, 7])
def test_random_drops_its_prompt_draws_after_the_prefill(model64, share, chunk):
    """Random eviction draws each layer's prompt priorities ([B, H, P] float64) for the batch; once every row has
    taken its own (one forward, or group by group), the policy holds none: the slots keep what decoding compares."""
    prompts = grouped_prompts()
    _, state, _ = _prefill(model64, prompts, _eviction("random"), share, chunk)
    assert state.policy.prompt_draws == [None] * len(state.slots)
    assert all(s.extra["priority"].shape[0] == len(prompts) for s in state.slots)


def test_cache_is_freed_before_the_masks_are_built(model64, monkeypatch):
    """The per-sequence masks are as large as evict_at: when `sample_results` builds them the batch's cache (its
    store's blocks, the layers' keys, the slots) is already dropped, and evict_at is whole."""
    from stages.common.kvcache import sampler

    seen = []
    build = sampler.sample_results

    def checking(state, *args):
        seen.append((all(s is None for s in state.slots), state.evict_at.shape[0] == len(state.slots)))
        return build(state, *args)

    caches = []
    make_cache = sampler.EvictingCache

    def keeping(state):
        caches.append(make_cache(state))
        return caches[-1]

    monkeypatch.setattr(sampler, "sample_results", checking)
    monkeypatch.setattr(sampler, "EvictingCache", keeping)
    generate_batch(model64, grouped_prompts(), _eviction("snapkv"), 5, None, 0, 1.0, torch.Generator().manual_seed(1))
    assert seen == [(True, True)]
    assert caches[0].store.blocks == {} and caches[0].nbytes() == 0


def test_batch_store_views_fills_and_falls_back():
    """A kind's block is allocated at its first request, for every layer, filled once; a request of another shape
    or dtype gets a tensor of its own, filled as asked."""
    store = BatchStore(3)
    like = torch.zeros(1, dtype=torch.float64)
    first = store.view("own", 0, (2, 4), like, fill=-1)
    assert store.blocks["own"].shape == (3, 2, 4) and store.blocks["own"].dtype == torch.float64
    assert torch.equal(store.blocks["own"], torch.full((3, 2, 4), -1.0))  # every layer's entry, not the first's only
    first.fill_(5)
    assert store.view("own", 2, (2, 4), like).data_ptr() == store.blocks["own"][2].data_ptr()
    assert torch.equal(store.blocks["own"][0], first) and store.blocks["own"][1].eq(-1).all()
    other = store.view("own", 1, (2, 5), like, fill=7)  # another shape: its own tensor
    assert other.shape == (2, 5) and other.eq(7).all()
    assert other.untyped_storage().data_ptr() != store.blocks["own"].untyped_storage().data_ptr()
    as_int = store.view("own", 1, (2, 4), torch.zeros(1, dtype=torch.long))  # another dtype: its own too
    assert as_int.dtype == torch.long
    assert as_int.untyped_storage().data_ptr() != store.blocks["own"].untyped_storage().data_ptr()


@pytest.mark.parametrize("policy", ["snapkv", "h2o", "random"])
def test_chunked_prefill_rollout_equals_one_forward(model64, policy):
    """Whole rollouts: the same tokens and shadow masks with the chunked prefill as with one forward."""
    prompts = grouped_prompts()
    ev = _eviction(policy)
    runs = [generate_batch(model64, prompts, ev, 8, None, 0, 1.0, torch.Generator().manual_seed(0),
                           prefill_chunk_tokens=chunk)[0] for chunk in (0, 5)]
    for a, b in zip(*runs, strict=True):
        assert a.response_ids == b.response_ids and np.array_equal(a.evict_at, b.evict_at)
        assert np.allclose(a.logprobs, b.logprobs, atol=1e-6, rtol=0)


@pytest.mark.parametrize("interval", [1, 3, 5])
def test_interval_budget_vectorized_equals_the_scalar_rule(interval):
    for policy in ("snapkv", "recent"):
        ev = _eviction(policy, interval=interval).model_dump()
        for P in (1, 9, 40):
            n = np.arange(1, P + 60)
            got = budget_array(n, ev, np.full_like(n, P))
            assert got.tolist() == [budget(int(k), ev, P) for k in n]


def test_interval_budget_by_hand():
    # keep 0.5, sinks 2 + window 4 = 6 protected; prompt 20, interval 3. The prompt's next query (n = 21) sees
    # budget 11; then one key a step for 3 steps (n = 22, 23 see 12, 13); at n = 24 the eviction after the
    # third step brought it down to the every-step budget, ceil(24 / 2) = 12.
    ev = _eviction("snapkv", interval=3).model_dump()
    assert [budget(n, ev, 20) for n in range(20, 28)] == [10, 11, 12, 13, 12, 13, 14, 14]
    with pytest.raises(ValueError, match="prompt length"):
        budget(30, ev)
    s = budget_schedule(np.array([20]), 8, ev, evicts=True, evicts_while_decoding=True)
    # evicts after every third fed token: 13 cached against keep budget(24) - 1 = 11, then 14 against 13
    assert s.step_excess == [0, 0, 2, 0, 0, 1, 0]
    assert s.capacity == 15  # the largest budget up to P + max_new_tokens (n = 28: 14 + 1), as for interval 1


def test_interval_needs_every_step():
    with pytest.raises(ValidationError, match="interval 4 spaces"):
        EvictionParams(policy="snapkv", compress="prefill_only", interval=4)
    with pytest.raises(ValidationError):
        EvictionParams(policy="snapkv", interval=0)


def _check_budget(results, ev) -> tuple[int, int]:
    """(most keys any decode query sees over the interval budget, most over the every-step budget)."""
    over_interval = over_every_step = -(10**9)
    every = {**ev, "interval": 1}
    for r in results:
        counts = visible_counts(r.evict_at)
        for q in range(r.prompt_len, r.evict_at.shape[0]):
            over_interval = max(over_interval, int(counts[q].max()) - budget(q + 1, ev, r.prompt_len))
            over_every_step = max(over_every_step, int(counts[q].max()) - budget(q + 1, every, r.prompt_len))
    return over_interval, over_every_step


def _validate(results, ev):
    ev_rows = [r.evict_at.reshape(r.evict_at.shape[0], -1) for r in results]
    flat = np.concatenate(ev_rows)
    offsets = np.cumsum([0] + [e.shape[0] for e in ev_rows])
    columns = np.arange(flat.shape[1]).reshape(results[0].evict_at.shape[1], -1)
    validate_rows(flat, offsets, np.array([r.prompt_len for r in results]), columns, ev, lambda r: f"row {r}")


@pytest.mark.parametrize("policy", ["snapkv", "h2o", "recent", "random"])
def test_interval_rollout_keeps_its_budget_and_compaction_accepts_it(model64, policy):
    prompts = grouped_prompts()
    ev = _eviction(policy, interval=4)
    res, _ = generate_batch(model64, prompts, ev, 14, None, 0, 1.0, torch.Generator().manual_seed(0))
    over_interval, over_every_step = _check_budget(res, ev.model_dump())
    assert over_interval == 0  # the interval budget is reached, never passed
    assert over_every_step > 0  # between two evictions the cache grows past the every-step budget
    _validate(res, ev.model_dump())
    with pytest.raises(SmdInputError, match="over the budget"):
        _validate(res, {**ev.model_dump(), "interval": 1})


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("interval", [4, 7])
def test_snapkv_recomputed_window_equals_its_ring(model64, interval, share, monkeypatch):
    """At interval >= window the buffered queries' attention recomputed at the eviction scores as the every-step
    ring does: the same tokens and masks (float64)."""
    prompts = grouped_prompts()
    ev = _eviction("snapkv", interval=interval)
    want, _ = generate_batch(model64, prompts, ev, 20, None, 0, 1.0, torch.Generator().manual_seed(2),
                             share_prompt=share)
    init = snapkv.SnapKVPolicy.__init__

    def ring_init(self, cfg, num_layers):
        init(self, cfg, num_layers)
        self.recomputes_window = False

    monkeypatch.setattr(snapkv.SnapKVPolicy, "__init__", ring_init)
    got, _ = generate_batch(model64, prompts, ev, 20, None, 0, 1.0, torch.Generator().manual_seed(2),
                            share_prompt=share)
    for a, b in zip(got, want, strict=True):
        assert a.response_ids == b.response_ids and np.array_equal(a.evict_at, b.evict_at)


def test_snapkv_at_an_interval_keeps_no_ring(model64):
    ev = _eviction("snapkv", interval=8)
    state = new_state(model64, grouped_prompts(), ev, 20)
    assert state.decode_observation == "window_queries"
    _, state, _ = _prefill(model64, grouped_prompts(), ev, True, 0)
    assert all("ring" not in s.extra for s in state.slots)
    _, state, _ = _prefill(model64, grouped_prompts(), _eviction("snapkv"), True, 0)
    assert all("ring" in s.extra for s in state.slots)


@pytest.mark.parametrize("policy", ["snapkv", "h2o"])
def test_no_decode_observation_when_no_decoding_step_evicts(model64, policy, monkeypatch):
    """Responses that end before the interval's first eviction (GRPO's short answers at interval 64): the batch
    records no observation (SnapKV buffers no window queries), and its tokens and masks equal those of the same
    batch made to record them."""
    from stages.common.kvcache import sampler

    ev = _eviction(policy, interval=8)
    made = []

    def recording(record: bool):
        def wrapped(*args, **kw):
            state = new_state(*args, **kw)
            state.decode_evicts = state.decode_evicts or record
            made.append(state)
            return state
        return wrapped

    buffered = []  # per batch: whether each layer holds window queries once decoding is done
    release = sampler.EvictingCache.release

    def releasing(cache):
        buffered.append([q is not None for q in cache.state.window_queries])
        release(cache)

    monkeypatch.setattr(sampler.EvictingCache, "release", releasing)
    monkeypatch.setattr(sampler, "new_state", recording(False))
    got, _ = generate_batch(model64, grouped_prompts(), ev, 6, None, 0, 1.0, torch.Generator().manual_seed(4))
    assert not made[-1].decode_evicts and made[-1].decode_observation == "none"
    assert not any(buffered[-1])
    monkeypatch.setattr(sampler, "new_state", recording(True))
    want, _ = generate_batch(model64, grouped_prompts(), ev, 6, None, 0, 1.0, torch.Generator().manual_seed(4))
    assert made[-1].decode_observation != "none"
    if policy == "snapkv":
        assert all(buffered[-1])  # the path that buffers them
    assert all(q is None for q in made[-1].window_queries)  # and the batch's end drops them
    for a, b in zip(got, want, strict=True):
        assert a.response_ids == b.response_ids and np.array_equal(a.evict_at, b.evict_at)
    # a batch long enough to evict while decoding still observes
    assert new_state(model64, grouped_prompts(), ev, 20).decode_observation != "none"


@pytest.mark.parametrize("policy", ["snapkv", "h2o"])
def test_replay_holds_at_an_interval(tmp_path, policy):
    """The learner replays an interval rollout's masks as any other (float32 model, the rollout tolerance)."""
    model = load_policy(make_model_dir(tmp_path, "gqa"))
    prompts = grouped_prompts(seed=5)
    res, _ = generate_batch(model, prompts, _eviction(policy, interval=4), 12, None, 0, 0.8,
                            torch.Generator().manual_seed(1), prefill_chunk_tokens=16)
    ids, evict_at, rec = replay_batch(prompts, res)
    with torch.no_grad():
        logits, targets, valid = response_logits(model, ids, evict_at, [len(p) for p in prompts],
                                                 [len(r.response_ids) for r in res])
    lp = token_logprobs(logits, targets, 0.8)
    assert (lp - rec)[valid].abs().max().item() <= TOL


@pytest.mark.slow
def test_bench_rollout_long_runs_every_engine_in_its_own_process(tmp_path, capsys):
    """`smdctl bench rollout --model DIR --long` on the tiny model: every smd engine and `generate` make batch x new
    tokens, each run's peak is measured in its own process, and the largest-batch search finds a batch by
    running it (vLLM left out: tests/test_vllm_engine.py covers it)."""
    from stages.bench.rollout_long import bench_rollout_long, parse_cases

    assert parse_cases("64x8,32x4") == [(64, 8), (32, 4)]
    with pytest.raises(SmdInputError, match="PROMPTxNEW"):
        parse_cases("64")
    lines: list[str] = []
    rows = bench_rollout_long(make_model_dir(tmp_path, "gqa"), [(48, 6)], batch_size=2, interval=4,
                              prefill_chunk_tokens=16, engines=["smd-dense", "smd-snapkv", "smd-snapkv-k", "generate"],
                              budget_mib=10_000, max_batch=2, print_fn=lines.append)
    long = [r for r in rows if r["table"] == "long"]
    assert {r["engine"] for r in long} == {"smd-dense", "smd-snapkv", "smd-snapkv-k", "generate"}
    assert all(r["tokens"] == 2 * 6 and r["peak_mib"] >= r["held_mib"] > 0 for r in long)
    assert all(r["kv_per_seq_mib"] > 0 and 0 < r["floor_tokens_per_s"] < math.inf for r in long)
    assert "floor tok/s" in lines[1] and "KV/seq MiB" in lines[1] and "GB/s" in lines[0]
    budget_rows = [r for r in rows if r["table"] == "budget"]
    assert len(budget_rows) == 4 and all(r["largest_batch"] == 2 for r in budget_rows)  # the cap: all fit
    assert any("largest batch" in line for line in lines)
    said = capsys.readouterr().err  # each engine's measurement as it finished, before the table
    assert [line.split()[4].rstrip(":") for line in said.splitlines() if line.startswith("# 48+6 x 2 ")] == [
        "smd-dense", "smd-snapkv", "smd-snapkv-k", "generate"]
    # each probe of the search as it ended: doubling 1, 2, then the cap (max_batch 2) stops it
    probes = [line.split(": ")[0].split()[-2:] for line in said.splitlines() if line.startswith("# budget 10000 MiB")]
    assert probes == [[b, e] for e in ("smd-dense", "smd-snapkv", "smd-snapkv-k", "generate") for b in ("1", "2")]
    assert all("fits" in line for line in said.splitlines() if line.startswith("# budget "))


def test_bench_rollout_long_groups_repeat_each_prompt(tmp_path, monkeypatch):
    """`bench rollout --long --group-size G`: the worker decodes batch / G distinct prompts, each G times and
    adjacent (the rollout stage's GRPO order, which smd's engine shares), and the group size must divide the
    batch."""
    from stages.bench.rollout_long import bench_rollout_long, run_worker
    from stages.common.kvcache import sampler

    with pytest.raises(SmdInputError, match="--group-size 3: with --long, a positive divisor of --batch-size"):
        bench_rollout_long(tmp_path, [(48, 6)], batch_size=4, group_size=3, engines=["smd-dense"])
    seen, stats = [], []
    real = sampler.generate_batch

    def spy(model, prompts, *args, **kw):
        seen.append(prompts)
        out = real(model, prompts, *args, **kw)
        stats.append(out[1])
        return out

    monkeypatch.setattr(sampler, "generate_batch", spy)
    spec = {"model": str(make_model_dir(tmp_path, "gqa")), "threads": 1, "keep_ratio": 0.5, "interval": 4,
            "prefill_chunk_tokens": 16, "engine": "smd-snapkv-k", "batch": 6, "prompt": 20, "new": 3,
            "group_size": 3, "prefill_run": False}
    r = run_worker(spec)
    timed = seen[1]  # after the warm-up
    assert r["tokens"] == 6 * 3 and len(timed) == 6 and all(len(p) == 20 for p in timed)
    # the floors' inputs: the slot cache the timed run held (and read a step), the model's weights
    assert r["kv_mib"] * 2**20 == r["kv_read_bytes"] == stats[1].cache_bytes > 0
    model = load_policy(spec["model"])
    assert r["weight_bytes"] == sum(p.numel() * 4 for p in model.parameters())
    assert timed[0] == timed[1] == timed[2] != timed[3] == timed[4] == timed[5]
    run_worker({**spec, "group_size": 1})
    assert len(seen[-1]) == 6 and len({tuple(p) for p in seen[-1]}) == 6  # every sequence its own prompt


@pytest.mark.slow
def test_bench_rollout_long_groups_search_in_whole_groups(tmp_path, capsys):
    """With --group-size the largest-batch search doubles and bisects whole groups, and vLLM's column is left
    out with its reason (its KV cache is sized up front)."""
    from stages.bench.rollout_long import bench_rollout_long

    lines: list[str] = []
    rows = bench_rollout_long(make_model_dir(tmp_path, "gqa"), [(40, 4)], batch_size=4, group_size=2, interval=4,
                              prefill_chunk_tokens=16, engines=["smd-snapkv-k", "vllm"], budget_mib=10_000,
                              max_batch=6, print_fn=lines.append)
    assert "vLLM's column is left out" in lines[0] and "GRPO groups of 2" in lines[1]
    assert [(r["table"], r["engine"]) for r in rows] == [("long", "smd-snapkv-k"), ("budget", "smd-snapkv-k")]
    assert rows[0]["tokens"] == 4 * 4 and rows[1]["largest_batch"] == 6  # 3 groups: the cap
    probes = [line.split(": ")[0].split()[-2] for line in capsys.readouterr().err.splitlines()
              if line.startswith("# budget 10000 MiB")]
    assert probes == ["2", "4", "6"]  # 1 group, 2 groups, then the bisection's 3 (of 3 to 4 groups: 3 fits)


def test_floors_by_hand():
    """The floors beside each engine of the long bench: a step's tokens/s at the bandwidth, a dense engine's
    average KV read, and the generate engine's KV (every sample its own cache, read whole by every step)."""
    from stages.bench.floors import decode_floor_tokens_per_s, dense_kv_read_bytes, measured_read_bandwidth
    from stages.bench.rollout_long import run_worker

    assert decode_floor_tokens_per_s(4, 100.0, 300.0, 1000.0) == 10.0  # 4 tokens a step, a step 0.4 s
    assert dense_kv_read_bytes(10, 2, 5, 3) == 10 * 2 * 6.5  # the 2 steps after the prefill see 6, then 7 keys
    assert dense_kv_read_bytes(10, 1, 5, 1) == 50  # no step after the prefill: the prompt
    bw = measured_read_bandwidth(mib=8, repeats=2)
    assert math.isfinite(bw) and bw > 0
    assert run_worker({"engine": "bandwidth", "threads": 1})["bandwidth"] > 0


def test_bench_rollout_long_generate_floors(tmp_path):
    """The generate engine's KV: per token 2 x layers x KV heads x head dim x 4 bytes, every sample's prompt and
    new tokens held, and a step reads the average cache (`dense_kv_read_bytes`)."""
    from stages.bench.rollout_long import run_worker

    model_dir = make_model_dir(tmp_path, "gqa")
    cfg = load_policy(model_dir).config
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
    r = run_worker({"model": str(model_dir), "threads": 1, "engine": "generate", "batch": 3, "prompt": 12,
                    "new": 5, "keep_ratio": 0.5, "interval": 4, "prefill_chunk_tokens": 16, "prefill_run": False})
    assert r["kv_mib"] * 2**20 == per_token * 3 * (12 + 5)
    assert r["kv_read_bytes"] == per_token * 3 * (12 + 2.5)  # steps 1-4 attend over 13, 14, 15, 16 keys
