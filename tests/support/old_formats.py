"""Rewrite a checkpoint's commit file as an older dcpbridge wrote it (test helper)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from dcpbridge.storage.format import checksum
from dcpbridge.storage.format import document as fmt


def rewrite_as(path: str | Path, version: int) -> None:
    """Commit file of ``path`` as format ``version`` (1: rows without digest, 2: rows, 3:
    packed columns), with the flat checksum blocks those versions record."""
    meta = Path(path) / fmt.METADATA_FILE
    md = fmt.decode_metadata(meta.read_bytes(), where=str(path))
    index = md.storage_data
    block = index.checksum_block_size
    items = {}
    for key, stored in index.items.items():
        if stored.checksums is not None:
            with open(Path(path) / stored.file, "rb") as f:
                f.seek(stored.offset)
                data = memoryview(f.read(stored.nbytes))
            sums = tuple(checksum.digests(checksum.flat_grid(len(data), block), data))
            stored = dataclasses.replace(stored, checksums=sums)
        items[key] = stored
    md.storage_data = dataclasses.replace(index, items=items, tiled_checksums=False)
    rows_limit = fmt.ROWS_AS_OBJECTS
    fmt.ROWS_AS_OBJECTS = -1 if version == 3 else 1 << 40
    try:
        raw = fmt.encode_metadata(md)
    finally:
        fmt.ROWS_AS_OBJECTS = rows_limit
    if version == 1:
        doc = json.loads(raw)
        del doc["digest"]
        doc["version"] = 1
        raw = json.dumps(doc, separators=(",", ":")).encode()
    assert json.loads(raw)["version"] == version
    meta.write_bytes(raw)
