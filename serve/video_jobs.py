"""Video jobs: a bounded on-disk store of jobs and their MP4 files, and the tasks that run them.

A job is created at once (``queued``), follows its engine request's events (``in_progress`` with a
progress percentage from the step events), and ends ``completed`` (its MP4 on disk) or ``failed``
(with an ``error`` object). The store is bounded three ways: at most ``max_jobs`` jobs, at most
``max_bytes`` of MP4 files, and finished jobs expire ``ttl_s`` after they complete. A full store
refuses new jobs (429 + Retry-After) instead of growing. Files live in a private folder under
``root`` that the store removes when it closes: jobs do not outlive the server that ran them.
Each job belongs to the owner of the API key that created it (``serve.auth``; None on a server without
keys): ``get`` and ``list`` with another owner do not find it.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import logging
import os
import secrets
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from dit_core.errors import InvalidParamError
from dit_core.faults import NO_FAULTS
from dit_core.request import EventKind

from .errors import http_invalid, scrub
from .guards import Deadline, until_deadline

logger = logging.getLogger("omnidit.serve")


class StoreFullError(Exception):
    """The job store holds as many jobs or bytes as it may; ``retry_after_s`` says when to retry."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass
class VideoJob:
    id: str
    model: str
    prompt: str
    width: int
    height: int
    num_frames: int
    fps: int
    seq: int
    status: str = "queued"  # queued | in_progress | completed | failed
    progress: int = 0
    created_at: int = field(default_factory=lambda: int(time.time()))
    completed_at: int | None = None
    expires_at: int | None = None
    error: dict | None = None
    path: Path | None = None
    size_bytes: int = 0
    request_id: str | None = None
    task: asyncio.Task | None = None
    expiry: float | None = None  # time.time() when a finished job goes (expires_at, unrounded)
    owner: str | None = field(default=None, repr=False)  # the creating key's owner (serve.auth); never shown
    remixed_from: str | None = None  # the job this one remixes (POST /v1/videos/{id}/remix)
    # what a remix of this job reuses: the engine's model name and the resolved SamplingParams; never shown
    engine_model: str | None = field(default=None, repr=False)
    params: object = field(default=None, repr=False)

    @property
    def seconds(self) -> str:
        return f"{self.num_frames / self.fps:g}"

    def to_dict(self) -> dict:
        """The OpenAI ``Video`` object."""
        return {"id": self.id, "object": "video", "model": self.model, "status": self.status,
                "progress": self.progress, "created_at": self.created_at, "completed_at": self.completed_at,
                "expires_at": self.expires_at, "size": f"{self.width}x{self.height}", "seconds": self.seconds,
                "prompt": self.prompt, "remixed_from_video_id": self.remixed_from, "error": self.error,
                # omnidit's additions
                "num_frames": self.num_frames, "fps": self.fps}


