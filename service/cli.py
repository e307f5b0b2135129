"""The ``framewire`` command: serve, encode, info."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from framewire.client import FramewireError, __version__

from .settings import Settings


def _settings_flags(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per setting; unset flags leave the FRAMEWIRE_* value in force."""
    for name, field in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        env = "FRAMEWIRE_" + name.upper()
        if field.annotation is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=env)
        else:
            parser.add_argument(flag, dest=name, default=None, metavar="VALUE", help=env)


def settings_from(args: argparse.Namespace) -> Settings:
    given = {k: v for k, v in vars(args).items() if k in Settings.model_fields and v is not None}
    return Settings(**given)


def cmd_serve(args: argparse.Namespace) -> int:
    from .app import create_app
    from .server import serve

    settings = settings_from(args)
    serve(create_app(settings), settings)
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from .ffmpeg import ffmpeg_version, resolve_ffmpeg

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


def cmd_encode(args: argparse.Namespace) -> int:
    from .encoder import EncodeParams, Encoder
    from .sources import open_npy

    if not args.local:
        print("framewire encode: only --local is available in this version", file=sys.stderr)
        return 2
    settings = settings_from(args)
    encoder = Encoder(settings.ffmpeg, chunk_bytes=settings.chunk_bytes, fallback=settings.fallback)
    params = EncodeParams(
        fps=args.fps,
        quality=args.quality,
        preset=args.preset,
        threads=args.threads,
        audio=args.audio,
    )
    source = open_npy(args.input, args.layout)
    try:
        result = encoder.encode(source, args.output, params)
    finally:
        source.close()
    print(
        f"{result.path}: {result.frames} frames {result.width}x{result.height}, "
        f"{result.bytes} bytes, sha256 {result.sha256}, route {result.route}, "
        f"{result.encode_ms:.0f} ms"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="framewire", description=__doc__)
    parser.add_argument("--version", action="store_true", help="print versions and exit")
    sub = parser.add_subparsers(dest="command")

    serve = sub.add_parser("serve", help="run the worker")
    _settings_flags(serve)
    serve.set_defaults(func=cmd_serve)

    info = sub.add_parser("info", help="print versions and the effective settings")
    _settings_flags(info)
    info.set_defaults(func=cmd_info)

    enc = sub.add_parser("encode", help="encode an .npy clip to MP4")
    enc.add_argument(
        "input", type=Path, help=".npy file: (3,T,H,W) float in [0,1] or (T,H,W,3) uint8"
    )
    enc.add_argument("output", type=Path)
    enc.add_argument("--fps", type=float, required=True)
    enc.add_argument("--quality", type=int, default=5)
    enc.add_argument("--preset", default="fast")
    enc.add_argument("--threads", type=int, default=None)
    enc.add_argument("--audio", type=Path, default=None)
    enc.add_argument("--layout", default="CTHW", choices=["CTHW", "TCHW", "THWC"])
    enc.add_argument("--local", action="store_true", help="encode in this process, no worker")
    enc.add_argument("--ffmpeg", default=None)
    enc.add_argument("--chunk-bytes", dest="chunk_bytes", type=int, default=None)
    enc.add_argument("--fallback", action=argparse.BooleanOptionalAction, default=None)
    enc.set_defaults(func=cmd_encode)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from .ffmpeg import ffmpeg_version, resolve_ffmpeg

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
