"""The dcpbridge YAML configuration: storage profiles, checkpoint defaults and reshard jobs.

Found at ``--config``, else ``$DCPBRIDGE_CONFIG``, else ``~/.config/dcpbridge/config.yaml``.
Credentials are never written in the file: a profile names the environment variables that
hold them. Unknown keys and wrong types are errors naming the file and the key; error
messages and logs never contain credential values.

    profiles:
      minio:
        type: s3                        # s3 | fsspec (any other fsspec URL: options only)
        endpoint_url: http://127.0.0.1:9000
        region: us-east-1
        access_key_env: MINIO_ACCESS_KEY
        secret_key_env: MINIO_SECRET_KEY
        session_token_env: null         # optional
        multipart_part_size: 64MiB      # s3fs block size of multipart uploads
        concurrency: 8                  # s3fs max_concurrency per file
        options: {}                     # extra, non-secret fsspec options
    checkpoint:                         # defaults, read by load_config().checkpoint
      async: false                      # training code: save in the background
      fully_parallel: true              # training code: spread replicated shards' writes
      threads: 2                        # writer threads (data files) per rank
      checksums: true                   # record checksums (the CLI's default too)
      profile: null                     # profile for URLs when none is named (CLI too)
    jobs:
      to-tp4:                           # dcpbridge reshard --config FILE --job to-tp4
        source: s3://bucket/ckpt/iter_1000
        destination: /data/ckpt_tp4
        source_profile: minio           # or profile: for both sides
        layout: layouts/tp4.yaml        # a path (relative to this file) or an inline mapping
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dcpbridge.errors import CheckpointError
from dcpbridge.tools.layout import Layout, LayoutError, load_layout, parse_layout, read_yaml

log = logging.getLogger(__name__)

ENV_VAR = "DCPBRIDGE_CONFIG"
DEFAULT_PATH = os.path.join("~", ".config", "dcpbridge", "config.yaml")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SIZE = re.compile(r"^\s*(\d+)\s*([A-Za-z]*)\s*$")
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}
_SECRET_OPTIONS = frozenset(
    {"key", "secret", "token", "password", "access_key", "secret_key", "session_token"}
)
_SECRET_FIELDS = ("key", "secret", "token", "password")


class ConfigError(CheckpointError, ValueError):
    """The configuration file is malformed or refers to something that does not exist."""


@dataclass(kw_only=True, slots=True, frozen=True)
class StorageProfile:
    """How to reach one storage system; credentials come from named environment variables."""

    name: str
    type: str = "s3"
    """``s3`` or ``fsspec`` (options passed through to any fsspec filesystem)."""
    endpoint_url: str | None = None
    """S3 endpoint (e.g. a MinIO or SeaweedFS server); None means AWS."""
    region: str | None = None
    """S3 region name."""
    access_key_env: str | None = None
    """Environment variable holding the access key id."""
    secret_key_env: str | None = None
    """Environment variable holding the secret access key."""
    session_token_env: str | None = None
    """Environment variable holding a session token (optional)."""
    multipart_part_size: int | None = None
    """Bytes per multipart upload part (s3fs ``default_block_size``)."""
    concurrency: int | None = None
    """Parallel part transfers per file (s3fs ``max_concurrency``)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Further non-secret fsspec storage options."""
    source: str = "<config>"


@dataclass(kw_only=True, slots=True, frozen=True)
class CheckpointDefaults:
    """Checkpoint settings the CLI applies unless told otherwise."""

    async_save: bool = False
    """Save in the background (``async`` in the file)."""
    fully_parallel: bool = True
    """Spread the writing of replicated shards over their holders."""
    threads: int = 2
    """Writer threads (data files) per rank."""
    checksums: bool = True
    """Record and verify block checksums."""
    profile: str | None = None
    """Storage profile used when a command names none."""


@dataclass(kw_only=True, slots=True, frozen=True)
class ReshardJob:
    """One offline reshard: source, destination, target layout and their storage profiles."""

    name: str
    source: str
    destination: str
    layout: Layout
    source_profile: str | None = None
    destination_profile: str | None = None


@dataclass(kw_only=True, slots=True, frozen=True)
class Config:
    """A parsed configuration file (or the empty default when there is none)."""

    path: str | None = None
    profiles: dict[str, StorageProfile] = field(default_factory=dict)
    checkpoint: CheckpointDefaults = field(default_factory=CheckpointDefaults)
    jobs: dict[str, ReshardJob] = field(default_factory=dict)

    def profile(self, name: str) -> StorageProfile:
        try:
            return self.profiles[name]
        except KeyError:
            known = ", ".join(sorted(self.profiles)) or "none"
            where = self.path or "no configuration file"
            raise ConfigError(f"{where}: no storage profile {name!r} (profiles: {known})") from None

    def job(self, name: str | None) -> ReshardJob:
        if name is None and len(self.jobs) == 1:
            return next(iter(self.jobs.values()))
        if name is not None and name in self.jobs:
            return self.jobs[name]
        known = ", ".join(sorted(self.jobs)) or "none"
        if name is None:
            raise ConfigError(f"{self.path}: name the job to run with --job (jobs: {known})")
        raise ConfigError(f"{self.path}: no job {name!r} (jobs: {known})")


class StorageOptions(dict):
    """fsspec storage options whose ``repr`` hides credentials (safe to log)."""

    def __repr__(self) -> str:
        shown = {k: ("***" if k in _SECRET_FIELDS else v) for k, v in self.items()}
        return f"StorageOptions({shown!r})"

    __str__ = __repr__


# -- parsing ---------------------------------------------------------------------------------


class _Doc:
    """Typed access to one mapping of the file; every error names the file and key path."""

    def __init__(self, doc: Any, where: str, path: str) -> None:
        if doc is None:
            doc = {}
        if not isinstance(doc, Mapping):
            raise self._error(where, path, f"expected a mapping, got {type(doc).__name__}")
        self.doc, self.where, self.path = doc, where, path

    @staticmethod
    def _error(where: str, path: str, message: str) -> ConfigError:
        return ConfigError(f"{where}: {path}: {message}" if path else f"{where}: {message}")

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def error(self, name: str, message: str) -> ConfigError:
        return self._error(self.where, self.key(name), message)

    def only(self, allowed: set[str]) -> None:
        unknown = sorted(str(k) for k in self.doc if k not in allowed)
        if unknown:
            raise self._error(
                self.where,
                self.path,
                f"unknown key(s) {unknown}; allowed: {', '.join(sorted(allowed))}",
            )

    def get(self, name: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
        value = self.doc.get(name, default)
        if value is None:
            return default
        ok = isinstance(value, kind) and not (isinstance(value, bool) and bool not in _tuple(kind))
        if not ok:
            want = " or ".join(t.__name__ for t in _tuple(kind))
            raise self.error(name, f"expected {want}, got {type(value).__name__}")
        return value

    def required(self, name: str, kind: type) -> Any:
        if self.doc.get(name) is None:
            raise self.error(name, "is required")
        return self.get(name, kind)

    def sub(self, name: str) -> _Doc:
        return _Doc(self.doc.get(name), self.where, self.key(name))


def _tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def parse_size(value: int | str, what: str) -> int:
    """Bytes from an int or a string such as ``64MiB`` (binary) or ``5GB`` (decimal)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    m = _SIZE.match(str(value))
    unit = m.group(2).upper() if m else ""
    if not m or unit not in _UNITS:
        raise ConfigError(f"{what}: expected a size such as 67108864, '64MiB' or '5GB'")
    return int(m.group(1)) * _UNITS[unit]


