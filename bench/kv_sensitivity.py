"""How much a model's next-token logits move when its prefix KV is perturbed: the scale a logits check of a lossy
KV codec must be read against.

Runs the engine tests' model (SmolLM2-135M-Instruct, e2e/vllm_cpu/smollm2.py; its bfloat16 weights computed in
float32, so the curve is the KV's effect and not bfloat16 rounding: in bfloat16 even a 1e-6 perturbation moved the
mean KL to 1e-3) in Hugging Face transformers, not vLLM: prefill a 608-token prefix of
prose (e2e/vllm_cpu/prose.py), perturb every layer's K and V of the prefix by relative Gaussian
noise (per element, ``level`` x the element's tensor rms), then score ``--positions`` teacher-forced continuation
tokens and compare their logits with the unperturbed run (``compare_logits``: mean KL, top-1 agreement). Also
runs the layout-aware codecs (fp8/int8/int4, quantise-dequantise of each layer's [H, T, D] K and V) and a K/V
swap, so the engine test's figures can be placed on the same curve.

    .venv-vllm-cpu/bin/python -I bench/kv_sensitivity.py [--positions 64] [--prompts 2] [--dtype float32]
"""
from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "runtime"), str(ROOT / "tests")]

import torch  # noqa: E402
from kvtier_runtime.codecs import KVLayout, get_kv_codec  # noqa: E402
from plugins.kv_accuracy import compare_logits  # noqa: E402  (tests/plugins: a measure, not product code)

from e2e.vllm_cpu import prose, smollm2  # noqa: E402

PREFIX = 608


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--positions", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = ap.parse_args()
    from transformers import DynamicCache, LlamaForCausalLM

    torch.set_num_threads(2)
    mdir = smollm2.ensure_smollm2(smollm2.default_cache_dir())
    corpus = prose.corpus_ids(mdir)
    lm = LlamaForCausalLM.from_pretrained(mdir, dtype=getattr(torch, args.dtype)).eval()
    h, d = smollm2.SHAPE["num_kv_heads"], smollm2.SHAPE["head_dim"]
    lay = KVLayout(num_layers=1, block_tokens=PREFIX, num_kv_heads=h, head_dim=d, dtype=args.dtype)

    def codec_fn(name):
        kv = get_kv_codec(name, lay, verify=False)  # the codec alone: no fallback to a wider one
        out = torch.empty(kv.max_encoded_nbytes(), dtype=torch.uint8)

        def apply(k, v):
            chunk = torch.stack([k[0], v[0]], dim=1).contiguous().reshape(-1)  # HKTD: [H, 2, T, D]
            n = kv.encode(chunk, out)
            back = torch.empty_like(chunk)
            kv.decode(out[:n], back)
            b = back.view(h, 2, PREFIX, d)
            return b[:, 0].unsqueeze(0).contiguous(), b[:, 1].unsqueeze(0).contiguous()
        return apply

    def noise(level):
        gen = torch.Generator().manual_seed(7)

        def apply(k, v):
            return (k + level * k.float().pow(2).mean().sqrt() * torch.randn(k.shape, generator=gen).to(k.dtype),
                    v + level * v.float().pow(2).mean().sqrt() * torch.randn(v.shape, generator=gen).to(v.dtype))
        return apply

    variants = [(f"noise {lv:g}", noise(lv)) for lv in (1e-6, 1e-5, 1e-4, 1e-3, 3e-3, 1e-2, 3e-2)]
    variants += [(c, codec_fn(c)) for c in ("fp8", "int8", "int4")]
    variants += [("K/V swapped", lambda k, v: (v.clone(), k.clone()))]
    refs: list[torch.Tensor] = []
    tests: dict[str, list[torch.Tensor]] = {name: [] for name, _ in variants}
    with torch.no_grad():
        for p in range(args.prompts):
            ids = torch.tensor([prose.prompt_ids(corpus, PREFIX + args.positions, 101 + p)])
            prefix, rest = ids[:, :PREFIX], ids[:, PREFIX:]
            base = lm(prefix, use_cache=True).past_key_values
            layers = [(base.layers[i].keys.clone(), base.layers[i].values.clone()) for i in range(len(base.layers))]

            def run(transform, layers=layers, rest=rest):
                cache = DynamicCache()
                for i, (k, v) in enumerate(layers):
                    k2, v2 = transform(k, v) if transform else (k, v)
                    cache.update(k2, v2, i)
                return lm(rest, past_key_values=cache, use_cache=True).logits[0].double()
            refs.append(run(None))
            for name, fn in variants:
                tests[name].append(run(fn))
    ref = torch.cat(refs)
    print(f"# model {mdir.name} ({args.dtype}), {args.prompts} prompts x {args.positions} teacher-forced positions after a "
          f"{PREFIX}-token prefix whose KV is perturbed; vs the unperturbed KV")
    print(f"| {'perturbation':14s} | mean KL | top-1 agreement | max abs diff |")
    print("|---|---|---|---|")
    for name, _ in variants:
        c = compare_logits(ref, torch.cat(tests[name]), codec="none")
        print(f"| {name:14s} | {c.mean_kl:.3g} | {c.top1_agreement:.3f} | {c.max_abs_diff:.3g} |")


if __name__ == "__main__":
    main()
