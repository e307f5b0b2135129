"""Worker configuration: every field is a ``FRAMEWIRE_*`` variable and a ``serve`` flag."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Annotated, Literal

from framewire.core.fdsocket import runtime_dir
from framewire.core.media.priority import Priority
from framewire.service._access.urls import check_prefix
from framewire.service._ops.limits import usable_memory
from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

CommaList = Annotated[list[str], NoDecode]


def _eighth_of_memory() -> int:
    return usable_memory() // 8


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FRAMEWIRE_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(default=7700, ge=0, le=65535)
    uds: Path = Field(default_factory=lambda: runtime_dir() / "api.sock")
    fd_socket: Path = Field(default_factory=lambda: runtime_dir() / "fd.sock")
    # Roots are absolute from here on (a relative one is taken from the directory the
    # worker starts in): /v1/info, and every client, name them as the worker does. The
    # defaults are made when the worker starts; a root set here must exist.
    output_roots: CommaList = Field(default_factory=lambda: [os.path.abspath("outputs")])
    input_roots: CommaList = Field(default_factory=lambda: [os.path.abspath("inputs")])
    shm_prefixes: CommaList = Field(default_factory=lambda: ["/framewire", "/torch_"])
    token: str | None = None
    ffmpeg: str | None = None
    # More ffmpeg binaries a request may ask for by identity (docs/engines.md): those of
    # the engines served here, whose pinned builds give other bytes than the default's.
    encoders: CommaList = Field(default_factory=list)
    # The binary of reference decodes (None: FRAMEWIRE_FFMPEG's): engines decode with
    # their own, apart from the one they encode with.
    decode_ffmpeg: str | None = None
    chunk_bytes: int = Field(default=128 << 20, ge=1)
    cpu_slots: int = Field(default_factory=lambda: len(os.sched_getaffinity(0)), ge=1)
    max_queue: int = Field(default=64, ge=0)
    # An encode of at most this many bytes of rgb24 frames (T*H*W*3) that would wait for
    # the CPU slots runs in the small lane instead, one at a time; 0: no small lane.
    small_encode_bytes: int = Field(default=256 << 10, ge=0)
    # How the encoder (x264) of every encode but the small ones yields the CPU to the ranks
    # beside the worker, to its own event loop, small lane and reference decodes: niceness
    # added, and its threads' policy (docs/configuration.md, "Encodes yield"). 0 and
    # "normal": it does not.
    encode_nice: int = Field(default=19, ge=0, le=19)
    encode_sched: Literal["normal", "batch", "idle"] = "batch"
    # An encode request is a few hundred bytes an output; anything near this is not one.
    max_body_bytes: int = Field(default=1 << 20, ge=1024)
    decode_cache_bytes: int = Field(default_factory=_eighth_of_memory, ge=0)
    # Audio from memory held as WAVs (one per distinct audio) and being read.
    audio_budget_bytes: int = Field(default=1 << 30, ge=1)
    # One decode's frames: a long reference at a large size must not take the host's RAM.
    max_decode_bytes: int = Field(default_factory=_eighth_of_memory, ge=1)
    allowed_uids: Annotated[list[int], NoDecode] = Field(default_factory=lambda: [os.getuid()])
    allowed_gids: Annotated[list[int], NoDecode] = Field(default_factory=list)
    fallback: bool = True
    # float32 -> rgb24: the compiled kernel when numba imports (auto), always, or never.
    kernel: Literal["auto", "compiled", "pure"] = "auto"
    # When a GPU's CUDA context (a few hundred MiB of its memory) and conversion kernels
    # are made: on the first request that names it (a GPU no rank hands tensors from
    # costs nothing), or for every visible GPU at start (no request pays for it).
    cuda_warm: Literal["first-use", "start"] = "first-use"
    log_level: str = "info"
    log_format: Literal["plain", "json"] = "plain"
    # Seconds a SIGTERM waits for requests in flight before stopping what still runs.
    shutdown_grace: float = Field(default=30.0, ge=0)
    # An ffmpeg run (encode, decode) that makes no progress this long is killed.
    stall_timeout_s: float = Field(default=60.0, gt=0)
    # The vllm-omni profile's PyAV writers forked from a template that imported PyAV
    # (false: each encode starts its own interpreter).
    pyav_fork: bool = True
    # A connection (HTTP or fd socket) that does not complete a request's headers (or
    # line), or stops sending a body, for this long is closed.
    idle_timeout_s: float = Field(default=30.0, gt=0)
    # Open connections per listener kind (HTTP, fd socket); past it new ones are refused.
    max_connections: int = Field(default=256, ge=1)
    # Registered shared-memory regions (each holds a file descriptor).
    max_regions: int = Field(default=1024, ge=1)
    # Of those, what one uid may hold: nobody can take every slot from the ranks.
    max_regions_per_owner: int = Field(default=256, ge=1)
    # A stream session that receives nothing this long is aborted (nothing remains).
    stream_idle_s: float = Field(default=60.0, gt=0)
    # Converted frames a stream session holds ahead of its encoder: a chunk is answered
    # once converted into them, so the producer makes the next one while x264 works
    # (0: answered once the encoder's pipe took the chunk, at the encoder's pace).
    stream_ahead_mib: int = Field(default=64, ge=0, le=4096)
    # Staging memfds kept between encodes with their pages (a fresh one's first writes and
    # its unmap cost more than the copy into it), at most this many MiB, none past 30 s idle.
    staging_keep_mib: int = Field(default=256, ge=0, le=1 << 20)
    # Open stream sessions; past it, opening one is a 429.
    max_streams: int = Field(default=64, ge=1)
    # Of the waiting encodes (FRAMEWIRE_MAX_QUEUE), the open stream sessions, the audio
    # budget and the memory outputs held, what one uid may take (root and the worker's own
    # uid are not limited), so no user can have every rank refused; 1: no share.
    user_share: float = Field(default=0.5, gt=0, le=1)
    # memory:// outputs held for their callers to take, each until taken or for this long;
    # how many, and their bytes: a limited caller holds its FRAMEWIRE_USER_SHARE of each.
    held_output_ttl_s: float = Field(default=120.0, gt=0)
    max_held_outputs: int = Field(default=64, ge=1)
    held_output_bytes: int = Field(default=1 << 30, ge=64 << 10)
    # Object URL prefixes outputs may be uploaded to (s3://bucket/prefix/); none: no URLs.
    output_urls: CommaList = Field(default_factory=list)
    # Uploads of this size or more go multipart, in parts of this size (S3: >= 5 MiB).
    upload_part_bytes: int = Field(default=8 << 20, ge=1024, le=5 << 30)
    # An object's parts go to the store while it is encoded (all but the first and the
    # rest at the end); false: the whole upload once the file is complete.
    upload_while_encoding: bool = True
    # An attempt at a request to the object store that takes longer as a whole (plus its
    # body's time at _store/deadline.MIN_RATE) is cut: a timeout.
    store_timeout_s: float = Field(default=30.0, gt=0)
    # Attempts per request to the object store (backoff with jitter between them).
    store_attempts: int = Field(default=4, ge=1, le=20)
    # Live viewers of stream sessions, all sessions together; past it a viewer gets 429.
    max_viewers: int = Field(default=64, ge=0)
    # A live viewer of a session that has ended has this long to take the rest of its
    # stream; past it the rest is dropped and the stream ends (too_slow).
    live_grace_s: float = Field(default=60.0, gt=0)
    # What a live view keeps for late joiners and HLS players, about: past it the
    # oldest segments (keyframe to keyframe) go; past twice it in one, all of it.
    live_history_bytes: int = Field(default=32 << 20, ge=64 << 10, le=1 << 30)

    @property
    def encode_priority(self) -> Priority:
        return Priority(self.encode_nice, self.encode_sched)

    def per_user(self, total: int) -> int | None:
        """What one limited caller may take of ``total`` (at least 1); None: all of it."""
        if self.user_share >= 1:
            return None
        return max(1, math.floor(total * self.user_share))

    @field_validator("token")
    @classmethod
    def _usable_token(cls, v: str | None) -> str | None:
        # An empty token would lock every caller out without a word; spaces and control
        # characters cannot survive an Authorization header.
        if v is not None and (not v or any(c.isspace() or not c.isprintable() for c in v)):
            raise ValueError(
                "FRAMEWIRE_TOKEN is set but empty or holds spaces or control characters: "
                "unset it, or give it a printable value"
            )
        return v

    @field_validator("output_roots", "input_roots", "shm_prefixes", "encoders", mode="before")
    @classmethod
    def _split(cls, v: object) -> object:
        if isinstance(v, str):
            return [p.strip() for p in v.split(",") if p.strip()]
        return v

    @field_validator("output_roots", "input_roots", mode="after")
    @classmethod
    def _absolute(cls, v: list[str]) -> list[str]:
        return [os.path.abspath(p) for p in v]

    @field_validator("output_urls", mode="before")
    @classmethod
    def _url_prefixes(cls, v: object) -> object:
        if isinstance(v, str):
            v = [p.strip() for p in v.split(",") if p.strip()]
        if isinstance(v, list):
            try:
                return [check_prefix(str(p)) for p in v]
            except Exception as exc:  # BadRequest from the request-side check
                raise ValueError(str(getattr(exc, "message", exc))) from None
        return v

    @field_validator("allowed_uids", "allowed_gids", mode="before")
    @classmethod
    def _split_ints(cls, v: object) -> object:
        if isinstance(v, str):
            return [int(p) for p in v.split(",") if p.strip()]
        return v
