"""Target layouts: which box each rank owns, and exact errors for bad layout files."""

from __future__ import annotations

import textwrap

import pytest

from dcpbridge.formats.layout import LayoutError, TargetBox, load_layout, parse_layout

MESH = {
    "mesh": {"pp": 2, "dp": 2, "tp": 2},
    "rules": [
        {"match": "*.qkv.weight", "split": {"axis": 0, "over": "tp"}},
        {"match": "layers.*", "split": [{"axis": 0, "over": "pp"}, {"axis": 1, "over": "tp"}]},
        {"match": ["emb", "out"], "split": {"axis": 0, "over": ["dp", "tp"]}},
        {"match": "norm", "replicate": True, "rank": 7},
    ],
}


def _boxes(layout, key, shape):
    return [(b.rank, b.offsets, b.sizes) for b in layout.boxes(key, shape)]


def test_parts_split_rank_r_owns_part_r_and_uneven_lengths():
    layout = parse_layout({"world_size": 4, "rules": [{"match": "*", "split": {"axis": 1}}]})
    assert _boxes(layout, "w", (3, 10)) == [
        (0, (0, 0), (3, 3)),
        (1, (0, 3), (3, 3)),
        (2, (0, 6), (3, 2)),
        (3, (0, 8), (3, 2)),
    ]
    # More parts than elements: empty boxes are not stored.
    assert _boxes(layout, "v", (0, 2)) == []
    assert [b[0] for b in _boxes(layout, "v", (1, 2))] == [0, 1]


def test_two_axis_parts_grid_is_row_major():
    layout = parse_layout(
        {
            "world_size": 4,
            "rules": [{"match": "*", "split": [{"axis": 1, "parts": 2}, {"axis": 0, "parts": 2}]}],
        }
    )
    got = {b.rank: (b.offsets, b.sizes) for b in layout.boxes("w", (4, 6))}
    # cell (i along axis 1, j along axis 0) -> rank 2i + j
    assert got == {
        0: ((0, 0), (2, 3)),
        1: ((2, 0), (2, 3)),
        2: ((0, 3), (2, 3)),
        3: ((2, 3), (2, 3)),
    }


def test_mesh_owners_use_coordinates_and_zero_on_unused_dims():
    layout = parse_layout(MESH)
    assert layout.world_size == 8
    # rank = pp * 4 + dp * 2 + tp; split over tp only -> owners have pp = dp = 0
    assert [b.rank for b in layout.boxes("a.qkv.weight", (8, 4))] == [0, 1]
    # pp x tp grid with a leading layer axis: owners (pp, 0, tp)
    assert _boxes(layout, "layers.fc1", (4, 6, 3)) == [
        (0, (0, 0, 0), (2, 3, 3)),
        (1, (0, 3, 0), (2, 3, 3)),
        (4, (2, 0, 0), (2, 3, 3)),
        (5, (2, 3, 0), (2, 3, 3)),
    ]
    # joint dp x tp split: part i -> (dp, tp) = divmod(i, 2), tp fastest
    assert [b.rank for b in layout.boxes("emb", (8, 2))] == [0, 1, 2, 3]
    assert _boxes(layout, "norm", (5,)) == [(7, (0,), (5,))]
    # no rule matches: replicated on rank 0 by default
    assert layout.boxes("other", (2, 2)) == [TargetBox(0, (0, 0), (2, 2))]
    assert layout.rule_for("x.qkv.weight") is layout.rules[0]  # first match wins


def test_layout_file_and_errors(tmp_path):
    good = tmp_path / "l.yaml"
    good.write_text("world_size: 2\nrules:\n  - match: '*'\n    split: {axis: -1}\n")
    layout = load_layout(good)
    assert _boxes(layout, "w", (2, 4)) == [(0, (0, 0), (2, 2)), (1, (0, 2), (2, 2))]
    with pytest.raises(
        LayoutError, match=r"rule for 'v' splits axis -1, but the tensor has shape \(\)"
    ):
        layout.boxes("v", ())

    cases = [
        ({"rules": []}, "missing 'world_size'"),
        ({"world_size": 2, "color": 1}, r"layout: unknown key\(s\) \['color'\]"),
        ({"world_size": "2"}, "world_size: expected an integer, got str"),
        ({"world_size": 4, "mesh": {"tp": 3}}, "mesh: sizes multiply to 3, not 4"),
        ({"world_size": 2, "rules": [{"split": {"axis": 0}}]}, r"rules\[0\]: missing 'match'"),
        ({"world_size": 2, "rules": [{"match": "*"}]}, r"rules\[0\]: give exactly one of"),
        (
            {"world_size": 2, "rules": [{"match": "*", "split": {"axis": 0, "over": "tp"}}]},
            r"rules\[0\].split\[0\].over: 'over' needs a 'mesh'",
        ),
        (
            {"mesh": {"tp": 2}, "rules": [{"match": "*", "split": {"axis": 0, "over": "pp"}}]},
            r"unknown mesh dimension\(s\) \['pp'\]",
        ),
        (
            {"world_size": 2, "rules": [{"match": "*", "split": {"axis": 0, "parts": 3}}]},
            "3 parts need more than world_size 2",
        ),
        (
            {"world_size": 2, "rules": [{"match": "*", "replicate": True, "rank": 2}]},
            r"rules\[0\].rank: 2 is not a rank of world_size 2",
        ),
        (
            {"world_size": 2, "rules": [{"match": "*", "split": {"axis": 0, "dim": 1}}]},
            r"rules\[0\].split\[0\]: unknown key\(s\) \['dim'\]",
        ),
        ({"world_size": 2, "default": "drop"}, "default: expected 'replicate' or 'error'"),
    ]
    for doc, message in cases:
        with pytest.raises(LayoutError, match=message):
            parse_layout(doc, "my.yaml")
    strict = parse_layout({"world_size": 1, "default": "error"}, "strict.yaml")
    with pytest.raises(LayoutError, match=r"strict\.yaml: no rule matches tensor 'w'"):
        strict.boxes("w", (1,))
    with pytest.raises(LayoutError, match="cannot read layout file"):
        load_layout(tmp_path / "missing.yaml")


def test_the_documented_examples_parse(tmp_path):
    """The YAML examples in the module docs (shown by ``--help``) are valid as written."""
    import yaml

    from dcpbridge.formats import config as config_mod
    from dcpbridge.formats import layout as layout_mod
    from dcpbridge.formats.config import parse_config

    def example(module) -> str:
        doc = module.__doc__
        return textwrap.dedent(doc[doc.index("\n\n    ") :])

    layout = parse_layout(yaml.safe_load(example(layout_mod)))
    assert layout.world_size == 8 and dict(layout.mesh) == {"pp": 2, "tp": 4}
    assert [b.rank for b in layout.boxes("decoder.layers.fc1", (4, 8))] == [0, 1, 2, 3, 4, 5, 6, 7]
    (tmp_path / "layouts").mkdir()
    (tmp_path / "layouts" / "tp4.yaml").write_text("world_size: 4\n")
    cfg = parse_config(yaml.safe_load(example(config_mod)), "doc", str(tmp_path))
    assert cfg.profiles["minio"].multipart_part_size == 64 << 20
    assert cfg.jobs["to-tp4"].layout.world_size == 4
