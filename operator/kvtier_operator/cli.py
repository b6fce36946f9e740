"""The ``kvtier`` command line.

Subcommands import what they need when they run, so ``kvtier validate`` never loads kopf and ``kvtier replay``
(the runtime's policies, torch-free) never loads the operator's Kubernetes clients.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Optional

import yaml

EXIT_INVALID = 1
EXIT_USAGE = 2


def _read(path: str) -> str:
    from .api.yamlload import YAMLInputError, read_source

    try:
        return read_source(path)
    except YAMLInputError as err:
        raise SystemExit(_fail(str(err), EXIT_USAGE)) from None


def _fail(message: str, code: int = EXIT_INVALID) -> int:
    print(f"kvtier: {message}", file=sys.stderr)
    return code


def cmd_validate(args: argparse.Namespace) -> int:
    from .api.validation import validate_text
    from .api.yamlload import Budget

    problems: list[str] = []
    warnings: list[str] = []
    budget = Budget()  # one bound for the whole input, not per file or per document
    for path in args.files:
        problems += validate_text(_read(path), path, budget, warnings)
    for line in warnings:  # valid, but not what the engine will do: said, without failing the run
        print(f"warning: {line}", file=sys.stderr)
    for line in problems:
        print(line, file=sys.stderr)
    if not problems:
        print(f"{len(args.files)} file(s) valid")
    return EXIT_INVALID if problems else 0


def cmd_render(args: argparse.Namespace) -> int:
    from .api.validation import PolicyInvalid, load_documents, parse_policy
    from .render import RenderError, render

    try:
        docs = load_documents(_read(args.file), args.file)
        if not docs:
            return _fail(f"{args.file}: no KVCachePolicy (kind: KVCachePolicy) in this file")
        if len(docs) > 1 and not args.name:
            return _fail(f"{args.file}: {len(docs)} policies; choose one with --name")
        doc = next((d for _, d in docs if not args.name or d.get("metadata", {}).get("name") == args.name), None)
        if doc is None:
            return _fail(f"{args.file}: no policy named {args.name!r}")
        policy = parse_policy(doc)
        if args.engine and policy.spec.engine and args.engine != policy.spec.engine:
            return _fail(f"{args.file}: --engine {args.engine} contradicts spec.engine: {policy.spec.engine}; "
                         "--engine only supplies an engine the policy leaves unset")
        tiers = None if args.tiers is None else [t for t in args.tiers.split(",") if t]
        rendered = render(policy, engine=args.engine, enabled_tiers=tiers)
    except PolicyInvalid as err:
        for p in err.problems:
            print(f"{args.file}: {p}", file=sys.stderr)
        return EXIT_INVALID
    except RenderError as err:
        return _fail(f"{args.file}: {err}")
    if args.output == "json":
        print(json.dumps(rendered.to_dict(), indent=2))
    elif args.output == "args":
        print(" ".join(_shell_quote(a) for a in rendered.args))
    else:
        for name, content in rendered.files.items():
            print(f"# {name}\n{content}", end="" if content.endswith("\n") else "\n")
    return 0


def _shell_quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)


def cmd_crd(args: argparse.Namespace) -> int:
    from .api.crd import crd_yaml

    sys.stdout.write(crd_yaml())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier", description="Declared, measured KV-cache tiering for LLM "
                                                                "serving on Kubernetes.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("validate", help="check KVCachePolicy files offline, with the CRD's own rules")
    p.add_argument("files", nargs="+", metavar="FILE", help="YAML files ('-' for stdin)")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("render", help="print the engine configuration a policy produces")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--engine", choices=["vllm", "trtllm"], help="engine to render for when spec.engine is unset")
    p.add_argument("--output", "-o", choices=["yaml", "json", "args"], default="yaml")
    p.add_argument("--name", help="policy name when the file holds several")
    p.add_argument("--tiers", help="comma-separated tiers to treat as enabled (as the SLO guard would)")
    p.set_defaults(func=cmd_render)

    p = sub.add_parser("crd", help="print the KVCachePolicy CustomResourceDefinition")
    p.set_defaults(func=cmd_crd)

    for name, loader, help_text in _EXTERNAL:
        p = sub.add_parser(name, help=help_text, add_help=False)
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(func=None, loader=loader)
    return parser


def _replay_main() -> Callable[[Sequence[str]], int]:
    from kvtier_runtime.replay.cli import main

    return main


def _operator_main() -> Callable[[Sequence[str]], int]:
    from .main import main

    return main


def _accuracy_main() -> Callable[[Sequence[str]], int]:
    from kvtier_runtime.accuracy.cli import main

    return main


def _demo_main() -> Callable[[Sequence[str]], int]:
    return _delegate_demo


def _delegate_demo(argv: Sequence[str]) -> int:
    """The demo is test code in a checkout (``e2e/scenario``), not part of this package: find the checkout
    (``--repo``, ``$KVTIER_REPO``, the current directory or a parent) and hand over to ``python -m scenario``."""

    argv = list(argv)
    explicit = next((a.split("=", 1)[1] for a in argv if a.startswith("--repo=")), None)
    if explicit is None and "--repo" in argv and argv.index("--repo") + 1 < len(argv):
        explicit = argv[argv.index("--repo") + 1]
    if explicit or os.environ.get("KVTIER_REPO"):
        candidates = [Path(explicit or os.environ["KVTIER_REPO"])]
    else:
        candidates = [Path.cwd(), *Path.cwd().parents]
    repo = next((c.resolve() for c in candidates if (c / "e2e" / "scenario" / "__main__.py").is_file()), None)
    if repo is None:
        return _fail("demo: needs a kvtier checkout (its e2e/ folder holds the scenario); run it from the checkout "
                     "or pass --repo PATH", EXIT_USAGE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(repo / "e2e"), os.environ.get("PYTHONPATH")]))}
    os.execve(sys.executable, [sys.executable, "-m", "scenario", *argv], env)
    return 0  # not reached


# Subcommands with parsers of their own, loaded only when used.
_EXTERNAL = [
    ("replay", _replay_main, "replay a trace to size tiers and compare policies (kvtier replay --help)"),
    ("operator", _operator_main, "run the operator (kvtier operator --help)"),
    ("accuracy", _accuracy_main, "what the KV codecs do to a model's predictions, on its real KV (kvtier accuracy --help)"),
    ("demo", _demo_main, "run the end-to-end scenario from a checkout: python -m scenario in its e2e/ (kvtier demo --help)"),
]


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv and argv[0] in {name for name, _, _ in _EXTERNAL}:
        loader = next(loader for name, loader, _ in _EXTERNAL if name == argv[0])
        try:
            sub_main = loader()
        except ImportError as err:
            return _fail(f"{argv[0]}: not available in this installation ({err}); "
                         "install kvtier with the matching extra, e.g. pip install 'kvtier[all]'", EXIT_USAGE)
        return int(sub_main(argv[1:]) or 0)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        return int(args.func(args) or 0)
    except (yaml.YAMLError, ValueError) as err:
        return _fail(" ".join(str(err).split()))
    except BrokenPipeError:
        return 0
    except (RecursionError, MemoryError) as err:
        # The input bounds should make these unreachable; if not, one line, never a traceback.
        return _fail(f"input too large or too deeply nested ({type(err).__name__})")


if __name__ == "__main__":
    sys.exit(main())
