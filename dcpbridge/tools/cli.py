"""The ``dcpbridge`` command: inspect, validate, reshard and convert checkpoints.

Exit status: 0 success, 1 a bad or unreadable checkpoint, 2 a usage or configuration error.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import logging
import os
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

from dcpbridge.engine.stats import human_bytes
from dcpbridge.errors import CheckpointError, NotACheckpointError
from dcpbridge.formats import config as config_mod
from dcpbridge.formats import layout as layout_mod
from dcpbridge.formats.config import (
    Config,
    ConfigError,
    is_url,
    load_config,
    parse_size,
    resolve_storage_options,
)
from dcpbridge.formats.layout import Layout, LayoutError, load_layout, whole_tensors
from dcpbridge.tools.report import shown

log = logging.getLogger("dcpbridge")

_FORMATS_HELP = """\
checkpoint formats read (detected automatically):
  dcpbridge     a directory with dcpbridge.json (written by dcpbridge.save or this tool)
  torch_dist    a Megatron-Core torch_dist directory (metadata.json, .metadata, *.distcp,
                common.pt)
  dcp           a plain torch.distributed.checkpoint directory (.metadata)
                (their pickled .metadata is read without running code: DCP's own classes
                only; --allow-pickle reads one that needs other classes)
  torch         a single torch.save file
  safetensors   a .safetensors file, or a directory of them (model.safetensors.index.json)

