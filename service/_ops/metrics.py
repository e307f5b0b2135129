"""Prometheus figures, one registry per app (tests run several apps in one process)."""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector


def memfds_open() -> int:
    """The memfds this process holds (decoded references, staged frames, audio): what a
    leak of them would grow."""
    count = 0
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return 0
    for name in names:
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("/memfd:"):
                count += 1
        except OSError:
            continue  # closed while counted
    return count


# The settings exported as framewire_limit{setting}, so that alerts can read a gauge's
# share of its bound rather than a threshold copied from the defaults.
LIMITS = ("cpu_slots", "max_queue", "max_streams", "max_viewers", "max_regions",
          "decode_cache_bytes")  # fmt: skip


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # process_open_fds, process_max_fds, process_resident_memory_bytes, CPU seconds.
        ProcessCollector(registry=r)
        Gauge("framewire_memfds", "memfds the worker holds open", registry=r).set_function(
            memfds_open
        )
        self.ready = Gauge("framewire_ready", "1 while the worker can encode (/readyz)", registry=r)
        self.limits = Gauge(
            "framewire_limit", "The worker's bounds, by setting", ["setting"], registry=r
        )
        self.uploads = Counter(
            "framewire_store_uploads",
            "Object-store uploads by result: ok, or the error code",
            ["result"],
            registry=r,
        )
        self.requests = Counter(
            "framewire_requests",
            "HTTP requests by route and status",
            ["route", "status"],
            registry=r,
        )
        self.encode_seconds = Histogram(
            "framewire_encode_seconds",
            "Wall time of one output's encode",
            ["route"],
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=r,
        )
        self.bytes_written = Counter("framewire_bytes_written", "MP4 bytes written", registry=r)
        self.outputs = Counter("framewire_outputs", "Outputs by result", ["result"], registry=r)
        self.fallbacks = Counter(
            "framewire_fallbacks", "Outputs redone on the fallback route", registry=r
        )
        self.in_flight = Gauge("framewire_encodes_in_flight", "Encodes running now", registry=r)
        self.queue_waiting = Gauge(
            "framewire_encodes_waiting", "Encodes waiting for CPU slots", registry=r
        )
        self.queue_seconds = Histogram(
            "framewire_queue_wait_seconds",
            "Time an encode waited for its slots",
            buckets=(0.001, 0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r,
        )
        # Stream sessions.
        self.streams_open = Gauge("framewire_streams_open", "Stream sessions open", registry=r)
        self.stream_chunks = Counter(
            "framewire_stream_chunks", "Chunks read into stream sessions", registry=r
        )
        self.stream_bytes = Counter(
            "framewire_stream_bytes", "Source bytes read into stream sessions", registry=r
        )
        self.stream_aborts = Counter(
            "framewire_stream_aborts",
            "Stream sessions that ended without a file, by cause",
            ["cause"],  # deleted, idle, client, error, shutdown
            registry=r,
        )
        # Live views of stream sessions.
        self.live_viewers = Gauge("framewire_live_viewers", "Live viewers watching now", registry=r)
        self.live_bytes = Counter(
            "framewire_live_bytes", "Bytes sent to live viewers (counted as each one leaves)",
            registry=r,
        )  # fmt: skip
        self.live_drops = Counter(
            "framewire_live_drops",
            "Live viewers that ended before their stream did, by cause",
            ["cause"],  # too_slow (its queue overflowed), gone (it went away)
            registry=r,
        )
        self.live_delay = Histogram(
            "framewire_live_delay_seconds",
            "From a chunk handed to the encoder to the fragment holding its last frame",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32),
            registry=r,
        )
        # The live views as HLS.
        self.hls_playlists = Counter(
            "framewire_hls_playlists",
            "HLS playlist requests, by whether they asked for a blocking reload",
            ["blocking"],  # yes, no
            registry=r,
        )
        self.hls_blocked = Counter(
            "framewire_hls_blocked",
            "Blocking HLS playlist reloads, by how their wait ended",
            ["result"],  # ready, ended (the session), bound (BLOCK_MAX_S)
            registry=r,
        )
        self.hls_media = Counter(
            "framewire_hls_media",
            "HLS init segment, segment and part requests, by kind and result",
            ["kind", "result"],  # hit, waited (then hit), miss, gone (the history moved on)
            registry=r,
        )
        self.hls_in_flight = Gauge(
            "framewire_hls_requests_in_flight", "HLS requests being answered now", registry=r
        )
        # Reference decodes (the fd socket).
        self.fd_requests = Counter(
            "framewire_fd_requests",
            "fd-socket requests by op and result code",
            ["op", "code"],
            registry=r,
        )
        self.decodes = Counter("framewire_decodes", "ffmpeg reference decodes run", registry=r)
        # Requests naming an encoder (or decoder) this worker does not hold: their engine
        # saved with its own code instead (docs/engines.md).
        self.encoder_unavailable = Counter(
            "framewire_encoder_unavailable",
            "Requests refused for an encoder identity this worker does not hold",
            ["kind"],
            registry=r,
        )
        self.decode_failures = Counter(
            "framewire_decode_failures", "Reference decodes that failed", registry=r
        )
        self.decode_cache_hits = Counter(
            "framewire_decode_cache_hits", "Decode requests answered from the cache", registry=r
        )
        self.decode_coalesced = Counter(
            "framewire_decode_coalesced",
            "Decode requests that joined a decode already running",
            registry=r,
        )
        self.decode_cache_bytes = Gauge(
            "framewire_decode_cache_bytes", "Bytes of decoded frames held in the cache", registry=r
        )
        self.decode_cache_entries = Gauge(
            "framewire_decode_cache_entries", "Decodes held in the cache", registry=r
        )

    def show_limits(self, settings: object) -> None:
        for name in LIMITS:
            self.limits.labels(name).set(getattr(settings, name))
