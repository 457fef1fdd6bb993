"""Hit selection on duplicate prefix-cache blocks, through the real Scheduler.

Runs one duplicate-heavy trace twice per seed, toggling
``BlockHashToBlockMap.get_one_block`` between

  first      -- the copy inserted first (vLLM 0.33.0),
  referenced -- a copy with ref_cnt > 0 if the key has one, else the first,

and reports medians over seeds of: physical copies per resident key over time
(mean of the per-step mean, max), prefix-cache hit rate (hit tokens / queried
tokens), tokens and blocks computed, steps and preemptions.

Run from the root of a vLLM tree (PYTHONPATH=<tree>), HF_HUB_OFFLINE=1:
    python bench_hit_selection.py [--seeds 5] [--requests 400]

The trace: families of block-aligned system prompts. A request is a family
prompt, optionally followed by earlier "turns" (the tokens the made-up model
generates after that prompt, so they match decode blocks of other requests)
and a private question. Output tokens depend only on (family, position), so
concurrent requests of one family decode identical blocks, and block-aligned
prompts recompute their last block: both materialise duplicate copies.
"""

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import benchlib as bl
from vllm.v1.core.block_pool import BlockHashToBlockMap
from vllm.v1.core.kv_cache_utils import KVCacheBlock

BLOCK_SIZE = bl.BLOCK_SIZE
EOS = 2
MAX_MODEL_LEN = 4096


def get_one_block_first(self, key):
    blocks = self._cache.get(key)
    if blocks is None:
        return None
    if isinstance(blocks, KVCacheBlock):
        return blocks
    return next(iter(blocks.values()))


def get_one_block_referenced(self, key):
    blocks = self._cache.get(key)
    if blocks is None:
        return None
    if isinstance(blocks, KVCacheBlock):
        return blocks
    first = None
    for block in blocks.values():
        if block.ref_cnt > 0:
            return block
        if first is None:
            first = block
    return first


VARIANTS = {"first": get_one_block_first, "referenced": get_one_block_referenced}


def make_scheduler(model_dir: str, num_blocks: int, max_num_seqs: int) -> Any:
    return bl.make_cpu_scheduler(
        model_dir,
        num_blocks,
        max_num_seqs,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=1024,
        seed=42,
    )


def generated_token(family: int, position: int) -> int:
    return 10_000 + (family * 7919 + position * 104729) % 50_000


