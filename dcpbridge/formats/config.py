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
    checkpoint:                         # defaults of CheckpointManager and the CLI
      every: 1                          # CheckpointManager: save every N steps
      keep_last: null                   # CheckpointManager: keep the newest N (null: all)
      keep_every: null                  # CheckpointManager: also keep multiples of N
      async: true                       # CheckpointManager: save in the background
      fully_parallel: false             # CheckpointManager: spread replicated shards' writes
      threads: 2                        # writer threads (data files) per rank (manager, CLI)
      checksums: true                   # record checksums (manager, CLI)
      profile: null                     # profile for URLs when none is named (API and CLI)
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
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dcpbridge.errors import CheckpointError
from dcpbridge.formats.layout import Layout, LayoutError, load_layout, parse_layout
from dcpbridge.formats.schema import Doc, read_yaml

log = logging.getLogger(__name__)

ENV_VAR = "DCPBRIDGE_CONFIG"
DEFAULT_PATH = os.path.join("~", ".config", "dcpbridge", "config.yaml")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
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
    """The one set of checkpoint defaults: CheckpointManager and the CLI apply them unless
    told otherwise (``db.save`` / ``db.load`` take explicit arguments, and ``profile``)."""

    every: int = 1
    """CheckpointManager: save when ``step % every == 0``."""
    keep_last: int | None = None
    """CheckpointManager: keep the newest N complete checkpoints (None: keep all)."""
    keep_every: int | None = None
    """CheckpointManager: also keep every step that is a multiple of N."""
    async_save: bool = True
    """Save in the background (``async`` in the file)."""
    fully_parallel: bool = False
    """Spread the writing of replicated shards over their holders."""
    threads: int | None = None
    """Writer threads (data files) per rank (None: by the rank's bytes and cores)."""
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


def _doc(doc: Any, where: str, path: str = "") -> Doc:
    return Doc(doc, where, path, ConfigError)


def parse_size(value: int | str, what: str) -> int:
    """Bytes from an int or a string such as ``64MiB`` (binary) or ``5GB`` (decimal)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    m = _SIZE.match(str(value))
    unit = m.group(2).upper() if m else ""
    if not m or unit not in _UNITS:
        raise ConfigError(f"{what}: expected a size such as 67108864, '64MiB' or '5GB'")
    return int(m.group(1)) * _UNITS[unit]


def _env_name(d: Doc, name: str) -> str | None:
    value = d.get(name, str)
    if value is not None and not _ENV_NAME.match(value):
        raise d.error(name, "must be the NAME of an environment variable, not a credential")
    return value


def _profile(name: str, d: Doc) -> StorageProfile:
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


def _positive(d: Doc, name: str, default: int | None) -> int | None:
    value = d.get(name, int, default)
    if value is not None and value < 1:
        raise d.error(name, "must be >= 1")
    return value


def _checkpoint(d: Doc) -> CheckpointDefaults:
    d.only(
        {"every", "keep_last", "keep_every", "async", "fully_parallel", "threads", "checksums"}
        | {"profile"}
    )
    base = CheckpointDefaults()
    return CheckpointDefaults(
        every=_positive(d, "every", base.every),
        keep_last=_positive(d, "keep_last", None),
        keep_every=_positive(d, "keep_every", None),
        async_save=d.get("async", bool, base.async_save),
        fully_parallel=d.get("fully_parallel", bool, base.fully_parallel),
        threads=_positive(d, "threads", base.threads),
        checksums=d.get("checksums", bool, base.checksums),
        profile=d.get("profile", str),
    )


def _job(name: str, d: Doc, base_dir: str) -> ReshardJob:
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
    root = _doc(doc, where)
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


_CACHE: dict[str, tuple[tuple[int, int], Config]] = {}
_CACHE_LOCK = threading.Lock()


def load_config(path: str | os.PathLike[str] | None = None) -> Config:
    """The configuration file in effect, validated (an empty Config if there is none).

    Read once: later calls return the parsed file while its size and mtime are unchanged.
    """
    where = config_path(path)
    if where is None:
        return Config()
    try:
        st = os.stat(where)
        stamp = (st.st_mtime_ns, st.st_size)
    except OSError:
        stamp = None
    with _CACHE_LOCK:
        hit = _CACHE.get(where)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    doc = read_yaml(where, "configuration file", ConfigError)
    log.debug("dcpbridge configuration from %s", where)
    config = parse_config(doc, where, os.path.dirname(os.path.abspath(where)))
    if stamp is not None:
        with _CACHE_LOCK:
            _CACHE[where] = (stamp, config)
    return config


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
    if profile.type != "s3":
        return StorageOptions(profile.options)
    from dcpbridge.storage.backends.s3 import s3_storage_options

    return StorageOptions(
        s3_storage_options(
            profile.options,
            endpoint_url=profile.endpoint_url,
            region=profile.region,
            key=_credential(profile, "access_key_env"),
            secret=_credential(profile, "secret_key_env"),
            token=_credential(profile, "session_token_env"),
            part_size=profile.multipart_part_size,
            concurrency=profile.concurrency,
        )
    )


def is_url(location: str | os.PathLike[str]) -> bool:
    """Whether ``location`` names remote storage (profiles apply to URLs, not local paths)."""
    text = os.fspath(location)
    return "://" in text and not text.startswith("file://")


def resolve_storage_options(
    storage_options_: dict[str, Any] | None,
    profile: str | None = None,
    config: Config | None = None,
    *,
    url: str | os.PathLike[str] | None = None,
) -> dict[str, Any] | None:
    """The storage options of one location, for the API and the CLI alike: explicit options
    on top of those of ``profile``, else of the configuration's ``checkpoint.profile``.
    Callers pass the ``url``: a local path takes no profile (only explicit options)."""
    if url is not None and not is_url(url):  # profiles describe remote storage only
        return storage_options_
    cfg = config
    if profile is None and url is not None:
        cfg = cfg if cfg is not None else load_config()
        profile = cfg.checkpoint.profile
    if profile is None:
        return storage_options_
    cfg = cfg if cfg is not None else load_config()
    opts = storage_options(cfg.profile(profile))
    opts.update(storage_options_ or {})
    return opts
