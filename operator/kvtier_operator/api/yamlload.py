"""A YAML reader for untrusted policy files: bounded work, strict documents, one-line errors.

PyYAML's safe loader builds objects safely but not cheaply: an alias bomb (anchors that reference anchors) is a few
hundred bytes that expand to billions of nodes once anything walks the result, deep nesting overflows the
composer's recursion, and a repeated key silently keeps its last value. This loader bounds the input size, the
nesting depth and the number of nodes counted with every alias expanded, rejects duplicate keys (the API server's
strict decoding rejects them too), keeps timestamps as the strings the user wrote (as kubectl sends them), and
raises :class:`YAMLInputError` with one line that names the file, line and column.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, BinaryIO

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

MAX_BYTES = 1 << 20          # a policy file is a few KiB; 1 MiB leaves room for many policies in one stream
MAX_DEPTH = 64               # a policy nests about 8 levels deep
MAX_NODES = 100_000          # per document, aliases expanded
# For the whole input (every document of every file of one `kvtier validate`): a policy is ~100 values and its
# CEL rules cost ~0.1 s, so these admit hundreds of real policies and refuse a thousand near-limit documents,
# which cost minutes of CPU when only each document was bounded (a denial of service by many near-limit documents).
MAX_DOCUMENTS = 200
MAX_TOTAL_BYTES = 4 << 20
MAX_TOTAL_NODES = 200_000
MAX_SECONDS = 20.0
MERGE_TAG = "tag:yaml.org,2002:merge"


class Budget:
    """What one invocation may still spend, across all its files and documents; every bound raises
    :class:`YAMLInputError` naming the source and the bound."""

    def __init__(self) -> None:
        self.documents, self.bytes, self.nodes, self.seconds = (MAX_DOCUMENTS, MAX_TOTAL_BYTES, MAX_TOTAL_NODES,
                                                                MAX_SECONDS)
        self.deadline = time.monotonic() + self.seconds

    def spend_bytes(self, n: int, source: str) -> None:
        self.bytes -= n
        if self.bytes < 0:
            raise YAMLInputError(f"{source}: the input is larger than {MAX_TOTAL_BYTES} bytes in all")

    def spend_document(self, nodes: int, source: str) -> None:
        self.documents -= 1
        self.nodes -= nodes
        if self.documents < 0:
            raise YAMLInputError(f"{source}: more than {MAX_DOCUMENTS} documents in all")
        if self.nodes < 0:
            raise YAMLInputError(f"{source}: more than {MAX_TOTAL_NODES} values in all documents (aliases "
                                 "expanded)")
        self.check_time(source)

    def check_time(self, source: str) -> None:
        if time.monotonic() > self.deadline:
            raise YAMLInputError(f"{source}: stopped after {self.seconds:g}s (the bound on one invocation's "
                                 "work); split the input")


class YAMLInputError(ValueError):
    """The input is not a YAML stream kvtier reads; the message is one line naming the source."""


class _BoundedLoader(yaml.SafeLoader):
    def __init__(self, stream: str, source: str):
        super().__init__(stream)
        self.source = source
        self._depth = 0

    def _fail(self, message: str, node_or_mark: Any = None) -> YAMLInputError:
        mark = getattr(node_or_mark, "start_mark", node_or_mark)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None and hasattr(mark, "line") else ""
        return YAMLInputError(f"{self.source}{where}: {message}")

    def compose_node(self, parent: Any, index: Any) -> Node | None:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise self._fail(f"nested deeper than {MAX_DEPTH} levels", self.peek_event())  # type: ignore[no-untyped-call]
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == MERGE_TAG:
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:  # an unhashable key: SafeConstructor reports it below
                continue
            if duplicate:
                raise self._fail(f"duplicate key {_short(key)} (a repeated key would silently replace the first)",
                                 key_node)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


# Timestamps stay strings: the API server receives what the user wrote, not a re-formatted datetime.
_BoundedLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _expanded_shape(root: Node, limit: int) -> tuple[int, int]:
    """(nodes, depth) of ``root`` with every alias expanded, each capped just above ``limit``; memoised, so a
    bomb costs the work of its own size, not of its expansion. A recursive alias counts as unbounded."""
    shapes: dict[int, tuple[int, int]] = {}
    pending: set[int] = set()
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if id(node) in shapes:
            continue
        if isinstance(node, ScalarNode):
            shapes[id(node)] = (1, 1)
            continue
        children = ([n for pair in node.value for n in pair] if isinstance(node, MappingNode)
                    else list(node.value) if isinstance(node, SequenceNode) else [])
        if children_done:
            pending.discard(id(node))
            known = [shapes[id(c)] for c in children]
            size = 1 + sum(k[0] for k in known)
            depth = 1 + max((k[1] for k in known), default=0)
            shapes[id(node)] = (min(size, limit + 1), min(depth, limit + 1))
            continue
        pending.add(id(node))
        stack.append((node, True))
        for c in children:
            if id(c) in pending:
                return limit + 1, limit + 1
            if id(c) not in shapes:
                stack.append((c, False))
    return shapes[id(root)]


def load_all(text: str, source: str = "<input>", budget: Budget | None = None) -> list[Any]:
    """Every document of a YAML stream, or :class:`YAMLInputError`. ``budget``: shared by every stream of one
    invocation (default: this stream's own)."""
    if len(text) > MAX_BYTES:
        raise YAMLInputError(f"{source}: larger than {MAX_BYTES} bytes")
    budget = budget if budget is not None else Budget()
    budget.spend_bytes(len(text), source)
    docs: list[Any] = []
    loader = None
    try:
        # The reader already rejects unprintable characters (NUL...) while it is being built.
        loader = _BoundedLoader(text, source)
        while loader.check_node():
            node = loader.get_node()
            if node is None:
                continue
            size, depth = _expanded_shape(node, MAX_NODES)
            if size > MAX_NODES:
                raise loader._fail(f"more than {MAX_NODES} values once aliases are expanded (an alias bomb?)",
                                   node)
            budget.spend_document(size, source)
            if depth > MAX_DEPTH:
                raise loader._fail(f"nested deeper than {MAX_DEPTH} levels once aliases are expanded", node)
            docs.append(loader.construct_document(node))
    except YAMLInputError:
        raise
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        raise YAMLInputError(f"{source}{where}: not valid YAML: {err.problem or err.context}") from None
    except yaml.YAMLError as err:
        raise YAMLInputError(f"{source}: not valid YAML: {' '.join(str(err).split())[:200]}") from None
    except RecursionError:  # defence in depth: the depth bound should make this unreachable
        raise YAMLInputError(f"{source}: nested too deeply") from None
    finally:
        if loader is not None:
            loader.dispose()
    return docs


def decode(data: bytes, source: str) -> str:
    """UTF-8 text (a BOM is dropped), or :class:`YAMLInputError` naming the first bad byte."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise YAMLInputError(f"{source}: not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start})") \
            from None


def _read_bounded(stream: BinaryIO, source: str) -> bytes:
    data = stream.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise YAMLInputError(f"{source}: larger than {MAX_BYTES} bytes")
    return data


def read_source(path: str) -> str:
    """The text of a file (``-``: standard input), read at most ``MAX_BYTES`` and decoded as UTF-8."""
    if path == "-":
        return decode(_read_bounded(sys.stdin.buffer, "<stdin>"), "<stdin>")
    try:
        p = Path(path)
        if p.is_dir():
            raise YAMLInputError(f"{path}: is a directory")
        with p.open("rb") as f:
            return decode(_read_bounded(f, path), path)
    except OSError as err:
        raise YAMLInputError(f"{path}: {err.strerror or err}") from None
