"""The files of a tokenizer folder, read as :class:`~nnx_shard.inference.Tokenizer`
reads them: each through one descriptor opened without following a link out of the
folder (its text reaches every prompt), decoded as UTF-8, JSON checked at the top.

>>> import tempfile
>>> d = tempfile.mkdtemp()
>>> read_json(os.path.join(d, "tokenizer_config.json"), d) is None   # no such file
True
"""

from __future__ import annotations

import json
import os
from typing import Any

from nnx_shard._errors import LinkedOut, NotAFile, UsageError, path_kind, short
from nnx_shard._trusted_files import read_within

__all__ = ["FILES", "as_text", "folder_root", "json_type", "load_file", "read_json"]

#: The JSON files a tokenizer folder holds beside ``tokenizer.json``, and what each must
#: be at the top.
FILES = {"tokenizer_config.json": dict, "special_tokens_map.json": dict,
         "generation_config.json": dict}


def folder_root(folder: str) -> str:
    """The folder whose inside a tokenizer file may link to: the nearest
    ``models--*`` ancestor (a huggingface_hub cache repo, whose snapshots link to
    its ``blobs``), else the folder itself."""
    real = os.path.realpath(folder)
    for p in (real, *_parents(real)):
        if os.path.basename(p).startswith("models--"):
            return p
    return real


def _parents(path: str) -> list[str]:
    out = []
    while (up := os.path.dirname(path)) != path:
        out.append(up)
        path = up
    return out


def _linked_out(path: str, folder: str, target: str) -> UsageError:
    link = os.readlink(path) if os.path.islink(path) else target
    return UsageError(f"{path}: is a link to {short(link, 200)} ({short(target, 200)}), "
                      f"outside the tokenizer's folder {folder_root(folder)}; its text would be read "
                      "into every prompt. Fix: copy the file into the folder (or download the "
                      "tokenizer's files again) instead of linking out.")


def load_file(path: str, folder: str) -> bytes | None:
    """The bytes of the folder's file ``path``, ``None`` where there is none. A link is
    followed only inside the folder (see :func:`folder_root`), since a template or config
    read from it is sent to the model in every prompt; the file is read through the
    one descriptor that was checked (a file swapped for a link out in between is
    refused), and a device, pipe or folder in its place is refused."""
    if not os.path.lexists(path):
        return None
    try:
        return read_within(path, [folder_root(folder)])
    except LinkedOut as e:
        raise _linked_out(path, folder, e.target) from None
    except (NotAFile, FileNotFoundError) as e:  # the latter: a link to nothing
        kind = e.kind if isinstance(e, NotAFile) else path_kind(path) or "gone"
        raise UsageError(f"{path}: is {kind}, not a file. Fix: put the file there, or "
                         "remove what is in its place.") from None


def as_text(path: str, data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{path}: is not UTF-8 text (byte {e.start}: {data[e.start:e.start + 4]!r})."
                         " Fix: save it as UTF-8, or download the tokenizer's files again.") from None


def read_json(path: str, folder: str) -> Any:
    """The JSON file at ``path``, or ``None`` where there is none; a file whose top
    is not what the folder's file of that name holds (an object) is refused."""
    data = load_file(path, folder)
    if data is None:
        return None
    text = as_text(path, data)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"{path}: is not a JSON file ({e}). Fix: download the tokenizer's "
                         "files again.") from None
    except RecursionError:
        raise UsageError(f"{path}: nests too deep to read (JSON). Fix: download the "
                         "tokenizer's files again.") from None
    kind = FILES.get(os.path.basename(path))
    if kind is not None and not isinstance(value, kind):
        raise UsageError(f"{path}: holds a JSON {json_type(value)}, not an object "
                         f"({{...}}). Fix: download the tokenizer's files again.")
    return value


def json_type(value: Any) -> str:
    for kind, name in ((bool, "boolean"), (str, "string"), (int, "number"), (float, "number"),
                       (list, "list"), (dict, "object")):
        if isinstance(value, kind):
            return f"{name} {short(value, 40)}"
    return "null"
