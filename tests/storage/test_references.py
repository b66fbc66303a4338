"""References to a sibling checkpoint's files (incremental saves) are hostile input: only
``../<dir>/[<pXXX>/]<data file>`` inside the same storage root is accepted, only in format 5."""

from __future__ import annotations

import json

import pytest
import torch

import dcpbridge as db
from dcpbridge.storage.errors import UnsafePathError
from dcpbridge.storage.format import rows_document, sign_document
from dcpbridge.storage.format.document import decode_metadata
from dcpbridge.storage.format.references import check_reference, reference_path, reference_to

GOOD = ["../step_1/__0_0.ab12.bin", "../a.b-c/p0f/__3_1.ff.bin"]
BAD = [
    "../../x/__0_0.ab12.bin",  # beyond the root
    "../a/../b/__0_0.ab12.bin",
    "../../__0_0.ab12.bin",
    "/abs/__0_0.ab12.bin",
    "s3://bucket/run/__0_0.ab12.bin",
    "../s3:/b/__0_0.ab12.bin",
    "../a/b/__0_0.ab12.bin",  # a folder that is not a spread folder
    "../a/__0_0.ab12.bin/x",
    "../../a/__0_0.ab12.bin",
    "../.hidden/__0_0.ab12.bin",
    "../a/dcpbridge.json",
    "..\\a\\__0_0.ab12.bin",
    "../a/__0_0.AB.bin",
    "../step_1/__0_0.ab12.bin\n",  # ``$`` matched before a trailing newline
]


@pytest.mark.parametrize("name", GOOD)
def test_a_sibling_reference_resolves_inside_the_parent(name):
    check_reference(name)
    assert reference_path("/data/run/step_2", name) == "/data/run/" + name[3:]
    assert reference_to("step_1", name, None) == name  # a reference stays as it is: no chains


@pytest.mark.parametrize("name", BAD)
def test_references_that_could_escape_the_root_are_refused(name):
    with pytest.raises(UnsafePathError):
        check_reference(name)


def _incremental_pair(tmp_path) -> tuple[str, dict]:
    base, ad = torch.arange(64.0).reshape(8, 8), torch.ones(2, 8)
    db.save({"base": base, "ad": ad}, tmp_path / "s1")
    db.save({"base": base, "ad": ad + 1}, tmp_path / "s2", reuse_from=tmp_path / "s1")
    raw = (tmp_path / "s2" / "dcpbridge.json").read_bytes()
    return str(tmp_path / "s2"), rows_document(raw)


@pytest.mark.parametrize("name", BAD[:6])
def test_a_document_naming_an_escaping_reference_is_refused(tmp_path, name):
    where, doc = _incremental_pair(tmp_path)
    assert doc["version"] == 5
    ref = next(f for f in doc["files"] if f.startswith("../"))
    doc = json.loads(json.dumps(doc).replace(json.dumps(ref), json.dumps(name)))
    with pytest.raises(db.CheckpointError, match="refusing"):
        decode_metadata(sign_document(doc), where=where)


def test_a_reference_in_a_version_4_document_is_refused(tmp_path):
    where, doc = _incremental_pair(tmp_path)
    doc["version"] = 4
    with pytest.raises(UnsafePathError, match="plain names"):
        decode_metadata(sign_document(doc), where=where)


@pytest.mark.parametrize("field", ["reference", "file", "save_id"])
def test_a_document_name_with_a_trailing_newline_is_refused(tmp_path, field):
    """A reference, an own data file or a save id ending in a newline is refused: the
    patterns ended in ``$``, which also matches before a trailing newline, so such names
    passed validation."""
    where, doc = _incremental_pair(tmp_path)
    if field == "save_id":
        doc["save_id"] += "\n"
        match = "save_id must be lowercase hex"
    else:
        name = next(f for f in doc["files"] if f.startswith("../") == (field == "reference"))
        doc = json.loads(json.dumps(doc).replace(json.dumps(name), json.dumps(name + "\n")))
        match = "refusing"
    with pytest.raises(db.CheckpointError, match=match):
        decode_metadata(sign_document(doc), where=where)
