"""Reading the YAML files a person writes (fractus-pod.yaml, stages, criteria), a mistake
reported in one line; and setting one key of such a file with the rest kept as written.

Bounded: the size is capped before reading, and the node graph measured before any object is
built, so an alias bomb or a stack-overflowing nesting is refused.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from launcher.errors import UserError

MAX_BYTES = 1 << 20          # 1 MiB: the largest criteria file is ~6 KB
MAX_NODES = 100_000          # scalars, lists and mappings after aliases are expanded
MAX_DEPTH = 64               # nesting of lists/mappings; the files use 3


def read_yaml(path: str | Path, what: str):
    """The parsed document (None if empty); UserError if unreadable, not YAML, or too big."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        raise UserError(f"{what} not found: {path}; put it there or fix the path that names "
                        f"it (fractus-pod.yaml's stages:/criteria:, or `fractus-pod init`)") \
            from None
    except IsADirectoryError:
        raise UserError(f"{what} {path} is a directory, not a file; point to the YAML file") \
            from None
    except OSError as exc:
        raise UserError(f"{what} {path}: cannot read it ({exc.strerror}); fix its permissions "
                        f"or point to another file") from None
    if len(raw) > MAX_BYTES:
        raise UserError(f"{path}: {what} is larger than {MAX_BYTES >> 20} MiB; a config is a "
                        f"few KB, so point to the right file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise UserError(f"{path}: line {line}: byte 0x{raw[exc.start]:02X} is not UTF-8; "
                        f"save the file as UTF-8") from None
    return parse_yaml(text, str(path))


def parse_yaml(text: str, source: str):
    """`text` parsed within this module's bounds (e.g. a hub's copy of fractus-pod.yaml)."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_size(node, source)
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        raise UserError(f"{source}: invalid YAML ({_describe(exc)})") from None
    except RecursionError:     # PyYAML's composer recurses once per level, before our walk
        raise UserError(f"{source}: nested deeper than {MAX_DEPTH} levels; the settings "
                        f"nest 3 levels, so flatten it") from None
    finally:
        loader.dispose()


def _describe(exc: yaml.YAMLError) -> str:
    """The problem and where: PyYAML's first line lacks the line number."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or getattr(exc, "context", None) or \
        str(exc).splitlines()[0]
    if mark is None:
        return problem
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"


def _check_size(root: yaml.Node, source: str) -> None:
    """Refuse past MAX_NODES expanded, past MAX_DEPTH, or self-containing. Each node is
    measured once (by identity), so a bomb costs as much as its text, not its expansion."""
    size: dict[int, int] = {}
    depth_of: dict[int, int] = {}
    on_path: set[int] = set()

    def measure(node: yaml.Node, depth: int) -> tuple[int, int]:
        key = id(node)
        if key in size:
            return size[key], depth_of[key]
        if key in on_path:
            raise UserError(f"{source}: invalid YAML (an anchor is used inside itself at "
                            f"line {node.start_mark.line + 1}); remove that alias")
        if depth > MAX_DEPTH:
            raise UserError(f"{source}: nested deeper than {MAX_DEPTH} levels at line "
                            f"{node.start_mark.line + 1}; the settings nest 3 levels, so "
                            f"flatten it")
        children: list = []
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [part for pair in node.value for part in pair]
        on_path.add(key)
        total, deepest = 1, 0
        for child in children:
            child_size, child_depth = measure(child, depth + 1)
            total += child_size
            deepest = max(deepest, child_depth + 1)
            if total > MAX_NODES:
                raise UserError(f"{source}: expands to more than {MAX_NODES:,} values "
                                f"(aliases repeated inside aliases?); write the values out")
            if depth + deepest > MAX_DEPTH:
                raise UserError(f"{source}: nested deeper than {MAX_DEPTH} levels at line "
                                f"{node.start_mark.line + 1}; the settings nest 3 levels, so "
                                f"flatten it")
        on_path.discard(key)
        size[key], depth_of[key] = total, deepest
        return total, deepest

    measure(root, 0)


def set_top_level_key(text: str, key: str, value, source: str) -> str:
    """`text` with top-level `key` set to `value`, every other line kept as written; verified
    by parsing again, else rewritten whole with its leading comments kept."""
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines)
                  if re.match(rf"{re.escape(key)}\s*:(\s|$)", line)), None)
    block = yaml.safe_dump({key: value}, sort_keys=False, default_flow_style=False)
    if start is None:
        head = text if not text or text.endswith("\n") else text + "\n"
        edited = head + block
    else:
        end = start + 1
        # The block runs on while lines are indented or are items of an indentless list;
        # blank and column-0 comment lines after it belong to what follows.
        while end < len(lines) and (lines[end][:1] in (" ", "\t", "-")
                                    or not lines[end].strip()):
            end += 1
        while end > start + 1 and (not lines[end - 1].strip()
                                   or lines[end - 1].lstrip().startswith("#")):
            end -= 1
        edited = "".join(lines[:start]) + block + "".join(lines[end:])
    wanted = dict(parse_yaml(text, source) or {})
    wanted[key] = value
    if parse_yaml(edited, source) == wanted:
        return edited
    header = "".join(line for line in _leading_comments(lines))
    return header + yaml.safe_dump(wanted, sort_keys=False)


def _leading_comments(lines: list[str]):
    for line in lines:
        if not line.lstrip().startswith("#"):
            return
        yield line
