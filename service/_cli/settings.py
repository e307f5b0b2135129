"""The worker's settings on the command line: one flag each, over the FRAMEWIRE_* variables."""

from __future__ import annotations

import argparse
import sys

from framewire.service._settings import Settings


def settings_flags(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per setting; unset flags leave the FRAMEWIRE_* value in force."""
    for name, field in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        env = "FRAMEWIRE_" + name.upper()
        if field.annotation is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=env)
        else:
            parser.add_argument(flag, dest=name, default=None, metavar="VALUE", help=env)


def settings_from(args: argparse.Namespace) -> Settings:
    """The settings the flags and FRAMEWIRE_* variables give; unusable ones end the command."""
    from pydantic import ValidationError

    given = {k: v for k, v in vars(args).items() if k in Settings.model_fields and v is not None}
    try:
        return Settings(**given)
    except ValidationError as exc:
        for error in exc.errors():
            where = ".".join(str(p) for p in error["loc"])
            print(f"framewire: setting {where}: {error['msg']}", file=sys.stderr)
        raise SystemExit(2) from None
