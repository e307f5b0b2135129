"""Prometheus figures, one registry per app (tests run several apps in one process)."""

from __future__ import annotations

import functools
import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector


def memfds_open() -> int:
    """The memfds this process holds (decoded references, staged frames, audio): what a
    leak of them would grow. Each once, however many descriptors it has (a mapped one
    has two: its own and the mapping's)."""
    seen: set[tuple[int, int]] = set()
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return 0
    for name in names:
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("/memfd:"):
                st = os.stat(f"/proc/self/fd/{name}")
                seen.add((st.st_dev, st.st_ino))
        except OSError:
            continue  # closed while counted
    return len(seen)


# The settings exported as framewire_limit{setting}, so that alerts can read a gauge's
# share of its bound rather than a threshold copied from the defaults.
LIMITS = (
    "cpu_slots",
    "max_queue",
    "max_streams",
    "max_viewers",
    "max_regions",
    "decode_cache_bytes",
    "max_held_outputs",
    "held_output_bytes",
)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        # Every figure is this registry's; /metrics lists them in this order.
        counter = functools.partial(Counter, registry=self.registry)
        gauge = functools.partial(Gauge, registry=self.registry)
        histogram = functools.partial(Histogram, registry=self.registry)
        # process_open_fds, process_max_fds, process_resident_memory_bytes, CPU seconds.
        ProcessCollector(registry=self.registry)
        gauge("framewire_memfds", "memfds the worker holds open").set_function(memfds_open)
        self.ready = gauge("framewire_ready", "1 while the worker can encode (/readyz)")
        self.cuda_host_copies = counter(
            "framewire_cuda_host_copied_chunks",
            "Stream chunks of CUDA tensors the client could not share over IPC, sent by host",
        )
        self.gpus_unusable = gauge(
            "framewire_gpus_unusable", "GPUs a sticky CUDA error made unusable until a restart"
        )
        self.limits = gauge("framewire_limit", "The worker's bounds, by setting", ["setting"])
        self.uploads = counter(
            "framewire_store_uploads",
            "Object-store uploads by result: ok, or the error code",
            ["result"],
        )
        self.held_outputs = gauge(
            "framewire_held_outputs", "memory:// outputs held for their callers to take"
        )
        self.held_output_bytes = gauge(
            "framewire_held_output_bytes", "Bytes of the memory:// outputs held"
        )
        self.held_expired = counter(
            "framewire_held_outputs_expired",
            "memory:// outputs dropped untaken (FRAMEWIRE_HELD_OUTPUT_TTL_S)",
        )
        self.requests = counter(
            "framewire_requests", "HTTP requests by route and status", ["route", "status"]
        )
        self.encode_seconds = histogram(
            "framewire_encode_seconds",
            "Wall time of one output's encode",
            ["route"],
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
        )
        self.bytes_written = counter("framewire_bytes_written", "MP4 bytes written")
        self.outputs = counter("framewire_outputs", "Outputs by result", ["result"])
        self.fallbacks = counter("framewire_fallbacks", "Outputs redone on the fallback route")
        self.in_flight = gauge("framewire_encodes_in_flight", "Encodes running now")
        self.queue_waiting = gauge("framewire_encodes_waiting", "Encodes waiting for CPU slots")
        self.queue_seconds = histogram(
            "framewire_queue_wait_seconds",
            "Time an encode waited for its slots",
            buckets=(0.001, 0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        # Stream sessions.
        self.streams_open = gauge("framewire_streams_open", "Stream sessions open")
        self.stream_chunks = counter("framewire_stream_chunks", "Chunks read into stream sessions")
        self.stream_bytes = counter(
            "framewire_stream_bytes", "Source bytes read into stream sessions"
        )
        self.stream_uncopied_bytes = counter(
            "framewire_stream_uncopied_bytes",
            "Stream chunks' bytes the encoder read from the producer's pages",
        )
        self.stream_aborts = counter(
            "framewire_stream_aborts",
            "Stream sessions that ended without a file, by cause",
            ["cause"],  # deleted, idle, client, error, shutdown
        )
        # Live views of stream sessions.
        self.live_viewers = gauge("framewire_live_viewers", "Live viewers watching now")
        self.live_bytes = counter(
            "framewire_live_bytes", "Bytes sent to live viewers (counted as each one leaves)"
        )
        self.live_drops = counter(
            "framewire_live_drops",
            "Live viewers that ended before their stream did, by cause",
            ["cause"],  # too_slow (its queue overflowed), gone (it went away)
        )
        self.live_delay = histogram(
            "framewire_live_delay_seconds",
            "From a chunk handed to the encoder to the fragment holding its last frame",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32),
        )
        # The live views as HLS.
        self.hls_playlists = counter(
            "framewire_hls_playlists",
            "HLS playlist requests, by whether they asked for a blocking reload",
            ["blocking"],  # yes, no
        )
        self.hls_blocked = counter(
            "framewire_hls_blocked",
            "Blocking HLS playlist reloads, by how their wait ended",
            ["result"],  # ready, ended (the session), bound (BLOCK_MAX_S)
        )
        self.hls_media = counter(
            "framewire_hls_media",
            "HLS init segment, segment and part requests, by kind and result",
            ["kind", "result"],  # hit, waited (then hit), miss, gone (the history moved on)
        )
        self.hls_in_flight = gauge(
            "framewire_hls_requests_in_flight", "HLS requests being answered now"
        )
        # Reference decodes (the fd socket).
        self.fd_requests = counter(
            "framewire_fd_requests", "fd-socket requests by op and result code", ["op", "code"]
        )
        self.decodes = counter("framewire_decodes", "ffmpeg reference decodes run")
        # Requests naming an encoder (or decoder) this worker does not hold: their engine
        # saved with its own code instead (docs/engines.md).
        self.encoder_unavailable = counter(
            "framewire_encoder_unavailable",
            "Requests refused for an encoder identity this worker does not hold",
            ["kind"],
        )
        self.encoders_refused = gauge(
            "framewire_encoders_refused",
            "Encoders left out at the start: their colour check failed (core/media/colours.py)",
        )
        self.encoders_lost = gauge(
            "framewire_encoders_lost",
            "Encoder binaries held that no longer run (their requests are refused)",
        )
        self.decode_failures = counter("framewire_decode_failures", "Reference decodes that failed")
        self.decode_cache_hits = counter(
            "framewire_decode_cache_hits", "Decode requests answered from the cache"
        )
        self.decode_coalesced = counter(
            "framewire_decode_coalesced", "Decode requests that joined a decode already running"
        )
        self.decode_cache_bytes = gauge(
            "framewire_decode_cache_bytes", "Bytes of decoded frames held in the cache"
        )
        self.decode_cache_entries = gauge(
            "framewire_decode_cache_entries", "Decodes held in the cache"
        )
        self.staging_kept = gauge(
            "framewire_staging_kept", "Staging memfds kept between encodes, one memfd each"
        )
        self.staging_kept_bytes = gauge(
            "framewire_staging_kept_bytes", "Bytes of the staging memfds kept between encodes"
        )

    def show_limits(self, settings: object) -> None:
        for name in LIMITS:
            self.limits.labels(name).set(getattr(settings, name))
