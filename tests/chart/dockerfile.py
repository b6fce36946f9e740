"""A small Dockerfile reader: enough to check base images, copies, users and entrypoints without building."""
from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Instruction:
    keyword: str
    value: str
    line: int


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]


@dataclass
class Dockerfile:
    path: Path
    args: dict[str, str]
    stages: list[Stage]

    @property
    def final(self) -> Stage:
        return self.stages[-1]

    def exec_form(self, keyword: str) -> list[str] | None:
        found = self.final.all(keyword)
        if not found:
            return None
        value = found[-1].value
        return json.loads(value) if value.startswith("[") else shlex.split(value)


def parse(path: Path) -> Dockerfile:
    logical: list[tuple[int, str]] = []
    buffer, start = "", 0
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not buffer and (not line or line.startswith("#")):
            continue
        if buffer and line.startswith("#"):
            continue
        if not buffer:
            start = number
        if line.endswith("\\"):
            buffer += line[:-1] + " "
            continue
        logical.append((start, buffer + line))
        buffer = ""
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for number, text in logical:
        keyword, _, value = text.partition(" ")
        keyword, value = keyword.upper(), value.strip()
        if keyword == "ARG" and not stages:
            name, _, default = value.partition("=")
            args[name] = default
        elif keyword == "FROM":
            words = [w for w in value.split() if not w.startswith("--")]
            base = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m[1], m[0]), words[0])
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(base=base, name=name))
        elif stages:
            stages[-1].instructions.append(Instruction(keyword, value, number))
    return Dockerfile(path=path, args=args, stages=stages)
