"""``kvtier accuracy``: argument parsing, the progress bar and the output. Bad input is one line naming the
option and exit status 2; transformers is imported only when the run starts."""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections.abc import Callable, Sequence

import torch

from .chunks import BACKENDS, KV_CACHE_LAYOUTS, Geometry
from .harness import Run, Tolerance, execute, plan_steps, table, to_json

EXIT_USAGE = 2


def _int_list(option: str) -> Callable[[str], tuple[int, ...]]:
    def parse(value: str) -> tuple[int, ...]:
        try:
            out = tuple(int(v) for v in value.split(",") if v.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{option}: {value!r} is not a comma-separated list of integers") from None
        if not out:
            raise argparse.ArgumentTypeError(f"{option}: empty")
        return out
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvtier accuracy",
        description="What kvtier's KV codecs do to a model's predictions: the prefix's real KV through the codec "
                    "path an engine's worker uses (layout, chunking, verification, fallback), the continuation "
                    "scored against the exact cache (perplexity change, KL, top-1 agreement), with what each chunk "
                    "was stored as, bytes per raw byte, encode/decode speed and a verdict under your tolerance.")
    p.add_argument("--model", metavar="DIR", help="a local Hugging Face model directory (offline mode)")
    p.add_argument("--engine", metavar="URL",
                   help="a running vLLM engine serving kvtier's tiers (started with --max-logprobs -1 and "
                        "VLLM_SERVER_DEV_MODE=1): the prefix written through its tiers, dropped from its cache and "
                        "host tier, reloaded and scored against the same prefix computed (--context, --positions, "
                        "--offset and the tolerances apply; the engine's own policy decides the codec)")
    p.add_argument("--positions", type=int, default=128, metavar="N",
                   help="engine mode: teacher-forced positions scored after each prefix, one request each "
                        "(default 128)")
    p.add_argument("--text", required=True, metavar="FILE", help="UTF-8 text to take the prefix and continuation from")
    p.add_argument("--codecs", default="fp8,int8,int4", help="comma-separated codecs (default fp8,int8,int4)")
    p.add_argument("--context", type=_int_list("--context"), default=(2048, 6144), metavar="N[,N...]",
                   help="prefix lengths in tokens (default 2048,6144)")
    p.add_argument("--continuation", type=int, default=1024, metavar="N",
                   help="most tokens scored after a prefix (default 1024; a quarter of the prefix, at least 256, "
                        "within the model's positions)")
    p.add_argument("--offset", type=int, default=0, metavar="TOKENS", help="where in the text the prefix starts")
    p.add_argument("--block-size", type=int, default=16, help="the engine's KV block in tokens (vLLM --block-size)")
    p.add_argument("--chunk-tokens", type=int, default=256,
                   help="tokens per offloaded chunk (kvtier offload.chunkTokens; default 256)")
    p.add_argument("--backend", choices=BACKENDS, default=None,
                   help="the engine's attention backend, which sets the page order (default CPU_ATTN on cpu, "
                        "FLASH_ATTN on cuda)")
    p.add_argument("--kv-cache-layout", choices=KV_CACHE_LAYOUTS, default=None,
                   help="vLLM's KV cache layout (default LBHNC for CPU_ATTN, LBNHC otherwise)")
    p.add_argument("--kv-dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                   help="the engine's KV cache dtype (default bfloat16)")
    p.add_argument("--no-verify", action="store_true",
                   help="the tier's codecFallback off: no attention check, no fallback (not the default)")
    p.add_argument("--max-ppl-increase", type=float, default=0.5, metavar="PCT",
                   help="tolerance: perplexity increase in percent (default 0.5)")
    p.add_argument("--max-kl", type=float, default=1e-3, help="tolerance: mean KL in nats (default 0.001)")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default cuda when available)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _progress(total: int, quiet: bool) -> tuple[Callable[[int, str], None] | None, Callable[[], object]]:
    if quiet:
        return None, lambda: None
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None:
        bar = tqdm(total=total, file=sys.stderr, unit="step", dynamic_ncols=True)

        def tick(n: int, what: str) -> None:
            bar.set_description(what, refresh=False)
            bar.update(n)
        return tick, bar.close
    done = [0]

    def tick_plain(n: int, what: str) -> None:
        done[0] += n
        print(f"\r[{done[0]}/{total}] {what}", end="", file=sys.stderr, flush=True)
    return tick_plain, lambda: print(file=sys.stderr)


