"""The worker's parts, built once from its settings: what the routes and sockets serve from.

Building them finds and warms the GPUs (a CUDA context and the conversion kernels,
so the first request pays for neither).
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass

from framewire.core.media.process import resolve_ffmpeg
from framewire.service._convert import kernels
from framewire.service._decode.decoder import ReferenceDecoder
from framewire.service._encode.encoder import Encoder
from framewire.service._encode.jobs import EncodeJobs
from framewire.service._encode.prepare import Preparer
from framewire.service._encode.resources import EncodeResources
from framewire.service._encode.scheduler import Scheduler
from framewire.service._fdsocket.server import FdServer
from framewire.service._ops.metrics import Metrics
from framewire.service._settings import Settings
from framewire.service._sources.cuda_faults import HEALTH
from framewire.service._sources.cuda_ipc import CudaRuntime
from framewire.service._sources.regions import RegionRegistry
from framewire.service._store.uploads import Uploads
from framewire.service._stream.sessions import Sessions


@dataclass(frozen=True)
class Parts:
    settings: Settings
    encoder: Encoder
    metrics: Metrics
    cuda: CudaRuntime | None  # None without a usable GPU: cuda_ipc sources are refused
    regions: RegionRegistry
    scheduler: Scheduler
    resources: EncodeResources  # what jobs and sessions both run on
    jobs: EncodeJobs
    sessions: Sessions
    fd_server: FdServer
    instance: str  # this worker process, as /v1/info and the fd socket's ping name it

    @classmethod
    def build(cls, settings: Settings) -> Parts:
        kernels.use(settings.kernel)
        # Loaded beside the start-up, not in it: a first encode that comes sooner waits
        # on the kernels' lock instead of loading them in its own window.
        threading.Thread(target=kernels.warm, name="framewire-kernels", daemon=True).start()
        encoder = Encoder.from_settings(settings)
        metrics = Metrics()
        metrics.show_limits(settings)
        encoder.encoders.on_refusal = metrics.encoder_unavailable.labels("encode").inc
        metrics.encoders_lost.set_function(encoder.encoders.lost)
        metrics.staging_kept.set_function(lambda: encoder.kept.count)
        metrics.staging_kept_bytes.set_function(lambda: encoder.kept.kept_bytes)
        metrics.encoders_refused.set_function(lambda: len(encoder.encoders.refused))
        metrics.gpus_unusable.set_function(lambda: len(HEALTH.lost()))
        cuda = CudaRuntime.start(settings.cuda_warm)
        regions = RegionRegistry(
            settings.shm_prefixes,
            cuda,
            max_regions=settings.max_regions,
            max_per_owner=settings.max_regions_per_owner,
        )
        scheduler = Scheduler(
            settings.cpu_slots, settings.max_queue, user_limit=settings.per_user(settings.max_queue)
        )
        if cuda is not None:
            scheduler.gpu_budget = cuda.gpu_budget(scheduler.gpu_held)
        uploads = Uploads(settings)
        uploads.on_upload = lambda result: metrics.uploads.labels(result).inc()
        metrics.held_outputs.set_function(uploads.handoffs.held)
        metrics.held_output_bytes.set_function(uploads.handoffs.held_bytes)
        uploads.handoffs.on_expired = metrics.held_expired.inc
        prepare = Preparer(settings, regions, uploads, encoder.encoders, cuda)
        resources = EncodeResources(encoder, scheduler, uploads, prepare)
        jobs = EncodeJobs(settings, resources, metrics)
        sessions = Sessions(settings, resources, metrics)
        decode = encoder.encoders.binaries[0]  # the default encoder's, unless one is named
        if settings.decode_ffmpeg:
            decode = encoder.encoders.held(resolve_ffmpeg(settings.decode_ffmpeg))
        decoder = ReferenceDecoder(settings, decode, metrics)
        instance = secrets.token_hex(8)
        fd_server = FdServer(
            settings, decoder, regions, metrics, instance, resources.uploads.handoffs
        )
        return cls(
            settings,
            encoder,
            metrics,
            cuda,
            regions,
            scheduler,
            resources,
            jobs,
            sessions,
            fd_server,
            instance,
        )
