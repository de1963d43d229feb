"""Event YAML composed under a budget: aliases cannot make a small file huge.

A YAML alias (`*a`) stands for the whole node it names, so nine lines that each repeat
the previous line's anchor nine times describe 9^9 values: a 306-byte event file took
`babelcast validate` 4.4 s and 230 MB, 356 bytes took 36 s and 2.25 GB (the same through
`POST /v1/admin/apply`). PyYAML's composer shares aliased nodes and costs nothing; what
costs is everything after it that walks the values as a tree (merge keys `<<` copy, the
line index, validation).

So the file is composed first (`compose`), and refused before anything walks it when it
holds more than `MAX_ALIASES` aliases, an alias that refers to itself, or more than
`MAX_NODES` values once aliases are expanded. Anchors and merge keys for shared defaults
(`<<: *defaults` once per stream) stay well inside both: an event of 500 streams is
~10,000 values. The refusal names the line and key of the alias that costs most.
"""

from __future__ import annotations

from typing import Any

import yaml

Loc = tuple[str | int, ...]

MAX_ALIASES = 1_000
MAX_NODES = 100_000
MAX_DEPTH = 64
"""Nesting, in the file and once aliases are expanded; PyYAML composes recursively, so
a file of 10,000 `[` would otherwise end in RecursionError."""


class AliasRefused(Exception):
    """Where (1-based line, key path) and why; the caller adds the file's name."""

    def __init__(self, line: int | None, path: Loc, message: str) -> None:
        super().__init__(message)
        self.line = line
        self.path = path
        self.message = message


class _CountingLoader(yaml.SafeLoader):
    """A SafeLoader that counts aliases as it composes and notes where each one is."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self._open: list[Loc] = []  # the paths of the collections being composed
        self.alias_lines: dict[Loc, int] = {}
        self.aliases = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        base = self._open[-1] if self._open else ()
        if isinstance(index, yaml.ScalarNode):
            path: Loc = (*base, str(index.value))
        elif isinstance(index, int):
            path = (*base, index)
        else:  # a mapping key, or the root
            path = base
        if len(self._open) > MAX_DEPTH:
            raise AliasRefused(self._line(), path[:8],
                               f"nested deeper than {MAX_DEPTH} levels")
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            line = self._line()
            self.alias_lines.setdefault(path, line)
            if self.aliases > MAX_ALIASES:
                raise AliasRefused(line, path, f"more than {MAX_ALIASES} YAML aliases in one "
                                               "file; write the values out")
            return super().compose_node(parent, index)
        self._open.append(path)
        try:
            return super().compose_node(parent, index)
        finally:
            self._open.pop()


    def _line(self) -> int:
        return int(self.peek_event().start_mark.line) + 1  # type: ignore[no-untyped-call]


def compose(text: str) -> tuple[yaml.Node | None, yaml.SafeLoader]:
    """The document's node graph and the loader to construct it with (the caller calls
    `construct_document` and `dispose`). Raises AliasRefused past a budget, or
    yaml.YAMLError for a syntax error."""
    loader = _CountingLoader(text)
    try:
        root = loader.get_single_node()
        if root is not None and loader.aliases:
            _check_expansion(root, loader.alias_lines)
    except BaseException:
        loader.dispose()
        raise
    return root, loader


def _check_expansion(root: yaml.Node, alias_lines: dict[Loc, int]) -> None:
    sizes: dict[int, int] = {}
    open_: set[int] = set()

    def size(node: yaml.Node, path: Loc) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if len(path) > MAX_DEPTH:
            raise AliasRefused(_line(path, alias_lines), path[:8],
                               f"YAML aliases nest values deeper than {MAX_DEPTH} levels; "
                               "write the values out")
        if key in open_:
            raise AliasRefused(_line(path, alias_lines), path,
                               "this alias refers to the node that holds it (a recursive "
                               "alias); write the value out")
        open_.add(key)
        total = 1
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                sub = (*path, str(k.value)) if isinstance(k, yaml.ScalarNode) else path
                total += size(k, path) + size(v, sub)
                if total > MAX_NODES:
                    break
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                total += size(item, (*path, i))
                if total > MAX_NODES:
                    break
        open_.discard(key)
        sizes[key] = total
        return total

    if size(root, ()) <= MAX_NODES:
        return
    # Blame the alias that stands for the most values.
    worst = max(alias_lines, key=lambda p: _size_at(root, p, sizes))
    raise AliasRefused(alias_lines[worst], worst,
                       f"YAML aliases expand this file past {MAX_NODES:,} values (an alias "
                       "bomb?); write the values out or use fewer aliases")


def _line(path: Loc, alias_lines: dict[Loc, int]) -> int | None:
    while path and path not in alias_lines:
        path = path[:-1]
    return alias_lines.get(path)


def _size_at(root: yaml.Node, path: Loc, sizes: dict[int, int]) -> int:
    node: yaml.Node | None = root
    for part in path:
        if isinstance(node, yaml.MappingNode):
            node = next((v for k, v in node.value
                         if isinstance(k, yaml.ScalarNode) and str(k.value) == part), None)
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) \
                and part < len(node.value):
            node = node.value[part]
        else:
            return 0
        if node is None:
            return 0
    return sizes.get(id(node), 0) if node is not None else 0