def _env_name(d: _Doc, name: str) -> str | None:
    value = d.get(name, str)
    if value is not None and not _ENV_NAME.match(value):
        raise d.error(name, "must be the NAME of an environment variable, not a credential")
    return value


def _profile(name: str, d: _Doc) -> StorageProfile:
    d.only(
        {
            "type",
            "endpoint_url",
            "region",
            "access_key_env",
            "secret_key_env",
            "session_token_env",
            "multipart_part_size",
            "concurrency",
            "options",
        }
    )
    kind = d.get("type", str, "s3")
    if kind not in ("s3", "fsspec"):
        raise d.error("type", f"expected 's3' or 'fsspec', got {kind!r}")
    options = dict(d.sub("options").doc)
    secret = sorted(k for k in options if str(k).lower() in _SECRET_OPTIONS)
    if secret:
        raise d.error(
            "options",
            f"credentials may not be written in the file ({secret}); put them in environment "
            "variables and name those with access_key_env / secret_key_env / session_token_env",
        )
    part = d.get("multipart_part_size", (int, str))
    part_size = parse_size(part, f"{d.where}: {d.key('multipart_part_size')}") if part else None
    if part_size is not None and part_size < 5 << 20:
        raise d.error("multipart_part_size", "S3 multipart parts must be at least 5 MiB")
    concurrency = d.get("concurrency", int)
    if concurrency is not None and concurrency < 1:
        raise d.error("concurrency", "must be >= 1")
    return StorageProfile(
        name=name,
        type=kind,
        endpoint_url=d.get("endpoint_url", str),
        region=d.get("region", str),
        access_key_env=_env_name(d, "access_key_env"),
        secret_key_env=_env_name(d, "secret_key_env"),
        session_token_env=_env_name(d, "session_token_env"),
        multipart_part_size=part_size,
        concurrency=concurrency,
        options=options,
        source=d.where,
    )


def _checkpoint(d: _Doc) -> CheckpointDefaults:
    d.only({"async", "fully_parallel", "threads", "checksums", "profile"})
    threads = d.get("threads", int, 2)
    if threads < 1:
        raise d.error("threads", "must be >= 1")
    return CheckpointDefaults(
        async_save=d.get("async", bool, False),
        fully_parallel=d.get("fully_parallel", bool, True),
        threads=threads,
        checksums=d.get("checksums", bool, True),
        profile=d.get("profile", str),
    )


