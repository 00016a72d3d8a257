"""Reading rules files: JSON, TOML and YAML, with the checks that keep hostile input
(FIFOs, devices, huge files, alias bombs, duplicate keys) from blocking or exhausting us."""

from __future__ import annotations

import json
import os
import stat
import tomllib
from pathlib import Path
from typing import Any

from nnx_shard._errors import ShardingError, mode_kind, short

#: A rules file larger than this is refused (MaxText's base.yml is ~40 KB).
MAX_FILE_BYTES = 16 << 20
#: A YAML rules file whose aliases expand to more nodes than this is refused.
MAX_YAML_NODES = 100_000


def _read_text(path: Path) -> str:
    """The UTF-8 text of a rules file: a regular file (never a FIFO, a device or a
    folder, which would block or never end) of at most :data:`MAX_FILE_BYTES`."""
    where = f"rules file {short(str(path), 1000)}"
    try:
        # O_NONBLOCK: opening a FIFO would otherwise wait for a writer; what was opened
        # is checked with fstat (no race with a path swapped after a stat).
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise FileNotFoundError(f"{where}: no such file. Fix: the path of a .json, .toml "
                                "or .yaml rules file") from None
    except IsADirectoryError:
        fd = None
    except OSError as e:
        raise ShardingError(f"{where} cannot be opened: {e.strerror or e}. Fix: a readable "
                            ".json, .toml or .yaml rules file") from None
    try:
        mode = os.fstat(fd).st_mode if fd is not None else stat.S_IFDIR
        if not stat.S_ISREG(mode):
            raise ShardingError(f"{where} is {mode_kind(mode)}, not a regular file. Fix: the path of a "
                                ".json, .toml or .yaml rules file")
        assert fd is not None
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb") as f:
            fd = None
            data = f.read(MAX_FILE_BYTES + 1)
    finally:
        if fd is not None:
            os.close(fd)
    if len(data) > MAX_FILE_BYTES:
        raise ShardingError(f"{where} is larger than {MAX_FILE_BYTES >> 20} MiB, too large for "
                            "a rules table. Fix: the path of the rules file itself")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ShardingError(f"{where} is not UTF-8 text (byte {data[e.start]:#04x} at offset "
                            f"{e.start}). Fix: save it as UTF-8 text") from None


def _no_duplicates(pairs: list[tuple[Any, Any]], where: str) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ShardingError(f"{where} holds the key {short(k)} twice (a later one would "
                                "silently replace the first). Fix: keep one of them; to list "
                                "candidates of one logical name use a list, e.g. "
                                "mlp = ['model', '']")
        out[k] = v
    return out


def _yaml(text: str, where: str) -> Any:
    """YAML through PyYAML's safe loader, refusing duplicate keys and aliases that
    expand past :data:`MAX_YAML_NODES` nodes (a few hundred bytes of nested aliases
    can stand for billions of values)."""
    try:
        import yaml
    except ImportError as e:
        raise ImportError(
            f"{where} is YAML, which needs PyYAML. "
            "Fix: pip install nnx_shard[yaml] (or pip install pyyaml), or use .json/.toml."
        ) from e

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            if isinstance(node, yaml.MappingNode):
                keys = [self.construct_object(k, deep=True) for k, _ in node.value
                        if k.tag != "tag:yaml.org,2002:merge"]
                _no_duplicates([(k, None) for k in keys if isinstance(k, str | int | float)],
                               where)
            return super().construct_mapping(node, deep=deep)

    def children(node: Any) -> list[Any]:
        if isinstance(node, yaml.SequenceNode):
            return list(node.value)
        if isinstance(node, yaml.MappingNode):
            return [x for kv in node.value for x in kv]
        return []

    def expanded(root: Any) -> int:
        # Values as constructed, aliases expanded: a post-order walk, each distinct node
        # once with the expanded size of its children (memoised: linear in the file).
        sizes: dict[int, int] = {}
        seen: set[int] = set()
        stack = [(root, False)]
        while stack:
            node, done = stack.pop()
            if done:
                sizes[id(node)] = min(1 + sum(sizes.get(id(c), 1) for c in children(node)),
                                      MAX_YAML_NODES + 1)
            elif id(node) not in seen:
                seen.add(id(node))
                stack.append((node, True))
                stack.extend((c, False) for c in children(node) if id(c) not in seen)
        return sizes[id(root)]

    loader = Loader(text)
    try:
        node = loader.get_single_node()
        if node is not None and expanded(node) > MAX_YAML_NODES:
            raise ShardingError(f"{where}: its aliases expand to more than {MAX_YAML_NODES:,} "
                                "values, far more than a rules table holds. Fix: write the "
                                "table out without nested aliases")
        return None if node is None else loader.construct_document(node)
    except yaml.YAMLError as e:
        raise ShardingError(f"{where} could not be parsed: {' '.join(str(e).split())[:400]}") from None
    finally:
        loader.dispose()