URLs: local paths or any fsspec URL (s3://bucket/prefix, memory://...). Storage options come
from a profile of the configuration file: --profile (both sides), --src-profile, --dst-profile,
else checkpoint.profile of the file; profiles apply to URLs only, not local paths.
"""


class UsageError(Exception):
    """A command line that cannot be run as given (exit status 2)."""


def _docs(module: Any) -> str:
    return (module.__doc__ or "").split("\n", 1)[1].strip("\n").replace("``", "")


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        metavar="FILE",
        default=argparse.SUPPRESS,  # keeps a --config given before the command
        help="configuration file (see `dcpbridge --help`)",
    )
    p.add_argument("--profile", metavar="NAME", help="storage profile for every URL")
    p.add_argument(
        "--allow-pickle",
        action="store_true",
        help="unpickle what safe loading refuses (objects, torch files, DCP metadata with "
        "classes beyond DCP's); trusted input only",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")


def _add_progress(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: once a run has lasted a second)",
    )


def _add_transfer(p: argparse.ArgumentParser) -> None:
    p.add_argument("--src-profile", metavar="NAME", help="storage profile for SRC")
    p.add_argument("--dst-profile", metavar="NAME", help="storage profile for DST")
    p.add_argument(
        "--force", action="store_true", help="overwrite DST if it exists (refused otherwise)"
    )
    _add_progress(p)
    p.add_argument(
        "--slab-size",
        default="64MiB",
        metavar="SIZE",
        help="largest piece read and written at once (bounds memory; default 64MiB)",
    )


def _on_one_checkpoint(
    sub: Any, name: str, summary: str, description: str
) -> argparse.ArgumentParser:
    """A command that reads one checkpoint (CKPT), with the options every command takes."""
    p = sub.add_parser(
        name,
        help=summary,
        description=description,
        epilog=_FORMATS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("checkpoint", metavar="CKPT")
    _add_common(p)
    return p


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="dcpbridge",
        description="Inspect, validate, reshard and convert sharded PyTorch checkpoints.",
        epilog=f"{_FORMATS_HELP}\nconfiguration file:\n{_docs(config_mod)}",
        formatter_class=fmt,
    )
    parser.add_argument("--config", metavar="FILE", help="configuration file (see below)")
    parser.add_argument("--version", action="version", version=f"dcpbridge {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = _on_one_checkpoint(
        sub,
        "inspect",
        "show keys, shapes, dtypes, chunks, ranks, files (metadata only)",
        "Describe a checkpoint from its metadata: every tensor's global shape, "
        "dtype and stored chunks (box, writing rank, file, offset), objects, files and sizes, "
        "format version, and whether it is complete (files present, tensors fully covered).",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of text")

    p = _on_one_checkpoint(
        sub,
        "validate",
        "check completeness, coverage and (optionally) checksums",
        "Check that every data file exists and is long enough, that the stored "
        "chunks cover every tensor exactly once, and with --checksums that every stored byte "
        "matches its recorded checksum. Exit 0 if valid, 1 with a list of problems if not.",
    )
    p.add_argument("--checksums", action="store_true", help="read all data and verify checksums")
    _add_progress(p)

    p = sub.add_parser(
        "fsck",
        help="list orphaned and missing files under a checkpoint root",
        description="Check every checkpoint folder under ROOT (a CheckpointManager root, or "
        "any folder of checkpoints saved side by side): data files that no complete "
        "checkpoint needs (orphans, left by a killed save or retention) and files a complete "
        "checkpoint needs but that are gone (its own, or an earlier one's it references). "
        "Exit 0 if there are none, 1 otherwise. --fix removes the orphans only (run it while "
        "no save writes under ROOT).",
        formatter_class=fmt,
    )
    p.add_argument("root", metavar="ROOT")
    p.add_argument("--fix", action="store_true", help="remove orphaned files")
    _add_common(p)

    p = sub.add_parser(
        "reshard",
        help="rewrite a checkpoint for a target parallel layout",
        description="Rewrite SRC (any format) as a dcpbridge checkpoint at DST in which each "
        "target rank's box of every tensor is one stored chunk, so that a load in that layout "
        "reads one contiguous range per shard. Streams box by box with bounded memory. Run "
        "under torchrun to share the work among N workers. The layout comes from --layout, "
        "or from a job of a configuration file (--config FILE [--job NAME]).",
        epilog=f"layout file:\n{_docs(layout_mod)}\n\n{_FORMATS_HELP}",
        formatter_class=fmt,
    )
    p.add_argument("source", metavar="SRC", nargs="?")
    p.add_argument("destination", metavar="DST", nargs="?")
    p.add_argument("--layout", metavar="LAYOUT.yaml", help="target layout file")
    p.add_argument("--job", metavar="NAME", help="job of the configuration file to run")
    p.add_argument("--no-checksums", action="store_true", help="do not record checksums")
    p.add_argument("--max-file-size", metavar="SIZE", help="start a new data file after SIZE")
    _add_common(p)
    _add_transfer(p)

    p = sub.add_parser(
        "convert",
        help="convert between dcpbridge, DCP/torch_dist, torch and safetensors",
        description="Convert SRC (any format) to a dcpbridge checkpoint (whole tensors, or "
        "--layout), to one torch.save file, or to Hugging Face style sharded safetensors "
        "(model-0000i-of-0000n.safetensors + model.safetensors.index.json; tensors only). "
        "Streams with bounded memory. Under torchrun, --to dcpbridge and --to safetensors "
        "share the output files among the workers (the index is written last).",
        epilog=_FORMATS_HELP,
        formatter_class=fmt,
    )
    p.add_argument("source", metavar="SRC")
    p.add_argument("destination", metavar="DST")
    p.add_argument("--to", required=True, choices=["dcpbridge", "torch", "safetensors"])
    p.add_argument(
        "--max-shard-size",
        default="5GB",
        metavar="SIZE",
        help="safetensors: largest shard file (default 5GB)",
    )
    p.add_argument("--layout", metavar="LAYOUT.yaml", help="dcpbridge: target layout")
    p.add_argument("--no-checksums", action="store_true", help="dcpbridge: no checksums")
    _add_common(p)
    _add_transfer(p)
    return parser


# -- helpers ---------------------------------------------------------------------------------


def _options(cfg: Config, url: str, *names: str | None) -> dict[str, Any] | None:
    """Storage options for ``url``: the first profile named (or the file's default)."""
    return resolve_storage_options(None, next((n for n in names if n), None), cfg, url=url)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dcpbridge")
    except PackageNotFoundError:
        return "unknown"


@contextlib.contextmanager
def _progress(
    total: int, desc: str, wanted: bool | None, *, rank: int = 0
) -> Iterator[Callable[[int], None]]:
    """A tqdm bar on stderr (rank 0 only): forced on or off by ``--[no-]progress``, else shown
    once a run has lasted a second, so short runs stay quiet."""
    from tqdm import tqdm

    auto = wanted is None
    bar = tqdm(
        total=total,
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        disable=rank != 0 or wanted is False,
        file=sys.stderr,
        mininterval=0.5,
        delay=1.0 if auto else 0.0,
        dynamic_ncols=True,
    )
    try:
        yield bar.update
    finally:
        bar.close()


def _refuse_existing(url: str, options: dict[str, Any] | None, force: bool) -> None:
    """Refuse to write over an existing file or non-empty directory unless ``force``."""
    if force:
        return
    from dcpbridge.storage import resolve
    from dcpbridge.storage.backends import storage_for
    from dcpbridge.storage.errors import storage_faults

    location = resolve(url, options)
    fs = storage_for(location).fs  # on S3, each request bounded by the storage's timeouts
    with storage_faults(f"{url}: look up"):
        fs.invalidate_cache(location.root)
        if not fs.exists(location.root):
            return
        taken = fs.isfile(location.root) or bool(fs.ls(location.root))
    if taken:
        raise UsageError(f"the destination {url} exists; pass --force to overwrite it")


def _size(text: str | None, what: str) -> int | None:
    if text is None:
        return None
    try:
        return parse_size(text, what)
    except ConfigError as e:
        raise UsageError(str(e)) from None


def _open(args: argparse.Namespace, cfg: Config, url: str, profile: str | None = None) -> Any:
    from dcpbridge.formats.sources import open_source

    options = _options(cfg, url, profile, args.profile)
    try:
        return open_source(url, storage_options=options, allow_pickle=args.allow_pickle)
    except NotACheckpointError as e:
        hint = _steps_hint(url, options)
        if hint is None:
            raise
        raise NotACheckpointError(f"{e}; {hint}") from e


def _steps_hint(url: str, options: dict[str, Any] | None) -> str | None:
    """Where ``url`` is a CheckpointManager's root: its steps, and the newest to name instead."""
    from dcpbridge.engine.step_names import step_of
    from dcpbridge.storage import resolve
    from dcpbridge.storage.backends import storage_for

    try:
        names = storage_for(resolve(url, options)).list_names()
    except Exception:  # the hint is a courtesy: the original error stands
        return None
    steps = sorted(n for n in names if step_of(n) is not None)
    if not steps:
        return None
    newest = f"{url.rstrip('/')}/{steps[-1]}"
    return f"it holds {len(steps)} step(s) of a CheckpointManager, name one: {newest}"


def _group() -> Any:
    """The torchrun process group (gloo) when launched with WORLD_SIZE > 1, else one process."""
    from dcpbridge.engine.collectives import Group

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return Group.resolve()
    import torch.distributed as dist
    import torch.distributed.checkpoint  # noqa: F401  (before init_process_group)

    if not dist.is_initialized():
        dist.init_process_group("gloo")
        _STARTED_GROUP.append(True)
    return Group.resolve()


_STARTED_GROUP: list[bool] = []


def _leave_group(code: int) -> NoReturn:
    """End a torchrun worker: tear down gloo, run exit hooks, and exit without the interpreter
    teardown in which gloo's threads occasionally abort."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    os._exit(code)


# -- commands --------------------------------------------------------------------------------


def cmd_inspect(args: argparse.Namespace, cfg: Config) -> int:
    from dcpbridge.tools import report

    source = _open(args, cfg, args.checkpoint)
    try:
        sizes = report.file_sizes(source)
        found = report.structure(source, sizes)
        doc = report.describe(source, sizes, found)
    finally:
        source.close()
    print(json.dumps(doc, indent=2) if args.json else report.format_text(doc))
    return 0 if doc["complete"] else 1


def cmd_validate(args: argparse.Namespace, cfg: Config) -> int:
    from dcpbridge.tools import report

    source = _open(args, cfg, args.checkpoint)
    try:
        found = report.structure(source, report.file_sizes(source))
        if args.checksums and not found.problems:
            with _progress(_bytes_to_verify(source), "verify", args.progress) as bar:
                report.verify_data(source, found, bar)
        line = report.summary_line(source, found)
    finally:
        source.close()
    for note in found.notes:
        print(f"note: {shown(note)}")
    url = shown(source.location.url)
    if found.problems:
        print(f"INVALID: {url} ({line}): {len(found.problems)} problem(s)")
        for p in found.problems:
            print(f"  - {shown(p)}")
        return 1
    print(f"OK: {url} ({line})")
    return 0


def cmd_fsck(args: argparse.Namespace, cfg: Config) -> int:
    from dcpbridge.engine.incremental import fsck
    from dcpbridge.storage import METADATA_FILE, resolve
    from dcpbridge.storage.backends import storage_for

    options = _options(cfg, args.root, args.profile)
    if not is_url(args.root) and not os.path.isdir(args.root):  # a typo must not pass as clean
        raise NotACheckpointError(f"{args.root}: no such directory")
    if storage_for(resolve(args.root, options)).exists(METADATA_FILE):
        raise UsageError(
            f"{args.root} is a checkpoint itself: fsck checks the checkpoints under a root "
            f"(its parent folder); `dcpbridge validate {args.root}` checks this one"
        )
    found = fsck(args.root, options, fix=args.fix)
    for line in found.unreadable:
        print(f"unreadable: {shown(line)}")
    for line in found.missing:
        print(f"missing: {shown(line)}")
    for line in found.orphans:
        print(f"{'removed' if args.fix and not found.unreadable else 'orphan'}: {shown(line)}")
    print(
        f"{len(found.checkpoints)} checkpoint(s), {len(found.orphans)} orphaned file(s), "
        f"{len(found.missing)} missing file(s)"
    )
    bad = found.missing or found.unreadable or (found.orphans and not args.fix)
    return 1 if bad else 0


def _bytes_to_verify(source: Any) -> int:
    """What ``validate --checksums`` reads: every stored item of a dcpbridge checkpoint
    (objects too), every tensor chunk of other formats."""
    from dcpbridge.storage import StorageIndex
    from dcpbridge.tools import report

    index = getattr(getattr(source, "metadata", None), "storage_data", None)
    if isinstance(index, StorageIndex):
        return sum(item.nbytes for item in index.items.values())
    return report.count_bytes(source)


def _layout_or_default(path: str | None) -> Layout:
    return load_layout(path) if path else whole_tensors()


def _run_reshard(
    args: argparse.Namespace,
    cfg: Config,
    src: str,
    dst: str,
    layout: Layout,
    src_profile: str | None,
    dst_profile: str | None,
) -> int:
    from dcpbridge.tools.reshard import assign, plan_work, reshard

    def norm(u: str) -> str:
        return u.rstrip("/") if is_url(u) else os.path.abspath(u)

    if norm(src) == norm(dst):
        raise UsageError(f"the destination {dst} is the source itself")
    slab = _size(args.slab_size, "--slab-size") or 0
    dst_options = _options(cfg, dst, dst_profile, args.profile)
    _refuse_existing(dst, dst_options, args.force)
    group = _group()
    source = _open(args, cfg, src, src_profile)
    try:
        work = plan_work(source, layout)
        total = sum(w.nbytes for w in assign(work, group.size)[group.rank])
        desc = f"worker {group.rank}/{group.size}" if group.size > 1 else "reshard"
        with _progress(total, desc, args.progress, rank=group.rank) as bar:
            result = reshard(
                source,
                dst,
                layout,
                storage_options=dst_options,
                group=group,
                checksums=cfg.checkpoint.checksums and not args.no_checksums,
                slab_bytes=slab,
                max_file_bytes=_size(getattr(args, "max_file_size", None), "--max-file-size"),
                on_bytes=bar,
                work=work,
            )
    finally:
        source.close()
    if group.rank == 0:
        print(
            f"wrote {result.destination}: {result.tensors} tensors as {result.chunks} chunks for "
            f"{result.world_size} target ranks, {result.objects} objects, "
            f"{human_bytes(result.bytes_written)} in {result.seconds:.2f}s "
            f"({result.workers} worker(s))"
        )
    return 0


def cmd_reshard(args: argparse.Namespace, cfg: Config) -> int:
    if args.source and args.destination:
        if args.job:
            raise UsageError("give either SRC DST --layout FILE, or --config FILE --job NAME")
        if not args.layout:
            raise UsageError("reshard SRC DST needs --layout LAYOUT.yaml")
        return _run_reshard(
            args,
            cfg,
            args.source,
            args.destination,
            load_layout(args.layout),
            args.src_profile,
            args.dst_profile,
        )
    if args.source or args.destination:
        raise UsageError("reshard needs both SRC and DST (or neither, with --config FILE)")
    if cfg.path is None:
        raise UsageError("reshard needs SRC DST --layout FILE, or --config FILE with a job")
    if args.layout:
        raise UsageError("--layout is for SRC DST; a job names its own layout")
    job = cfg.job(args.job)
    return _run_reshard(
        args,
        cfg,
        job.source,
        job.destination,
        job.layout,
        args.src_profile or job.source_profile,
        args.dst_profile or job.destination_profile,
    )


def cmd_convert(args: argparse.Namespace, cfg: Config) -> int:
    if args.to == "dcpbridge":
        layout = _layout_or_default(args.layout)
        return _run_reshard(
            args, cfg, args.source, args.destination, layout, args.src_profile, args.dst_profile
        )
    if args.layout:
        raise UsageError("--layout applies to --to dcpbridge only")
    if args.to == "torch" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UsageError("convert --to torch runs in one process, not under torchrun")
    from dcpbridge.tools.export import export_safetensors, export_torch

    slab = _size(args.slab_size, "--slab-size") or 0
    options = _options(cfg, args.destination, args.dst_profile, args.profile)
    _refuse_existing(args.destination, options, args.force)
    group = _group()
    source = _open(args, cfg, args.source, args.src_profile)
    try:
        total = sum(t.nbytes for t in source.tensors.values()) // group.size
        with _progress(total, f"to {args.to}", args.progress, rank=group.rank) as bar:
            if args.to == "safetensors":
                result = export_safetensors(
                    source,
                    args.destination,
                    storage_options=options,
                    slab_bytes=slab,
                    max_shard_bytes=_size(args.max_shard_size, "--max-shard-size") or 0,
                    on_bytes=bar,
                    group=group,
                )
            else:
                result = export_torch(
                    source,
                    args.destination,
                    storage_options=options,
                    slab_bytes=slab,
                    on_bytes=bar,
                )
    finally:
        source.close()
    if group.rank:
        return 0
    print(
        f"wrote {result.destination}: {result.tensors} tensors, "
        f"{human_bytes(result.bytes_written)} in {len(result.files)} file(s)"
    )
    if result.aliases:
        tied = ", ".join(f"{shown(a)} -> {shown(k)}" for a, k in sorted(result.aliases.items())[:5])
        print(f"note: tied weights written once: {tied}")
    if result.skipped:
        print(
            f"note: safetensors holds tensors only; skipped {len(result.skipped)} object(s): "
            f"{shown(', '.join(result.skipped[:5]))}{' ...' if len(result.skipped) > 5 else ''}"
        )
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace, Config], int]] = {
    "inspect": cmd_inspect,
    "validate": cmd_validate,
    "fsck": cmd_fsck,
    "reshard": cmd_reshard,
    "convert": cmd_convert,
}


_HINTS = (
    (
        ("(403)", "Forbidden", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"),
        "check the credentials and the bucket policy",
    ),
    (("NoSuchBucket", "bucket does not exist"), "the bucket does not exist"),
    (
        ("Could not connect", "Connection refused", "ConnectError", "Cannot connect"),
        "is the endpoint up? (the README suggests retry settings that fail fast)",
    ),
    (("timed out", "Timeout", "TimeoutError"), "the endpoint did not answer in time"),
)


def describe_error(e: BaseException) -> str:
    """One line for a storage or network failure (URL and cause), the message otherwise."""
    text = str(e) or type(e).__name__
    if isinstance(e, UsageError):  # our own message about the command line: no class name
        return text
    if not isinstance(e, CheckpointError) or isinstance(e, OSError):
        if not isinstance(e, CheckpointError):
            text = f"{type(e).__name__}: {text}"
        text = " ".join(text.split())
        chain = " ".join(str(c) for c in _causes(e))
        hint = next((h for keys, h in _HINTS if any(_names(k, text, chain) for k in keys)), None)
        if hint and hint not in text:
            text = f"{text}; {hint}"
    return text


def _names(key: str, *texts: str) -> bool:
    """Whether a text names ``key`` outside its paths and URLs (a folder ``run-403`` is no 403)."""
    return any(key in re.sub(r"\S*/\S*", " ", t) for t in texts)


def _causes(e: BaseException) -> Iterator[BaseException]:
    seen = {id(e)}
    while (e := e.__cause__ or e.__context__) is not None and id(e) not in seen:  # type: ignore[assignment]
        seen.add(id(e))
        yield e


def _report(args: argparse.Namespace, e: BaseException, code: int) -> None:
    message = describe_error(e)
    if getattr(args, "debug", False):
        log.error("%s failed", args.command, exc_info=e)
    if getattr(args, "json", False):
        doc = {"error": message, "type": type(e).__name__, "exit_status": code}
        print(json.dumps(doc))
    else:
        print(f"dcpbridge {args.command}: error: {shown(message, keep=chr(10))}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    code = 0
    try:
        cfg = load_config(args.config)
        code = COMMANDS[args.command](args, cfg)
    except BrokenPipeError:  # output piped into `head` and the like: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 1
    except (UsageError, ConfigError, LayoutError) as e:
        code = 2
        _report(args, e, code)
    except KeyboardInterrupt:
        code = 130
        print(f"dcpbridge {args.command}: interrupted", file=sys.stderr)
    except Exception as e:  # storage, network, bad checkpoints: one line, --debug for more
        code = 1
        _report(args, e, code)
    if _STARTED_GROUP:
        _leave_group(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