def _job(name: str, d: _Doc, base_dir: str) -> ReshardJob:
    d.only({"source", "destination", "layout", "profile", "source_profile", "destination_profile"})
    layout_doc = d.doc.get("layout")
    try:
        if isinstance(layout_doc, str):
            layout = load_layout(os.path.join(base_dir, os.path.expanduser(layout_doc)))
        elif isinstance(layout_doc, Mapping):
            layout = parse_layout(layout_doc, f"{d.where}: {d.key('layout')}")
        else:
            raise d.error("layout", "expected a layout file path or an inline layout mapping")
    except LayoutError as e:
        raise ConfigError(str(e)) from None
    both = d.get("profile", str)
    return ReshardJob(
        name=name,
        source=d.required("source", str),
        destination=d.required("destination", str),
        layout=layout,
        source_profile=d.get("source_profile", str, both),
        destination_profile=d.get("destination_profile", str, both),
    )


def parse_config(doc: Any, where: str = "<config>", base_dir: str = ".") -> Config:
    """Validate a configuration mapping (as read from YAML)."""
    root = _Doc(doc, where, "")
    root.only({"profiles", "checkpoint", "jobs"})
    profiles_doc = root.sub("profiles")
    profiles = {str(k): _profile(str(k), profiles_doc.sub(str(k))) for k in profiles_doc.doc}
    checkpoint = _checkpoint(root.sub("checkpoint"))
    jobs_doc = root.sub("jobs")
    jobs = {str(k): _job(str(k), jobs_doc.sub(str(k)), base_dir) for k in jobs_doc.doc}
    config = Config(path=where, profiles=profiles, checkpoint=checkpoint, jobs=jobs)
    named = [("checkpoint.profile", checkpoint.profile)] + [
        (f"jobs.{j.name}.{side}", getattr(j, side))
        for j in jobs.values()
        for side in ("source_profile", "destination_profile")
    ]
    for key, profile in named:
        if profile is not None and profile not in profiles:
            raise ConfigError(f"{where}: {key}: no storage profile {profile!r} in this file")
    return config


def config_path(explicit: str | os.PathLike[str] | None = None) -> str | None:
    """The configuration file in effect: explicit, ``$DCPBRIDGE_CONFIG``, or the default if present."""
    if explicit is not None:
        return os.fspath(explicit)
    env = os.environ.get(ENV_VAR)
    if env:
        return env
    default = os.path.expanduser(DEFAULT_PATH)
    return default if os.path.exists(default) else None


def load_config(path: str | os.PathLike[str] | None = None) -> Config:
    """Read and validate the configuration file in effect (an empty Config if there is none)."""
    where = config_path(path)
    if where is None:
        return Config()
    doc = read_yaml(where, "configuration file", ConfigError)
    log.debug("dcpbridge configuration from %s", where)
    return parse_config(doc, where, os.path.dirname(os.path.abspath(where)))


def _credential(profile: StorageProfile, attr: str) -> str | None:
    env = getattr(profile, attr)
    if env is None:
        return None
    value = os.environ.get(env)
    if not value:
        raise ConfigError(
            f"{profile.source}: profile {profile.name!r} reads {attr} from environment variable "
            f"{env}, which is not set"
        )
    return value


def storage_options(profile: StorageProfile) -> StorageOptions:
    """fsspec ``storage_options`` for ``profile`` (credentials read from the environment now)."""
    opts = StorageOptions(profile.options)
    if profile.type != "s3":
        return opts
    client_kwargs = dict(opts.get("client_kwargs") or {})
    if profile.endpoint_url is not None:
        client_kwargs["endpoint_url"] = profile.endpoint_url
    if profile.region is not None:
        client_kwargs["region_name"] = profile.region
    if client_kwargs:
        opts["client_kwargs"] = client_kwargs
    for option, attr in (
        ("key", "access_key_env"),
        ("secret", "secret_key_env"),
        ("token", "session_token_env"),
    ):
        value = _credential(profile, attr)
        if value is not None:
            opts[option] = value
    if profile.multipart_part_size is not None:
        opts["default_block_size"] = profile.multipart_part_size
    if profile.concurrency is not None:
        opts["max_concurrency"] = profile.concurrency
    return opts


def resolve_storage_options(
    storage_options_: dict[str, Any] | None,
    profile: str | None,
    config: Config | None = None,
) -> dict[str, Any] | None:
    """Explicit options on top of those of ``profile`` (read from the configuration in effect)."""
    if profile is None:
        return storage_options_
    cfg = config if config is not None else load_config()
    opts = storage_options(cfg.profile(profile))
    opts.update(storage_options_ or {})
    return opts
