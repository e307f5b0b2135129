"""The ``framewire`` command: serve, encode, probe, decode, info, demo."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

from framewire.client import FramewireError, __version__
from framewire.core.media.argv import PROFILES
from framewire.service._cli.decode import cmd_decode
from framewire.service._cli.encode import cmd_encode
from framewire.service._cli.progress import add_output_flags
from framewire.service._cli.settings import settings_flags, settings_from


def cmd_serve(args: argparse.Namespace) -> int:
    from framewire.service._convert.convert import single_threaded_conversion
    from framewire.service._sockets import CannotServe
    from framewire.service._worker import Worker

    single_threaded_conversion()
    settings = settings_from(args)
    try:
        Worker(settings).run()
    except CannotServe as exc:
        print(f"framewire serve: {exc}; not starting", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"framewire serve: cannot listen: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from framewire.core.media.process import resolve_ffmpeg
    from framewire.service._ops.versions import ffmpeg_version

    settings = settings_from(args)
    exe = resolve_ffmpeg(settings.ffmpeg)
    info: dict[str, Any] = {
        "version": __version__,
        "ffmpeg": exe,
        "ffmpeg_version": ffmpeg_version(exe),
        "settings": json.loads(settings.model_dump_json(exclude={"token"})),
    }
    print(json.dumps(info, indent=2))
    return 0


def cmd_probe(args: argparse.Namespace) -> int:
    from framewire.client import Client

    with Client(args.url, token=args.token) as client:
        for info in client.probe([str(p.absolute()) for p in args.files]):
            print(info.model_dump_json())
    return 0


def _size(text: str) -> tuple[int, int]:
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"size must be WIDTHxHEIGHT, got {text!r}")
    return int(parts[0]), int(parts[1])


def cmd_demo(args: argparse.Namespace) -> int:
    from framewire.service._cli.demo import DemoOptions, run_demo

    # The flags are named as the options are, but for --size (WxH).
    flags = {f.name: getattr(args, f.name) for f in fields(DemoOptions) if hasattr(args, f.name)}
    width, height = args.size
    return run_demo(DemoOptions(**flags, width=width, height=height))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="framewire", description=__doc__)
    parser.add_argument("--version", action="store_true", help="print versions and exit")
    sub = parser.add_subparsers(dest="command")

    serve = sub.add_parser("serve", help="run the worker")
    settings_flags(serve)
    serve.set_defaults(func=cmd_serve)

    info = sub.add_parser("info", help="print versions and the effective settings")
    settings_flags(info)
    info.set_defaults(func=cmd_info)

    enc = sub.add_parser("encode", help="encode an .npy clip to MP4")
    enc.add_argument(
        "input", type=Path, help=".npy file: (3,T,H,W) float in [0,1] or (T,H,W,3) uint8"
    )
    enc.add_argument("output", help="a file, or an object URL (s3://bucket/key) the worker allows")
    enc.add_argument("--fps", type=float, required=True)
    enc.add_argument(
        "--quality", type=float, default=None, help="0..10, imageio's scale (default: 5)"
    )
    enc.add_argument("--preset", default=None, help="x264 preset (default: the profile's)")
    enc.add_argument(
        "--profile",
        default="imageio",
        choices=list(PROFILES),
        help="the engine save path whose bytes to reproduce (docs/engines.md)",
    )
    enc.add_argument(
        "--value-range",
        dest="value_range",
        type=float,
        nargs=2,
        metavar=("LOW", "HIGH"),
        default=None,
        help="the vllm-omni profile's: the VAE's output range (default: -1 1)",
    )
    enc.add_argument("--threads", type=int, default=None)
    enc.add_argument("--audio", type=Path, default=None)
    enc.add_argument("--layout", default="CTHW", choices=["CTHW", "TCHW", "THWC"])
    enc.add_argument("--local", action="store_true", help="encode in this process, no worker")
    enc.add_argument(
        "--presign-s",
        dest="presign_s",
        type=int,
        default=None,
        help="an s3:// output: also print a presigned GET URL valid this many seconds",
    )
    _client_flags(enc)
    enc.add_argument("--ffmpeg", default=None)
    enc.add_argument("--chunk-bytes", dest="chunk_bytes", type=int, default=None)
    enc.add_argument("--fallback", action=argparse.BooleanOptionalAction, default=None)
    enc.add_argument(
        "--worker-only",
        dest="worker_only",
        action="store_true",
        help="fail (exit 1) when no worker answers, instead of encoding in this process",
    )
    add_output_flags(enc)
    enc.set_defaults(func=cmd_encode)

    prb = sub.add_parser("probe", help="media facts of files, from the worker (JSON lines)")
    prb.add_argument("files", nargs="+", type=Path)
    _client_flags(prb)
    prb.set_defaults(func=cmd_probe)

    dec = sub.add_parser(
        "decode", help="decode a reference video to rgb24 frames, shared by the worker"
    )
    dec.add_argument("input", type=Path)
    dec.add_argument("--fps", type=float, required=True)
    dec.add_argument("--size", type=_size, required=True, metavar="WxH")
    dec.add_argument("--start", type=float, default=0.0, help="seconds to skip")
    dec.add_argument("--max-frames", dest="max_frames", type=int, default=None)
    dec.add_argument("-o", "--output", type=Path, default=None, help="write the frames as .npy")
    dec.add_argument(
        "--fd-socket",
        dest="fd_socket",
        default=None,
        help="the worker's fd socket (default: FRAMEWIRE_FD_SOCKET or the worker's default)",
    )
    dec.add_argument(
        "--fallback",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="decode here when no worker answers (default: yes)",
    )
    add_output_flags(dec)
    dec.set_defaults(func=cmd_decode)

    demo = sub.add_parser(
        "demo",
        help="save two clips and share one reference decode between processes, through a "
        "worker (one is started if none answers at --url)",
    )
    _client_flags(demo)
    demo.add_argument(
        "--fd-socket", dest="fd_socket", default=None, help="default: the worker's, from /v1/info"
    )
    demo.add_argument(
        "--inputs",
        type=Path,
        default=None,
        help="where to write the reference video: a directory the worker reads references "
        "from (default: the worker's first input root)",
    )
    demo.add_argument("--frames", type=int, default=48)
    demo.add_argument("--size", type=_size, default=(256, 256), metavar="WxH")
    demo.add_argument("--ranks", type=int, default=4, help="processes asking for the reference")
    demo.add_argument("--chunk", type=int, default=8, help="frames per chunk of the streamed save")
    demo.add_argument(
        "--wait",
        type=float,
        default=None,
        metavar="S",
        help="wait up to S seconds for the worker at --url, and fail if none answers "
        "(no worker of the demo's own): for a demo started beside its worker",
    )
    demo.set_defaults(func=cmd_demo)
    return parser


def _client_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url",
        default=os.environ.get("FRAMEWIRE_URL", "http://127.0.0.1:7700"),
        help="worker URL, http://host:port or unix:///path (env FRAMEWIRE_URL)",
    )
    parser.add_argument("--token", default=os.environ.get("FRAMEWIRE_TOKEN"))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from framewire.core.media.process import resolve_ffmpeg
        from framewire.service._ops.versions import ffmpeg_version

        exe = resolve_ffmpeg(os.environ.get("FRAMEWIRE_FFMPEG"))
        print(f"framewire {__version__}\nffmpeg {exe}\n{ffmpeg_version(exe)}")
        return 0
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args))
    except FramewireError as exc:
        print(f"framewire: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
