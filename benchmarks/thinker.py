"""The AR thinker on vLLM vs transformers, same weights, in one run; and the prompt cache.

    python -m benchmarks.thinker [--quick]

For each thinker size (the default model's, and a larger random Qwen2 with head_dim 64),
64 templated prompts of mixed length are encoded as ONE batch by each side; prompts/s, their
ratio, and the max abs difference of the hidden states. Then the prompt cache: 64 prompts
through the engine's encode path, cold (thinker) and warm (cache hits).

Method (benchmarks.common.interleaved): the two sides take turns (A B, B A, ...) for
``--repeats`` rounds after one identical warm-up call each; every round of the thinker
comparison encodes prompts no earlier round used (no side can answer from a cache). Ratios are
medians of the per-round ratios, spreads (max - min) / median.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from benchmarks.common import interleaved, machine, scratch_dir, timed, write_json

WORDS = "a cat dog tree house car city sky sun moon sea mountain river flower red green blue big small".split()


def prompts(n: int, salt: int = 0) -> list[str]:
    """``n`` templated prompts of mixed length; another ``salt`` gives other prompts of the same lengths."""
    from dit_core.families.qwenimage import TEMPLATE

    return [TEMPLATE.format(" ".join(WORDS[(i * 7 + j + salt) % len(WORDS)] for j in range(3 + (i * 5) % 40)))
            for i in range(n)]


def build_thinker(hidden: int, layers: int) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from dit_core.random_models.tokenizers import qwen_tokenizer

    path = scratch_dir() / f"qwen2-{hidden}x{layers}"
    tok = qwen_tokenizer()
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 4,
                                 num_hidden_layers=layers, num_attention_heads=hidden // 64,
                                 num_key_value_heads=max(1, hidden // 256), head_dim=64,
                                 max_position_embeddings=2048, tie_word_embeddings=True)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def compare(name: str, model_dir: Path, tokenizer_dir: Path, texts: list[str], repeats: int,
            dtype: str = "float32") -> dict:
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    from ar_adapters import HFThinker
    from ar_adapters.vllm_thinker import VLLMThinker

    model = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    hf = HFThinker(model, AutoTokenizer.from_pretrained(tokenizer_dir), str(model_dir), 1058)
    vl = VLLMThinker(str(model_dir), str(tokenizer_dir), str(model_dir), dtype=dtype, max_length=1058)
    outputs: dict = {}

    def side(name_, thinker):
        def call(round_: int) -> dict:
            batch = prompts(len(texts), salt=round_ + 2)  # a fresh set every call, warm-up included
            t = time.perf_counter()
            out = thinker.encode(batch)
            seconds = time.perf_counter() - t
            if round_ == 0:
                outputs[name_] = out
            return {"seconds": seconds, "prompts_per_s": len(batch) / seconds}

        return call

    try:
        cmp = interleaved({"transformers": side("transformers", hf), "vllm": side("vllm", vl)}, repeats)
        diff = max((a.hidden.float() - b.hidden).abs().max().item()
                   for a, b in zip(outputs["vllm"], outputs["transformers"]))
    finally:
        vl.close()
    params = sum(p.numel() for p in hf.model.parameters())
    r = {"thinker": name, "dtype": dtype, "params": params, "prompts": len(texts), "tokens": sum(hf.count_tokens(texts)),
         "hf_prompts_per_s": cmp.median("transformers", "prompts_per_s"),
         "vllm_prompts_per_s": cmp.median("vllm", "prompts_per_s"),
         "vllm_over_hf_ratio": cmp.ratio("transformers", "vllm"),
         "vllm_over_hf_spread": cmp.ratio_spread("transformers", "vllm"), "repeats": repeats,
         "sides": {k: cmp.stats(k) for k in cmp.sides}, "max_abs_diff": diff}
    print(f"{name:28s} {dtype:8s} ({params / 1e6:.1f} M params, {r['tokens']} tokens): transformers "
          f"{r['hf_prompts_per_s']:.0f} prompts/s, vLLM {r['vllm_prompts_per_s']:.0f} prompts/s, "
          f"vLLM/transformers x{r['vllm_over_hf_ratio']:.2f} (spread {r['vllm_over_hf_spread']:.0%}), "
          f"max abs diff {diff:.1e}", flush=True)
    return r


def cache_speed(texts: list[str], repeats: int) -> dict:
    from dit_core import Engine, SamplingParams
    from dit_core.zoo import default_model

    from ar_adapters import PromptCache

    engine = Engine.from_pretrained(default_model(), thinker="hf")
    fam = engine.family
    raw = [t.split("user\n", 1)[1].split("<|im_end|>", 1)[0] for t in texts]
    reqs = [engine.make_request(p, SamplingParams(seed=i, true_cfg_scale=1.0)) for i, p in enumerate(raw)]
    warm_cache = PromptCache(64 << 20)

    def with_cache(cache):
        def run():
            fam.prompt_cache = cache
            fam.encode(reqs)

        return run

    # "cold" has no cache; "warm" is filled by its warm-up call, so every measured call is all hits
    cmp = interleaved({"cold": timed(with_cache(None)), "warm": timed(with_cache(warm_cache))}, repeats)
    r = {"cold_prompts_per_s": len(reqs) / cmp.median("cold"), "warm_prompts_per_s": len(reqs) / cmp.median("warm"),
         "hit_speedup": cmp.ratio("cold", "warm"), "hit_speedup_spread": cmp.ratio_spread("cold", "warm"),
         "cache_bytes": warm_cache.bytes, "hits": warm_cache.hits, "misses": warm_cache.misses}
    print(f"prompt cache, default model, {len(reqs)} prompts: thinker {r['cold_prompts_per_s']:.0f} prompts/s, "
          f"cache hits {r['warm_prompts_per_s']:.0f} prompts/s (x{r['hit_speedup']:.0f}), "
          f"{r['cache_bytes'] / 1e6:.1f} MB", flush=True)
    return r


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the default model's thinker only (under 3 minutes)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bf16", action="store_true",
                    help="also compare in bfloat16 (slow on CPUs without fast bf16: transformers' bf16 path "
                         "ran for over 20 minutes here)")
    args = ap.parse_args(argv)
    from dit_core.zoo import default_model

    texts = prompts(args.prompts)
    rows = [compare("default model thinker", default_model() / "text_encoder", default_model() / "tokenizer",
                    texts, args.repeats)]
    if not args.quick:
        big = build_thinker(1024, 8)
        rows.append(compare("random Qwen2 1024x8", big, big, texts, args.repeats))
        if args.bf16:
            rows.append(compare("random Qwen2 1024x8", big, big, texts, args.repeats, dtype="bfloat16"))
    cache = cache_speed(texts, args.repeats)
    main_row = rows[1] if len(rows) > 1 else rows[0]  # the larger thinker in fp32 (bf16 diffs are bf16's)
    summary = {"vllm_over_hf_ratio": main_row["vllm_over_hf_ratio"],
               "max_abs_diff": max(r["max_abs_diff"] for r in rows if r["dtype"] == "float32"),
               "thinker": f"{main_row['thinker']} {main_row['dtype']}",
               "vllm_over_hf_ratio_by_run": {f"{r['thinker']} {r['dtype']}": r["vllm_over_hf_ratio"] for r in rows},
               "vllm_over_hf_spread": main_row["vllm_over_hf_spread"],
               "cache_hit_speedup": cache["hit_speedup"], "cache_hit_speedup_spread": cache["hit_speedup_spread"],
               "repeats": args.repeats, "method": "interleaved rounds, fresh prompts every round; median of "
                                                  "per-round ratios"}
    payload = {"benchmark": "thinker", "machine": machine(), "args": vars(args), "summary": summary,
               "thinkers": rows, "prompt_cache": cache}
    print(f"summary: vLLM/transformers x{summary['vllm_over_hf_ratio']:.2f} on {summary['thinker']}, "
          f"(spread {summary['vllm_over_hf_spread']:.0%}), max abs diff {summary['max_abs_diff']:.1e} -> "
          f"{write_json('thinker', payload)}")
    return payload


if __name__ == "__main__":
    main()
