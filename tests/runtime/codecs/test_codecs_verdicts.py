"""The verifying codec's verdicts against the attention check written out plainly
(``plugins.kv_accuracy.reference_check_error``), on the held-out sets the codec tests use (outlier K channels,
outlier tokens), random chunks and adversarial ones (outlier channels swept across the budget, huge and tiny
norms, one dominant token, non-finite values), in several layouts. Any faster form of the check (fused passes,
an analytical bound that passes chunks without running attention) must keep every verdict: no chunk the check
refuses may be stored with the requested codec, and none it accepts may fall back."""
from __future__ import annotations

import math

import pytest
import torch
from kvtier_runtime.codecs import ATTENTION_BUDGETS, KVLayout, get_kv_codec, peek_header
from plugins.kv_accuracy import reference_check_error

from tests.runtime.codecs.test_codecs_kv import GOAL, _token_outliers, make_chunk, roundtrip

LAYOUTS = {
    "goal": GOAL,
    "layer-major, 5 layers, 2 pages": dict(num_layers=5, block_tokens=128, num_kv_heads=2, head_dim=64,
                                           dtype="bfloat16", page_order="HKTD", pages=2),
    "page-major": dict(num_layers=3, block_tokens=128, num_kv_heads=2, head_dim=64, dtype="bfloat16",
                       page_order="KHTD", outer="PL", pages=2),
    "fp16": dict(num_layers=2, block_tokens=256, num_kv_heads=2, head_dim=128, dtype="float16", page_order="HKTD"),
    "fp32, staged (CPU_VEC)": dict(num_layers=2, block_tokens=256, num_kv_heads=2, head_dim=64, dtype="float32",
                                   page_order="CPU_VEC"),
    "short page (checked whole)": dict(num_layers=2, block_tokens=64, num_kv_heads=2, head_dim=64,
                                       dtype="bfloat16", page_order="HKTD"),
}


def _scaled(lay: KVLayout, seed: int, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    shape = (lay.num_layers, lay.num_kv_heads, lay.tokens, lay.head_dim)
    return make_chunk(lay, k=torch.randn(shape, generator=gen) * k_scale, v=torch.randn(shape, generator=gen) * v_scale)


def _one_token(lay: KVLayout, seed: int, factor: float) -> torch.Tensor:
    """One key per (layer, head) ``factor`` times the rest: it dominates the softmax and inflates its group."""
    gen = torch.Generator().manual_seed(seed)
    shape = (lay.num_layers, lay.num_kv_heads, lay.tokens, lay.head_dim)
    k = torch.randn(shape, generator=gen)
    k[:, :, seed % lay.tokens] *= factor
    return make_chunk(lay, k=k, v=torch.randn(shape, generator=gen))


def _poisoned(lay: KVLayout, value: float) -> torch.Tensor:
    x = make_chunk(lay, seed=99)
    x[len(x) // 3] = value
    return x


def chunks(lay: KVLayout) -> list[tuple[str, torch.Tensor]]:
    out = [(f"normal {s}", make_chunk(lay, seed=s)) for s in range(4)]
    # the held-out outlier sets of the codec tests and of bench/codecs.py --kv-accuracy (outlier K x20)
    out += [(f"outlier K x{o} seed {s}", make_chunk(lay, seed=s, outlier=o)) for s, o in
            ((2, 5.0), (3, 5.0), (3, 20.0), (4, 50.0), (10, 20.0), (11, 20.0), (12, 20.0))]
    out += [(f"outlier tokens {s}", _token_outliers(lay, s)) for s in (5, 6)]
    # outlier channels swept across the budget: the check's verdict flips somewhere in here
    out += [(f"outlier K x{o:.0f} n{n}", make_chunk(lay, seed=int(o) + n, outlier=o, n_outliers=n))
            for n in (1, 4, 16) for o in (2.0, 8.0, 30.0, 60.0, 120.0, 400.0)]
    out += [(f"one token x{f:g}", _one_token(lay, 7 + i, f)) for i, f in enumerate((3.0, 10.0, 100.0, 1e4))]
    out += [("huge norms", _scaled(lay, 20, 1e30, 1e30)), ("tiny norms", _scaled(lay, 21, 1e-30, 1e-30)),
            ("keys x100", _scaled(lay, 22, k_scale=100.0)), ("values x1e-3", _scaled(lay, 23, v_scale=1e-3)),
            ("keys x1e-4", _scaled(lay, 24, k_scale=1e-4)), ("zeros", torch.zeros_like(make_chunk(lay)))]
    out += [(f"a {v}", _poisoned(lay, v)) for v in (math.inf, -math.inf, math.nan)]
    return out


@pytest.mark.parametrize("name", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_verifying_codec_keeps_every_verdict_of_the_attention_check(name, layout):
    lay = KVLayout(**LAYOUTS[layout])
    verifying, plain = get_kv_codec(name, lay), get_kv_codec(name, lay, verify=False)
    budget = ATTENTION_BUDGETS[name]
    verdicts = []
    for phase, (label, x) in enumerate(chunks(lay)):
        decoded, _ = roundtrip(plain, x)
        out = torch.empty(verifying.max_encoded_nbytes(), dtype=torch.uint8)
        n = verifying.encode(x, out)    # the codec's n-th encode samples with phase n (mod its stride)
        stored = peek_header(out[:n]).codec
        err = reference_check_error(lay, x, decoded, phase, verifying.verify_sample)
        accepted, refused = stored == name, not err <= budget
        assert not (accepted and refused), f"{label}: stored {name} although the check measures {err:.4f}"
        assert accepted or refused, f"{label}: fell back to {stored} although the check measures {err:.4f}"
        verdicts.append(accepted)
    # the sets hold both verdicts, so that a check that accepts (or refuses) everything fails here
    assert any(verdicts) and not all(verdicts), verdicts
