"""The YAML configuration: strict validation, profiles -> storage options, no leaked secrets."""

from __future__ import annotations

import logging
import textwrap

import fsspec
import pytest
import torch

import dcpbridge as db
from dcpbridge.formats.config import (
    ConfigError,
    StorageOptions,
    config_path,
    load_config,
    parse_size,
    resolve_storage_options,
    storage_options,
)
from dcpbridge.formats.schema import read_yaml

SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYzEXAMPLEKEY"

GOOD = """
profiles:
  minio:
    type: s3
    endpoint_url: http://127.0.0.1:9000
    region: eu-west-1
    access_key_env: TEST_DCPB_KEY
    secret_key_env: TEST_DCPB_SECRET
    multipart_part_size: 16MiB
    concurrency: 4
    options: {config_kwargs: {retries: {max_attempts: 2}}}
  mem:
    type: fsspec
    options: {}
checkpoint:
  every: 50
  keep_last: 3
  async: false
  fully_parallel: true
  threads: 3
  checksums: false
  profile: minio
jobs:
  tp2:
    source: memory://a
    destination: /tmp/b
    source_profile: mem
    layout:
      world_size: 2
      rules: [{match: "*", split: {axis: 0}}]
  from-file:
    source: s3://bucket/ckpt
    destination: memory://out
    profile: minio
    layout: layouts/tp4.yaml
"""


def _write(tmp_path, text: str, name: str = "config.yaml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_full_config_parses_and_builds_s3_options(tmp_path, monkeypatch):
    (tmp_path / "layouts").mkdir()
    (tmp_path / "layouts" / "tp4.yaml").write_text("world_size: 4\n")
    cfg = load_config(_write(tmp_path, GOOD))
    assert not cfg.checkpoint.async_save and cfg.checkpoint.threads == 3
    assert not cfg.checkpoint.checksums and cfg.checkpoint.fully_parallel
    assert (cfg.checkpoint.every, cfg.checkpoint.keep_last, cfg.checkpoint.keep_every) == (
        50,
        3,
        None,
    )
    assert cfg.jobs["tp2"].layout.world_size == 2
    assert cfg.jobs["tp2"].source_profile == "mem" and cfg.jobs["tp2"].destination_profile is None
    assert cfg.jobs["from-file"].layout.world_size == 4  # path relative to the config file
    assert cfg.jobs["from-file"].destination_profile == "minio"

    monkeypatch.setenv("TEST_DCPB_KEY", "AKIDEXAMPLE")
    monkeypatch.setenv("TEST_DCPB_SECRET", SECRET)
    opts = storage_options(cfg.profile("minio"))
    assert dict(opts) == {
        "config_kwargs": {"retries": {"max_attempts": 2}},
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000", "region_name": "eu-west-1"},
        "key": "AKIDEXAMPLE",
        "secret": SECRET,
        "default_block_size": 16 << 20,
        "max_concurrency": 4,
    }
    assert SECRET not in repr(opts) and SECRET not in str(opts) and "***" in repr(opts)
    assert SECRET not in f"{opts}" and SECRET not in repr([opts])
    # explicit options win over the profile's
    merged = resolve_storage_options({"max_concurrency": 1}, "minio", cfg)
    assert merged["max_concurrency"] == 1 and merged["secret"] == SECRET
    assert resolve_storage_options({"a": 1}, None, cfg) == {"a": 1}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("profiles: {p: {type: s3, color: red}}", r"profiles\.p: unknown key\(s\) \['color'\]"),
        ("checkpoint: {threads: two}", "checkpoint.threads: expected int, got str"),
        ("checkpoint: {async: 1}", "checkpoint.async: expected bool, got int"),
        ("checkpoint: {every: 0}", r"checkpoint\.every: must be >= 1"),
        ("checkpoint: {keep_last: 1.5}", "checkpoint.keep_last: expected int, got float"),
        ("checkpoint: {profile: nope}", "checkpoint.profile: no storage profile 'nope'"),
        ("profiles: {p: {concurrency: 0}}", r"profiles\.p\.concurrency: must be >= 1"),
        ("profiles: {p: {multipart_part_size: 1MiB}}", "at least 5 MiB"),
        ("profiles: {p: {multipart_part_size: lots}}", "expected a size"),
        ("profiles: {p: {type: ftp}}", r"profiles\.p\.type: expected 's3' or 'fsspec'"),
        ("jobs: {j: {source: a, destination: b}}", r"jobs\.j\.layout: expected a layout"),
        (
            "jobs: {j: {source: a, layout: {world_size: 1}}}",
            r"jobs\.j\.destination: is required",
        ),
        (
            "jobs: {j: {source: a, destination: b, layout: {world_size: 0}}}",
            r"jobs\.j\.layout: world_size: must be >= 1",
        ),
        ("plugins: []", r"unknown key\(s\) \['plugins'\]"),
        ("profiles: [a, b]", "profiles: expected a mapping, got list"),
    ],
)
def test_unknown_keys_and_wrong_types_name_the_file_and_key(tmp_path, text, message):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError, match=message) as info:
        load_config(path)
    assert str(info.value).startswith(path + ": ")