class VideoJobStore:
    """Jobs by id, in creation order, with their MP4 files in a private folder under ``root``."""

    def __init__(self, root: str | Path | None = None, max_jobs: int = 64, max_bytes: int = 256 << 20,
                 ttl_s: float = 3600.0, retry_after_s: int = 5):
        if root is not None:
            Path(root).mkdir(parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix="omnidit-videos-", dir=root))
        self.max_jobs, self.max_bytes, self.ttl_s, self.retry_after_s = max_jobs, max_bytes, ttl_s, retry_after_s
        self._jobs: dict[str, VideoJob] = {}
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self.faults = NO_FAULTS  # the engine's fault-injection points (the app sets them)

    @property
    def used_bytes(self) -> int:
        return sum(j.size_bytes for j in self._jobs.values())

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._jobs)

    def create(self, **fields) -> VideoJob:
        """A new queued job, or StoreFullError when the store holds ``max_jobs`` jobs or ``max_bytes``."""
        with self._lock:
            self._expire()
            if len(self._jobs) >= self.max_jobs:
                raise StoreFullError(f"the video store holds its maximum of {self.max_jobs} jobs; delete finished "
                                     "ones or retry later", self.retry_after_s)
            if self.used_bytes >= self.max_bytes:
                raise StoreFullError(f"the video store holds its maximum of {self.max_bytes} bytes; delete finished "
                                     "ones or retry later", self.retry_after_s)
            job = VideoJob(id="video_" + secrets.token_hex(16), seq=next(self._seq), **fields)
            self._jobs[job.id] = job
            return job

    def get(self, job_id: str, owner: str | None = None) -> VideoJob | None:
        """The job, if it exists and ``owner`` created it."""
        with self._lock:
            self._expire()
            job = self._jobs.get(job_id)
        return job if job is not None and job.owner == owner else None

    def list(self, limit: int = 20, after: str | None = None, order: str = "desc",
             owner: str | None = None) -> tuple[list[VideoJob], bool]:
        """A page of ``owner``'s jobs by creation time, after the job ``after``; returns (jobs, has_more)."""
        with self._lock:
            self._expire()
            jobs = sorted((j for j in self._jobs.values() if j.owner == owner), key=lambda j: j.seq,
                          reverse=order == "desc")
        if after is not None:
            ids = [j.id for j in jobs]
            if after not in ids:  # not silently an empty page: the client would take it for the end
                raise InvalidParamError("after", after, "the id of a video of yours that has not expired or been "
                                                        "deleted (list again without after to start over)")
            jobs = jobs[ids.index(after) + 1:]
        return jobs[:limit], len(jobs) > limit

    def complete(self, job: VideoJob, mp4: bytes) -> None:
        """Store the job's MP4 (or fail the job if it would pass ``max_bytes``). Blocking: the file is
        written outside the store's lock (its bytes reserved meanwhile), so ``run_job`` calls this in a
        worker thread and the event loop, and every other store call, go on while it writes."""
        with self._lock:
            if job.id not in self._jobs:  # deleted while it was encoding
                return
            if self.used_bytes + len(mp4) > self.max_bytes:
                self._finish(job, "failed", error={"code": "storage_full", "message": (
                    f"the finished video ({len(mp4)} bytes) does not fit the store's {self.max_bytes} bytes")})
                return
            job.size_bytes = len(mp4)  # reserved while the file is written
        path = self.dir / f"{job.id}.mp4"
        try:
            self.faults.hit("file_store", [job.prompt])
            self.write_file(path, mp4)
        except OSError as e:  # a full or failing disk fails this job, not the server
            logger.error("video job %s: writing its MP4 failed: %r", job.id, e)
            path.unlink(missing_ok=True)
            with self._lock:
                job.size_bytes = 0
                self._finish(job, "failed", error={"code": "storage_full" if e.errno == errno.ENOSPC else
                                                   "storage_error", "message": "the video could not be stored: "
                                                   f"{os.strerror(e.errno) if e.errno else 'write failed'}"})
            return
        except BaseException:
            path.unlink(missing_ok=True)
            job.size_bytes = 0
            raise
        with self._lock:
            kept = job.id in self._jobs
            if kept:
                job.path, job.progress = path, 100
                self._finish(job, "completed")
        if not kept:  # deleted (or the store closed) while it was written
            path.unlink(missing_ok=True)

    @staticmethod
    def write_file(path: Path, data: bytes) -> None:
        """Write one finished MP4 (blocking; ``complete`` calls it off the event loop)."""
        path.write_bytes(data)

    def fail(self, job: VideoJob, code: str, message: str) -> None:
        with self._lock:
            self._finish(job, "failed", error={"code": code, "message": scrub(message)})

    def delete(self, job_id: str) -> VideoJob | None:
        with self._lock:
            job = self._jobs.pop(job_id, None)
        if job is not None and job.path is not None:
            job.path.unlink(missing_ok=True)
        return job

    def close(self) -> None:
        """Remove every job and the store's folder."""
        with self._lock:
            self._jobs.clear()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _finish(self, job: VideoJob, status: str, error: dict | None = None) -> None:
        now = time.time()
        job.status, job.error = status, error
        job.completed_at, job.expiry = int(now), now + self.ttl_s
        job.expires_at = int(job.expiry)

    def _expire(self) -> None:
        now = time.time()
        for job in [j for j in self._jobs.values() if j.expiry is not None and j.expiry <= now]:
            del self._jobs[job.id]
            if job.path is not None and job.path.exists():
                os.unlink(job.path)


async def run_job(store: VideoJobStore, client, job: VideoJob, events, encode,
                  deadline: Deadline | None = None) -> None:
    """Follow a job's engine events to its end (``client``: the app's ``EngineClient``, ``events`` the
    stream handle its ``submit`` returned); ``encode(output) -> bytes`` makes the MP4. Past ``deadline``
    (the server's request timeout) the request is aborted and the job fails with ``request_timeout``."""
    try:
        async for event in until_deadline(client.events(job.request_id, events), deadline):
            if event.kind == EventKind.STEP:
                job.status = "in_progress"
                job.progress = min(99, int(100 * event.step / max(event.total, 1)))
            elif event.kind == EventKind.FINISHED:
                job.progress = 99
                mp4 = await asyncio.to_thread(encode, event.output)
                await asyncio.to_thread(store.complete, job, mp4)  # the disk write, off the event loop
            elif event.kind == EventKind.FAILED and event.invalid is not None:  # refused at admission for its
                # own field (an adapter unloaded after the route's check): what a synchronous request gets as a 400
                store.fail(job, "invalid_value", str(http_invalid(InvalidParamError(*event.invalid))))
            elif event.kind == EventKind.FAILED:
                store.fail(job, "generation_failed", event.error or "the generation failed")
            elif event.kind == EventKind.ABORTED:
                store.fail(job, "aborted", event.error or "the job was aborted")
    except asyncio.CancelledError:  # DELETE or shutdown: leaving the event stream aborts the request
        raise
    except TimeoutError:  # the pending read of the event stream was cancelled: the request is aborted
        store.fail(job, "request_timeout", f"{deadline.reason}; the job was aborted")
    except Exception as e:  # noqa: BLE001 - reported in the job, never a hung status
        logger.exception("video job %s failed outside the engine", job.id)
        store.fail(job, "internal", f"{type(e).__name__}: {e}")