def build_trace(seed: int, num_requests: int, num_families: int):
    rng = random.Random(seed)
    families = []
    for f in range(num_families):
        prompt = [100 * (f + 1) + i % 97 for i in range(rng.choice([2, 3, 4]) * 16)]
        families.append(prompt)
    trace = []
    for i in range(num_requests):
        f = rng.randrange(num_families)
        prompt = list(families[f])
        # Earlier turns: what the model generated after the family prompt.
        turns = rng.choice([0, 0, 1, 2])
        for _ in range(turns * BLOCK_SIZE):
            prompt.append(generated_token(f, len(prompt)))
        if rng.random() < 0.4:
            prompt += [60_000 + i] * rng.randrange(1, BLOCK_SIZE)
        max_tokens = rng.randrange(8, 3 * BLOCK_SIZE)
        arrival = rng.randrange(0, 2 * num_requests // 3)
        trace.append((arrival, f"r{i}", f, prompt, max_tokens))
    trace.sort()
    return trace


def run(model_dir, variant, seed, num_requests, num_families, num_blocks, seqs):
    BlockHashToBlockMap.get_one_block = VARIANTS[variant]
    hasher = bl.make_hasher(BLOCK_SIZE)  # also sets the none-hash
    scheduler = make_scheduler(model_dir, num_blocks, seqs)
    pool = scheduler.kv_cache_manager.block_pool
    trace = build_trace(seed, num_requests, num_families)
    family_of = {}
    queries = hits = computed = preemptions = 0
    mean_copies, max_copies, dup_keys = [], 0, []
    step_idx = 0
    pos = 0
    while pos < len(trace) or scheduler.has_requests():
        while pos < len(trace) and trace[pos][0] <= step_idx:
            _, req_id, f, prompt, max_tokens = trace[pos]
            family_of[req_id] = f
            scheduler.add_request(
                bl.make_request(req_id, prompt, hasher, max_tokens, eos_token_id=EOS)
            )
            pos += 1
        step_idx += 1
        out, engine_outputs = bl.step(
            scheduler,
            lambda req: generated_token(family_of[req.request_id], req.num_tokens),
        )
        computed += sum(out.num_scheduled_tokens.values())
        for outputs in engine_outputs.values():
            stats = outputs.scheduler_stats
            if stats is not None and stats.prefix_cache_stats is not None:
                queries += stats.prefix_cache_stats.queries
                hits += stats.prefix_cache_stats.hits
                preemptions += stats.prefix_cache_stats.preempted_requests
        cache = pool.cached_block_hash_to_block._cache
        if cache:
            counts = [
                1 if isinstance(v, KVCacheBlock) else len(v) for v in cache.values()
            ]
            mean_copies.append(sum(counts) / len(counts))
            max_copies = max(max_copies, max(counts))
            dup_keys.append(sum(1 for c in counts if c > 1))
        if step_idx > 100_000:
            raise RuntimeError("trace did not finish")
    return {
        "hit_rate": hits / queries if queries else 0.0,
        "hit_tokens": hits,
        "tokens_computed": computed,
        "blocks_computed": computed / BLOCK_SIZE,
        "copies_mean": statistics.fmean(mean_copies),
        "copies_max": max_copies,
        "dup_keys_mean": statistics.fmean(dup_keys),
        "steps": step_idx,
        "preemptions": preemptions,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--families", type=int, default=8)
    parser.add_argument("--num-blocks", type=int, default=160)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    original = BlockHashToBlockMap.get_one_block
    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(
            json.dumps(
                {
                    "model_type": "opt",
                    "architectures": ["OPTForCausalLM"],
                    "hidden_size": 16,
                    "ffn_dim": 32,
                    "num_attention_heads": 2,
                    "num_hidden_layers": 2,
                    "vocab_size": 70_000,
                    "max_position_embeddings": MAX_MODEL_LEN,
                    "word_embed_proj_dim": 16,
                    "bos_token_id": EOS,
                    "eos_token_id": EOS,
                    "pad_token_id": 1,
                }
            )
        )
        results = {v: [] for v in VARIANTS}
        for seed in range(args.seeds):
            for variant in VARIANTS:
                results[variant].append(
                    run(
                        model_dir,
                        variant,
                        seed,
                        args.requests,
                        args.families,
                        args.num_blocks,
                        args.max_num_seqs,
                    )
                )
    BlockHashToBlockMap.get_one_block = original
    keys = list(results["first"][0])
    print(
        f"trace: {args.requests} requests, {args.families} families, "
        f"{args.num_blocks} blocks, max_num_seqs {args.max_num_seqs}, "
        f"seeds 0..{args.seeds - 1}; medians over seeds"
    )
    print(f"{'metric':<18}{'first':>14}{'referenced':>14}{'change':>10}")
    summary = {}
    for key in keys:
        a = statistics.median(r[key] for r in results["first"])
        b = statistics.median(r[key] for r in results["referenced"])
        change = (b - a) / a * 100 if a else 0.0
        summary[key] = {"first": a, "referenced": b}
        print(f"{key:<18}{a:>14.4f}{b:>14.4f}{change:>9.1f}%")
    per_seed = {
        key: [
            (round(f[key], 4), round(r[key], 4))
            for f, r in zip(results["first"], results["referenced"], strict=True)
        ]
        for key in ("hit_rate", "blocks_computed", "copies_mean")
    }
    print("per seed (first, referenced):", per_seed)
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "runs": results}))


if __name__ == "__main__":
    sys.exit(main())