def test_secrets_never_reach_errors_or_logs(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    # A credential written into the file is refused without echoing it.
    path = _write(tmp_path, f"profiles: {{p: {{options: {{secret: '{SECRET}'}}}}}}")
    with pytest.raises(ConfigError, match="credentials may not be written") as info:
        load_config(path)
    assert SECRET not in str(info.value)
    # ... also where an environment variable NAME is expected.
    path = _write(tmp_path, f"profiles: {{p: {{secret_key_env: '{SECRET}'}}}}")
    with pytest.raises(ConfigError, match="must be the NAME of an environment variable") as info:
        load_config(path)
    assert SECRET not in str(info.value)
    # A missing variable is named, its would-be value is not known anyway.
    path = _write(
        tmp_path,
        """
        profiles:
          p:
            endpoint_url: http://127.0.0.1:9
            access_key_env: K_UNSET
            secret_key_env: S_SET
            options: {config_kwargs: {retries: {max_attempts: 1}, connect_timeout: 1}}
        """,
    )
    monkeypatch.setenv("S_SET", SECRET)
    monkeypatch.delenv("K_UNSET", raising=False)
    with pytest.raises(ConfigError, match="environment variable K_UNSET, which is not set") as info:
        storage_options(load_config(path).profile("p"))
    assert SECRET not in str(info.value)
    # A failing S3 request with credentials (to a closed local port, never AWS): neither the
    # error nor the logs carry the secret.
    monkeypatch.setenv("K_UNSET", "AKIDEXAMPLE")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    opts = storage_options(load_config(path).profile("p"))
    logging.getLogger("test").info("options: %s", opts)
    with pytest.raises(Exception, match=r"127\.0\.0\.1:9") as info:
        db.load_tensors_metadata("s3://no-bucket/ck", storage_options=opts)
    assert SECRET not in str(info.value)
    assert SECRET not in caplog.text


def test_config_file_lookup_order(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("DCPBRIDGE_CONFIG", raising=False)
    assert config_path() is None and load_config().profiles == {}
    default = tmp_path / ".config" / "dcpbridge" / "config.yaml"
    default.parent.mkdir(parents=True)
    default.write_text("checkpoint: {threads: 5}\n")
    assert load_config().checkpoint.threads == 5
    env = _write(tmp_path, "checkpoint: {threads: 6}\n", "env.yaml")
    monkeypatch.setenv("DCPBRIDGE_CONFIG", env)
    assert load_config().checkpoint.threads == 6
    explicit = _write(tmp_path, "checkpoint: {threads: 7}\n", "explicit.yaml")
    assert load_config(explicit).checkpoint.threads == 7
    with pytest.raises(ConfigError, match=r"cannot read configuration file .*missing\.yaml"):
        load_config(str(tmp_path / "missing.yaml"))
    with pytest.raises(ConfigError, match="no storage profile 'x'"):
        load_config().profile("x")


def test_api_accepts_a_profile_by_name(tmp_path, monkeypatch):
    """A ``fsspec`` profile's options reach the filesystem: memory:// with a custom root."""
    cfg = _write(tmp_path, "profiles: {mem: {type: fsspec, options: {skip_instance_cache: true}}}")
    monkeypatch.setenv("DCPBRIDGE_CONFIG", cfg)
    url = "memory://cfg-profile/ck"
    try:
        w = torch.arange(6.0)
        db.save({"w": db.ShardedTensor.from_box("w", w, (6,), (0,))}, url, profile="mem")
        assert db.load_tensors_metadata(url, profile="mem")["w"].global_shape == (6,)
        out = db.load(
            {"w": db.ShardedTensor.from_box("w", torch.zeros(6), (6,), (0,))}, url, profile="mem"
        )
        assert torch.equal(out["w"], w)
        assert db.load_common_state_dict(url, profile="mem") == {}
        with pytest.raises(ConfigError, match="no storage profile 'other'"):
            db.load_tensors_metadata(url, profile="other")
    finally:
        fsspec.filesystem("memory").rm("/cfg-profile", recursive=True)


def test_sizes():
    assert parse_size("64MiB", "x") == 64 << 20 and parse_size("5GB", "x") == 5 * 10**9
    assert parse_size(123, "x") == 123 and parse_size("7", "x") == 7
    with pytest.raises(ConfigError, match="expected a size"):
        parse_size("5 parsecs", "x")
    assert isinstance(StorageOptions(a=1), dict)


def test_an_environment_variable_name_with_a_trailing_newline_is_refused(tmp_path):
    """``access_key_env: "KEY\\n"`` is not the name of an environment variable (the pattern
    ended in ``$``, which matches before a trailing newline, so it passed)."""
    path = _write(tmp_path, 'profiles: {p: {access_key_env: "TEST_DCPB_KEY\\n"}}')
    with pytest.raises(ConfigError, match="must be the NAME of an environment variable"):
        load_config(path)


@pytest.mark.parametrize(
    "text",
    [
        "checkpoint: {every: 100}\ncheckpoint: {every: 1}\n",
        "checkpoint:\n  keep_last: 3\n  every: 100\n  keep_last: 30\n",
    ],
)
def test_a_key_given_twice_is_refused_not_the_last_taken(tmp_path, text):
    """YAML's safe loader kept the last of two equal keys, silently."""
    path = _write(tmp_path, text)
    with pytest.raises(
        ConfigError, match=r"(?s)not valid YAML: .*found the key '\w+' twice"
    ) as info:
        load_config(path)
    assert str(info.value).startswith(path + ": ")


def test_a_merged_key_may_still_be_overridden(tmp_path):
    text = "base: &b {every: 100, keep_last: 3}\ncheckpoint:\n  <<: *b\n  every: 5\n"
    doc = read_yaml(_write(tmp_path, text), "configuration file", ConfigError)
    assert doc["checkpoint"] == {"every": 5, "keep_last": 3}