def _load(path: Path) -> Any:
    """The parsed content of a .json / .toml / .yaml rules file."""
    where = f"rules file {short(str(path), 1000)}"
    suffix = path.suffix.lower()
    if suffix not in (".json", ".toml", ".yaml", ".yml"):
        raise ShardingError(
            f"{where}: unknown format {short(path.suffix)}. "
            "Fix: use a .json, .toml or .yaml/.yml file."
        )
    text = _read_text(path)
    try:
        if suffix in (".yaml", ".yml"):
            return _yaml(text, where)
        if suffix == ".json":
            return json.loads(text, object_pairs_hook=lambda kv: _no_duplicates(kv, where))
        return tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        raise ShardingError(f"{where} could not be parsed: {' '.join(str(e).split())[:400]}") from None
    except RecursionError:
        raise ShardingError(f"{where} is nested too deeply to be a rules table. Fix: the "
                            "path of the rules file itself") from None


def file_value(v: Any, logical: Any = "") -> Any:
    """A value of the dict file format: "" replicates (TOML has no null). An array is
    refused: the pairs layout reads it as a product of mesh axes (as Flax and MaxText
    do), so the same array must not mean fallbacks one layout over."""
    if v == "":
        return None
    if isinstance(v, list):
        raise ShardingError(
            f"rule {short(logical)} -> {short(v)}: an array in a table of logical name to "
            "value is ambiguous (a product of mesh axes, or ordered fallbacks?). Fix: write "
            "the table as [logical, mesh] pairs, where an array is a product of mesh axes "
            "and a repeated name the next fallback, e.g. logical_axis_rules = "
            f"[[{short(logical)}, ['data', 'fsdp']], [{short(logical)}, 'data']]."
        )
    return v


def read_table(path: Any) -> tuple[str, Any, Any]:
    """What :meth:`Rules.from_file` builds a table from: the phrase naming the file, its
    table (a list of pairs or a dict of logical name to value) and its ``indivisible``."""
    if isinstance(path, bytes) or not isinstance(path, str | os.PathLike):
        raise ShardingError(
            f"Rules.from_file: path must be a str or os.PathLike, got "
            f"{type(path).__name__} {short(path, 60)}. Fix: e.g. "
            "Rules.from_file('rules.toml')."
        )
    text = os.fspath(path)
    if not isinstance(text, str) or not text:
        raise ShardingError(f"Rules.from_file: path {short(text, 60)} names no file. Fix: e.g. "
                            "Rules.from_file('rules.toml').")
    path = Path(text)
    where = f"rules file {short(str(path), 1000)}"
    data = _load(path)
    indivisible = None
    table: Any = data
    if isinstance(data, dict):
        indivisible = data.get("indivisible")
        keys = [k for k in ("logical_axis_rules", "rules") if k in data]
        if len(keys) == 2:
            raise ShardingError(
                f"{where} holds both 'logical_axis_rules' and 'rules'. Fix: keep one of them."
            )
        if keys:
            table = data[keys[0]]
        else:
            table = {k: v for k, v in data.items() if k != "indivisible"}
    if not isinstance(table, list | dict):
        raise ShardingError(
            f"{where} must hold a list of [logical, mesh] pairs or a table "
            f"of logical name to value, got {short(table)}. Fix: e.g. "
            "logical_axis_rules = [['batch', 'data'], ['mlp', 'model']]."
        )
    return where, table, indivisible
