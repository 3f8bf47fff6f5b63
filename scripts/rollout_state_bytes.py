"""The rollout engine's own tensors per sequence at the end of decoding, counted one by one (issue 57).

    python scripts/rollout_state_bytes.py MODEL_DIR [--prompt 2048] [--new 16] [--group-size 8] [--groups 2]

Runs smd's engine (`generate_batch`) on `--groups` random prompts of `--prompt` tokens, each `--group-size` times
(GRPO's shared prompts), with smd dense, SnapKV 0.5 every step and SnapKV 0.5 at interval 64, and prints the
bytes per sequence of what the engine holds at its last decoding step: the prompt's keys and values (once a group),
each row's own, the slot positions, evict_at (the shadow mask's source) and the policy's state. No timing.
"""

from __future__ import annotations

import argparse
import collections

import torch

from schemas.params.rollout import EvictionParams
from stages.common.kvcache import sampler
from stages.common.model import load_policy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--groups", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = load_policy(args.model, "float32").eval()
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = [p for p in (torch.randint(4, vocab, (args.prompt,), generator=g).tolist() for _ in range(args.groups))
               for _ in range(args.group_size)]
    held: collections.Counter = collections.Counter()
    attend = sampler.decode_attention

    def counting(st, layer, query, key, value, scaling, cache):
        out = attend(st, layer, query, key, value, scaling, cache)
        if layer == st.num_layers - 1:  # every layer has run this step: count what the engine holds now
            held.clear()
            held["prompt K/V"] = sum(0 if x.prompt_keys is None else x.prompt_keys.nbytes + x.prompt_values.nbytes
                                     for x in cache.layers)
            held["own K/V"] = sum(x.keys.nbytes + x.values.nbytes for x in cache.layers)
            held["slot positions"] = sum(s.slot_pos.nbytes for s in st.slots)
            held["evict_at"] = st.evict_at.nbytes
            for s in st.slots:
                for name, t in s.extra.items():
                    held[name] += t.nbytes
            held["window queries"] = sum(q.nbytes for q in st.window_queries if q is not None)
            held["window scores"] = sum(t.nbytes for t in getattr(st.policy, "window_scores", []) if t is not None)
        return out

    sampler.decode_attention = counting
    engines = {"smd dense": EvictionParams(policy="dense"),
               "SnapKV 0.5 every step": EvictionParams(policy="snapkv", keep_ratio=0.5),
               "SnapKV 0.5 interval 64": EvictionParams(policy="snapkv", keep_ratio=0.5, interval=64)}
    print(f"{args.model}: {args.groups} prompts of {args.prompt} tokens x G {args.group_size}, {args.new} new "
          f"tokens; MiB per sequence")
    for name, ev in engines.items():
        sampler.generate_batch(model, prompts, ev, args.new, eos_token_id=None,
                               generator=torch.Generator().manual_seed(0), prefill_chunk_tokens=2048)
        per_seq = {k: v / 2**20 / len(prompts) for k, v in held.items() if v}
        parts = ", ".join(f"{k} {v:.2f}" for k, v in per_seq.items())
        print(f"{name:>24}: total {sum(per_seq.values()):.2f} ({parts})", flush=True)


if __name__ == "__main__":
    main()
