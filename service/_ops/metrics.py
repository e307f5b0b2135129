"""Prometheus figures, one registry per app (tests run several apps in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
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