def _engine_main(args: argparse.Namespace) -> int:
    from .engine import EngineClient, EngineRun, engine_table, measure_engine
    from .harness import read_text

    try:
        if not 1 <= args.positions <= 4096:
            raise ValueError(f"--positions: {args.positions} must be in 1..4096")
        tolerance = Tolerance(ppl_pct=args.max_ppl_increase, kl=args.max_kl)
        client = EngineClient(args.engine)
        run = EngineRun(contexts=args.context, positions=args.positions, offset=args.offset)
        tick, close = _progress(2 * len(run.contexts), args.quiet)
        try:
            results = measure_engine(client, read_text(pathlib.Path(args.text)), run, tick)
        finally:
            close()
    except (ValueError, RuntimeError) as err:
        print(f"kvtier accuracy: {' '.join(str(err).split())}", file=sys.stderr)
        return EXIT_USAGE
    within = all(r.scores.ppl_change_pct <= tolerance.ppl_pct and r.scores.mean_kl <= tolerance.kl for r in results)
    if args.json:
        print(json.dumps({"engine": client.url, "model": client.model, "within_tolerance": within, "contexts": [
            {"context": r.context, "positions": r.positions, "ppl_change_pct": r.scores.ppl_change_pct,
             "mean_kl": r.scores.mean_kl, "top1_agreement": r.scores.top1, "reloaded_by_source": r.sources}
            for r in results]}, indent=2))
    else:
        print(engine_table(client.url, client.model, results))
        print(f"verdict: {'within' if within else 'OUTSIDE'} the tolerance (perplexity +{tolerance.ppl_pct}%, "
              f"KL {tolerance.kl:g}) at every context")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.model is None) == (args.engine is None):
        print("kvtier accuracy: give --model DIR (offline) or --engine URL (a running engine), one of them",
              file=sys.stderr)
        return EXIT_USAGE
    if args.engine is not None:
        return _engine_main(args)
    try:
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        backend = args.backend or ("CPU_ATTN" if device == "cpu" else "FLASH_ATTN")
        layout = args.kv_cache_layout or ("LBHNC" if backend == "CPU_ATTN" else "LBNHC")
        geometry = Geometry(block_tokens=args.block_size, chunk_tokens=args.chunk_tokens, backend=backend,
                            kv_cache_layout=layout, kv_dtype=args.kv_dtype)
        codecs = tuple(c.strip() for c in args.codecs.split(",") if c.strip())
        run = Run(model_dir=pathlib.Path(args.model), text=pathlib.Path(args.text), codecs=codecs,
                  contexts=args.context, continuation=args.continuation, offset=args.offset, geometry=geometry,
                  verify=not args.no_verify, device=device,
                  tolerance=Tolerance(ppl_pct=args.max_ppl_increase, kl=args.max_kl))
        if args.threads < 0 or args.threads > 1024:
            raise ValueError(f"--threads: {args.threads} must be in 0..1024")
        if args.threads:
            torch.set_num_threads(args.threads)
        tick, close = _progress(plan_steps(run, args.chunk_tokens), args.quiet)
        try:
            result = execute(run, tick)
        finally:
            close()
    except (ValueError, RuntimeError) as err:
        print(f"kvtier accuracy: {' '.join(str(err).split())}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps(to_json(result), indent=2))
    else:
        print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
