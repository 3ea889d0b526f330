"""The AR thinker on vLLM vs transformers, same weights, in one run; and the prompt cache.

    python -m benchmarks.thinker [--quick]

For each thinker size (the default model's, and a larger random Qwen2 with head_dim 64),
64 templated prompts of mixed length are encoded as ONE batch by each side (after a warm-up),
a few times; prompts/s, their ratio, and the max abs difference of the hidden states. Then the
prompt cache: the same 64 prompts through the engine's encode path, cold (thinker) and warm
(cache hits).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import machine, write_json

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
WORDS = "a cat dog tree house car city sky sun moon sea mountain river flower red green blue big small".split()


def prompts(n: int) -> list[str]:
    from dit_core.families.qwenimage import TEMPLATE

    return [TEMPLATE.format(" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(3 + (i * 5) % 40)))
            for i in range(n)]


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def build_thinker(hidden: int, layers: int) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from dit_core.random_models.tokenizers import qwen_tokenizer

    path = Path(tempfile.mkdtemp()) / f"qwen2-{hidden}x{layers}"
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
    try:
        hf_s, vl_s = timed(lambda: hf.encode(texts), repeats), timed(lambda: vl.encode(texts), repeats)
        diff = max((a.hidden.float() - b.hidden).abs().max().item()
                   for a, b in zip(vl.encode(texts), hf.encode(texts)))
    finally:
        vl.close()
    params = sum(p.numel() for p in hf.model.parameters())
    r = {"thinker": name, "dtype": dtype, "params": params, "prompts": len(texts), "tokens": sum(hf.count_tokens(texts)),
         "hf_prompts_per_s": len(texts) / hf_s, "vllm_prompts_per_s": len(texts) / vl_s,
         "vllm_over_hf_ratio": hf_s / vl_s, "max_abs_diff": diff}
    print(f"{name:28s} {dtype:8s} ({params / 1e6:.1f} M params, {r['tokens']} tokens): transformers "
          f"{r['hf_prompts_per_s']:.0f} prompts/s, vLLM {r['vllm_prompts_per_s']:.0f} prompts/s, "
          f"vLLM/transformers x{r['vllm_over_hf_ratio']:.2f}, max abs diff {diff:.1e}", flush=True)
    return r


def cache_speed(texts: list[str], repeats: int) -> dict:
    from dit_core import Engine, SamplingParams
    from dit_core.zoo import default_model

    engine = Engine.from_pretrained(default_model(), thinker="hf")
    fam = engine.family
    raw = [t.split("user\n", 1)[1].split("<|im_end|>", 1)[0] for t in texts]
    reqs = [engine.make_request(p, SamplingParams(seed=i, true_cfg_scale=1.0)) for i, p in enumerate(raw)]
    fam.prompt_cache = None
    cold = timed(lambda: fam.encode(reqs), repeats)
    from ar_adapters import PromptCache

    fam.prompt_cache = PromptCache(64 << 20)
    fam.encode(reqs)
    warm = timed(lambda: fam.encode(reqs), repeats)
    r = {"cold_prompts_per_s": len(reqs) / cold, "warm_prompts_per_s": len(reqs) / warm, "hit_speedup": cold / warm,
         "cache_bytes": fam.prompt_cache.bytes}
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
               "cache_hit_speedup": cache["hit_speedup"]}
    payload = {"benchmark": "thinker", "machine": machine(), "args": vars(args), "summary": summary,
               "thinkers": rows, "prompt_cache": cache}
    print(f"summary: vLLM/transformers x{summary['vllm_over_hf_ratio']:.2f} on {summary['thinker']}, "
          f"max abs diff {summary['max_abs_diff']:.1e} -> {write_json('thinker', payload)}")
    return payload


if __name__ == "__main__":
    main()
