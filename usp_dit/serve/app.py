"""The HTTP API (FastAPI), served by uvicorn in a thread of rank 0.

Layout: no tensors; a finished job's output is (n, height, width, 3) or (1, frames, height, width,
3) float32 in [0, 1] (``usp_dit.serve.worker``), encoded here.

Every error is a JSON body in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``:
400 bad input (checked here, before any rank sees it), 404 unknown video, 409 video content not
ready, 429 queue full (with Retry-After), 500 the pipeline raised (the message says on which rank),
503 starting, draining or failed.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response

from usp_dit.serve.encode import images_json, npy_b64, png_b64
from usp_dit.serve.jobs import Job, Scheduler, ServeError
from usp_dit.serve.loras import Registry
from usp_dit.serve.metrics import Metrics
from usp_dit.serve.protocol import BadRequest, Limits, check_image_request, check_video_request


@dataclass
class ServerState:
    """What the HTTP side shares with the serving loop (rank 0)."""

    limits: Limits
    scheduler: Scheduler
    metrics: Metrics = field(default_factory=Metrics)
    health: str = "starting"  # starting (warm-up), ready, draining, failed
    video_error: str | None = None  # why /v1/videos is off (an image family, no MP4 writer)
    mean_batch_s: float = 1.0  # for Retry-After
    loras: Registry = field(default_factory=Registry)  # Note [served LoRA]


def _error(status: int, message: str, kind: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


def _serve_error(err: ServeError) -> JSONResponse:
    headers = {"Retry-After": str(err.retry_after)} if err.retry_after is not None else None
    return _error(err.status, str(err), err.kind, headers=headers)


async def _json(request: Request) -> object:
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise BadRequest(f"the body is not JSON: {err}") from None


def _video_object(job: Job, limits: Limits) -> dict:
    shape = job.params.shape
    return {
        "id": job.id, "object": "video", "model": limits.model_id, "status": job.status,
        "progress": round(100 * job.progress), "created_at": int(job.created),
        "size": f"{shape.width}x{shape.height}", "num_frames": shape.num_frames,
        "seconds": str(round(shape.num_frames / job.params.fps, 3)), "seed": job.params.seed, "replica": job.replica,
        "error": None if job.error is None else {"message": job.error},
    }


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="usp_dit", docs_url=None, redoc_url=None)
    sched, metrics, limits = state.scheduler, state.metrics, state.limits

    def retry_after() -> int:
        return max(1, int(state.mean_batch_s * (1 + sched.depth() / max(1, sched.max_batch)) + 0.5))

    def submit(job: Job) -> None:
        try:
            sched.submit(job, retry_after())
        except ServeError as err:
            metrics.failures.labels("full" if err.status == 429 else "refused").inc()
            raise

    @app.post("/v1/images/generations")
    async def images(request: Request):
        arrived = time.perf_counter()
        try:
            params = check_image_request(await _json(request), limits, state.loras.resolve)
            job = Job("image", params)
            submit(job)
            output = await asyncio.wrap_future(job.future)
        except BadRequest as err:
            metrics.failures.labels("rejected").inc()
            metrics.requests.labels("image", "400").inc()
            return _error(400, str(err), "invalid_request_error", err.param)
        except ServeError as err:
            metrics.requests.labels("image", str(err.status)).inc()
            return _serve_error(err)
        encode = npy_b64 if params.output_format == "npy" else png_b64
        fields = {"created": int(job.created), "output_format": params.output_format, "seed": params.seed,
                  "batch_size": job.batch_size, "replica": job.replica}
        body = await run_in_threadpool(lambda: images_json(fields, [encode(image) for image in output]))
        metrics.latency.labels("image").observe(time.perf_counter() - arrived)
        metrics.requests.labels("image", "200").inc()
        return Response(body, media_type="application/json")

    @app.post("/v1/videos")
    async def create_video(request: Request):
        try:
            if state.video_error is not None:
                raise BadRequest(state.video_error, param="model")
            job = Job("video", check_video_request(await _json(request), limits, state.loras.resolve))
            submit(job)
        except BadRequest as err:
            metrics.failures.labels("rejected").inc()
            metrics.requests.labels("video", "400").inc()
            return _error(400, str(err), "invalid_request_error", err.param)
        except ServeError as err:
            metrics.requests.labels("video", str(err.status)).inc()
            return _serve_error(err)
        metrics.requests.labels("video", "200").inc()
        return _video_object(job, limits)

    @app.get("/v1/videos/{video_id}")
    async def get_video(video_id: str):
        try:
            return _video_object(sched.video(video_id), limits)
        except ServeError as err:
            return _serve_error(err)

    @app.get("/v1/videos/{video_id}/content")
    async def video_content(video_id: str):
        try:
            job = sched.video(video_id)
        except ServeError as err:
            return _serve_error(err)
        if job.status != "completed" or job.content is None:
            return _error(409, f"video {video_id} is {job.status}, not completed", "invalid_request_error")
        return Response(job.content, media_type="video/mp4")

    @app.delete("/v1/videos/{video_id}")
    async def delete_video(video_id: str):
        try:
            return _video_object(sched.cancel_video(video_id), limits)
        except ServeError as err:
            return _serve_error(err)

    @app.post("/v1/loras")
    async def add_lora(request: Request):
        """Register an adapter: {"name", "path"}; every rank loads it before its next batch."""
        try:
            body = await _json(request)
            if not isinstance(body, dict) or set(body) - {"name", "path"}:
                raise BadRequest("the body must be {\"name\": ..., \"path\": ...}", param="body")
            return await run_in_threadpool(state.loras.add, body.get("name"), body.get("path"))
        except BadRequest as err:
            return _error(400, str(err), "invalid_request_error", err.param)
        except ServeError as err:
            return _serve_error(err)

    @app.get("/v1/loras")
    async def list_loras():
        return state.loras.listing()

    @app.delete("/v1/loras/{name}")
    async def remove_lora(name: str):
        try:
            return state.loras.remove(name)
        except ServeError as err:
            return _serve_error(err)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": limits.model_id, "object": "model", "created": 0,
                                            "owned_by": "usp_dit"}]}

    @app.get("/health")
    async def health():
        body = {"status": state.health, "queue": sched.depth(), "running": len(sched.running)}
        return JSONResponse(body, status_code=200 if state.health == "ready" else 503)

    @app.get("/metrics")
    async def prometheus():
        metrics.queue_depth.set(sched.depth())
        metrics.running.set(len(sched.running))
        metrics.read_gpu_memory()
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    return app
