"""The server (``usp_dit.serve``) under torchrun, over real HTTP on 127.0.0.1, against the pipeline
run in one process.

Three process start-ups: one server of 4 ranks (tiny Wan, Ulysses 2 x Ring 2, gloo) serves every case
in file order and ends with the SIGTERM drain; one of 4 ranks as two replicas of Ulysses 2 (Note
[replicas]) serves images, videos, cancellations and faults on both; one of 2 ranks is killed
(SIGKILL of rank 1) mid-request.

Tolerances (max |diff| / max |one process|):
  * 1e-4 for a served image against the same request run by the stock pipeline in this process:
    the grid's float32 rounding (~1e-6 in the transformer) grows through the denoising steps and
    the tiny random VAE, whose gain is large (usp_dit.cli.launch.MATCH_TOLERANCE, the examples' check);
  * 1e-5 for a request served in a batch of 4 against the same request served alone: the same
    grid, only the batched matmuls' rounding differs;
  * PNGs through the official openai client: at most 1 level of 255 from the reference rounded the
    same way (a value within float rounding of a rounding boundary may land on either side).
"""
from __future__ import annotations

import base64
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT = 240  # s: four ranks import torch, Diffusers and build the tiny pipeline on a shared 2-core machine
SIZE = (80, 48)  # width, height: 5 x 3 = 15 tokens a frame, divided by neither 2 nor 4
FAULT_RANK = 2
FAULT_SENTINEL = "usp-dit-fault"  # usp_dit.serve.worker.FAULT_SENTINEL


# ---------------------------------------------------------------------------------------------
# Helpers: a free port, a server under torchrun, HTTP with the standard library



def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Server:
    def __init__(self, log: Path, ranks: int, *flags: str, env: dict | None = None):
        # --port 0: the server binds a port the kernel picks and names it in --port-file. A port picked
        # free here was taken before the server bound it once (CI: another job's gloo connections).
        self.port: int | None = None
        self.port_file = log.with_suffix(".port")
        self.log = log
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               "-m", "usp_dit.serve", "--family", "wan", "--port", "0", "--port-file", str(self.port_file), *flags]
        full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the server exited with {self.proc.returncode}:\n{self.tail()}"
            if self.port is None and self.port_file.exists():
                self.port = int(self.port_file.read_text())
            try:
                if self.port is not None and _get(self.url + "/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"the server was not ready within {START_TIMEOUT} s:\n{self.tail()}")

    @property
    def url(self) -> str:
        if self.port is None:
            raise AssertionError("the server has not named its port yet (call wait_ready first)")
        return f"http://127.0.0.1:{self.port}"

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text().splitlines()[-lines:])

    def failure_context(self) -> str:
        """For a failed test's report (tests/conftest.py): each rank's state and memory, the machine's
        free memory, and the log's tail (every rank's stacks are in it when a batch stalled)."""
        rows = []
        for rank, pid in sorted(self.rank_pids().items()):
            status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                          if ":" in line)
            rows.append(f"rank {rank} pid {pid}: {status['State'].strip()}, RSS {status['VmRSS'].strip()}, "
                        f"threads {status['Threads'].strip()}")
        meminfo = Path("/proc/meminfo").read_text().splitlines()
        free = [line for line in meminfo if line.startswith(("MemTotal", "MemAvailable"))]
        noise = ("Warning", "warn(", "W1", "torchao")
        log = [line for line in self.log.read_text().splitlines() if not line.lstrip().startswith(noise)]
        return "\n".join([*rows, *free, "--- server log (last 200 lines) ---", *log[-200:]])

    def rank_pids(self) -> dict[int, int]:
        ranks = {}
        for pid in _children(self.proc.pid):
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:  # the rank exited meanwhile
                continue
            rank = [e for e in env if e.startswith(b"RANK=")]
            if rank:
                ranks[int(rank[0][5:])] = pid
        return ranks

    def stop(self) -> None:
        if self.proc.poll() is None:
            # torchrun starts each worker in a session of its own: killing torchrun's group alone
            # would leave the ranks running, orphaned (seen: idle servers heartbeating for hours).
            workers = list(self.rank_pids().values())
            for pid in [-self.proc.pid, *workers]:  # the group, then each rank; any may be gone by now
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.proc.wait(30)


def _request(method: str, url: str, body: object = None, raw: bytes | None = None, timeout: float = 120):
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as err:
        return err.code, err.read(), dict(err.headers)


def _get(url: str, timeout: float = 10):
    return _request("GET", url, timeout=timeout)


def _post(url: str, body: object, timeout: float = 120) -> tuple[int, dict]:
    status, payload, _ = _request("POST", url, body, timeout=timeout)
    return status, json.loads(payload)


def _npy(item: dict) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(item["b64_json"])))


def _rel(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(a.astype(np.float64) - ref).max() / max(np.abs(ref).max(), 1e-12))


def _image_body(prompt: str, seed: int, steps: int = 2, **extra) -> dict:
    return {"prompt": prompt, "seed": seed, "steps": steps, "size": f"{SIZE[0]}x{SIZE[1]}", "guidance": 3.0,
            "output_format": "npy", **extra}


# ---------------------------------------------------------------------------------------------
# Fixtures: the 4-rank server, and the stock pipeline in this process


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("serve") / "server4.log", 4, "--ulysses", "2", "--ring", "2",
                 "--max-batch", "4", "--queue-size", "80", "--warmup", f"{SIZE[0]}x{SIZE[1]}", "--steps", "2",
                 "--hang-timeout", "90",  # a stalled batch: stacks logged at 45 s, everything answered at 90
                 # the drain test's video (20 steps) and two queued images must finish after SIGTERM
                 # even on a loaded 2-core CI machine (the 25 s default was exceeded there once)
                 "--drain-timeout", "90",
                 env={"USP_DIT_SERVE_FAULT_RANK": str(FAULT_RANK)})
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def reference():
    """The stock WanPipeline of the same seeded tiny weights, one process: request -> image(s)."""
    import torch

    from usp_dit.demo.tiny_wan import tiny_wan_pipeline
    from usp_dit.serve.families import TINY_TEXT_LEN

    pipe = tiny_wan_pipeline(max_text_len=TINY_TEXT_LEN)
    pipe.set_progress_bar_config(disable=True)

    def run(prompt: str, seed: int, steps: int = 2, frames: int = 1) -> np.ndarray:
        out = pipe(prompt=prompt, height=SIZE[1], width=SIZE[0], num_frames=frames, num_inference_steps=steps,
                   guidance_scale=3.0, generator=torch.Generator().manual_seed(seed),
                   max_sequence_length=TINY_TEXT_LEN, output_type="np")
        return out.frames[0, 0] if frames == 1 else out.frames[0]

    return run


@pytest.fixture(scope="module")
def ready(server, reference):
    """The server, once it answers /health with 200 (the reference pipeline built meanwhile)."""
    server.wait_ready()
    return server


# ---------------------------------------------------------------------------------------------
# The listening socket: --port 0 takes a port the kernel picks; a taken port fails with its reason


def test_port_zero_listens_and_a_taken_port_or_a_bad_one_is_refused():
    from usp_dit.cli.launch import UsageError
    from usp_dit.serve.server import _listen, parse_args

    with _listen("127.0.0.1", 0) as first:
        port = first.getsockname()[1]
        assert port > 0
        with pytest.raises(RuntimeError, match=f"cannot listen on 127.0.0.1:{port} .*[Aa]ddress already in use"):
            _listen("127.0.0.1", port)
    for bad in ("-1", "65536"):
        with pytest.raises(UsageError, match=f"--port {bad}: a TCP port is 0"):
            parse_args(["--family", "wan", "--port", bad])
    assert parse_args(["--family", "wan", "--port", "0", "--port-file", "p"]).port_file == "p"


# ---------------------------------------------------------------------------------------------
# The queue alone (no process): 429 when full, batching by call shape up to --max-batch, FIFO


def test_queue_is_bounded_and_batches_compatible_requests_in_order():
    from usp_dit.serve.families import CallShape
    from usp_dit.serve.jobs import Job, Scheduler, ServeError
    from usp_dit.serve.protocol import Params

    small, large = CallShape(80, 48, 1, 2, None, None), CallShape(160, 48, 1, 2, None, None)
    sched = Scheduler(max_queue=5, max_batch=4)
    sched.start_accepting()
    jobs = [Job("image", Params(shape, f"p{i}", i, n)) for i, (shape, n) in
            enumerate([(small, 1), (large, 1), (small, 2), (small, 2), (small, 1)])]
    for job in jobs:
        sched.submit(job)
    with pytest.raises(ServeError) as full:
        sched.submit(Job("image", Params(small, "one too many", 9, 1)), retry_after=3)
    assert full.value.status == 429 and full.value.retry_after == 3
    first = sched.next_batch(timeout=0)
    assert first == [jobs[0], jobs[2], jobs[4]]  # 1 + 2 + 1 images; jobs[3]'s 2 would make 6 > 4
    assert {j.batch_size for j in first} == {4}
    sched.finish(first, "completed", result=lambda job: job.params.prompt)
    assert [j.future.result() for j in first] == ["p0", "p2", "p4"]
    assert sched.next_batch(timeout=0) == [jobs[1]]  # the head goes first, whatever its shape
    sched.stop_accepting(ServeError(503, "draining"))
    with pytest.raises(ServeError, match="draining"):
        sched.submit(Job("image", Params(small, "late", 0, 1)))
    assert sched.fail_queued(ServeError(503, "stopped")) == 1 and jobs[3].future.exception().status == 503


@pytest.mark.parametrize("height, width", [(1, 1), (1, 9), (7, 5), (33, 17)])
def test_png_answers_decode_to_the_same_pixels(height, width):
    """The server's own PNG writer (Up-filtered rows, stdlib zlib) read back by Pillow, an independent
    decoder: every byte equal, on odd sizes, a one-row image (no row above: the filter is the row
    itself) and rows whose differences wrap below 0 and above 255 (the filter's mod-256 arithmetic),
    encoded in one band of rows and in many (each band converting and filtering from the row above
    it, the joined raw deflate streams under one Adler-32), from uint8 and from float pixels."""
    from PIL import Image

    from usp_dit.serve.encode import png_b64, png_bytes, to_uint8

    rng = np.random.default_rng(height * 100 + width)
    rgb = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    rgb[::2] = 255 - rgb[::2] // 7  # alternate bright and dark rows: differences that wrap
    pixels = rng.random((height, width, 3), dtype=np.float32) * 1.2 - 0.1  # some outside [0, 1]: clipped
    for level, band in ((0, 1 << 20), (1, 1 << 20), (9, 1 << 20), (1, 7), (1, 64)):  # 7, 64: many bands
        for image, want in ((rgb, rgb), (pixels, to_uint8(pixels))):
            back = np.asarray(Image.open(io.BytesIO(png_bytes(image, level, band))))
            assert back.dtype == np.uint8 and back.shape == want.shape and np.array_equal(back, want)
    decoded = np.asarray(Image.open(io.BytesIO(base64.b64decode(png_b64(pixels)))))
    assert np.array_equal(decoded, to_uint8(pixels))
    with pytest.raises(ValueError, match="uint8"):
        png_bytes(rgb.astype(np.int16))


def test_the_images_answer_is_the_json_of_its_fields_and_images():
    """``images_json`` splices base64 bytes into the body instead of ``json.dumps``-ing them: it must
    parse to exactly the dict the plain route would have sent, for 0, 1 and 3 images, with and
    without other fields."""
    from usp_dit.serve.encode import images_json

    images = [base64.b64encode(bytes(range(n, n + 40))) for n in (0, 7, 200)]
    fields = {"created": 17, "output_format": "png", "seed": 3, "replica": 0, "note": 'a "quoted" é'}
    for count in (0, 1, 3):
        for head in (fields, {}):
            body = json.loads(images_json(head, images[:count]))
            assert body == {**head, "data": [{"b64_json": image.decode()} for image in images[:count]]}


def test_a_stalled_batch_logs_every_threads_stack_and_a_rearmed_one_does_not(capfd):
    import time as _time

    from usp_dit.serve.worker import _stall_dump

    with _stall_dump(0.3) as rearm:
        for _ in range(4):  # steps that end in time: each re-arms the clock
            _time.sleep(0.15)
            rearm()
    assert "Thread" not in capfd.readouterr().err
    with _stall_dump(0.2):
        _time.sleep(0.6)  # a step that never ends
    err = capfd.readouterr().err
    assert "Timeout (0:00:00.200000)!" in err and "test_a_stalled_batch_logs_every_threads_stack" in err
    with _stall_dump(None):  # off
        _time.sleep(0.05)


# ---------------------------------------------------------------------------------------------
# The 4-rank server, in file order


def test_health_models_and_metrics(ready):
    status, body, _ = _get(ready.url + "/health")
    assert status == 200 and json.loads(body)["status"] == "ready"
    status, body, _ = _get(ready.url + "/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["id"] == "usp-dit-wan-tiny"
    status, body, _ = _get(ready.url + "/metrics")
    text = body.decode()
    for name in ("usp_dit_queue_depth", "usp_dit_running_requests", "usp_dit_request_latency_seconds",
                 "usp_dit_step_seconds_bucket", "usp_dit_failures_total", "usp_dit_ready 1.0"):
        assert name in text, name


def test_image_over_http_equals_one_process(ready, reference):
    status, body = _post(ready.url + "/v1/images/generations", _image_body("a red fox in snow", seed=7, n=2))
    assert status == 200, body
    assert body["seed"] == 7 and len(body["data"]) == 2
    first, second = (_npy(item) for item in body["data"])
    assert first.shape == (SIZE[1], SIZE[0], 3)
    assert _rel(first, reference("a red fox in snow", 7)) <= 1e-4
    assert _rel(second, reference("a red fox in snow", 8)) <= 1e-4  # image i of a request: seed + i


def test_image_through_the_openai_client(ready, reference):
    openai = pytest.importorskip("openai")
    from PIL import Image

    client = openai.OpenAI(base_url=ready.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == ["usp-dit-wan-tiny"]
    result = client.images.generate(model="usp-dit-wan-tiny", prompt="a lighthouse", n=1, size=f"{SIZE[0]}x{SIZE[1]}",
                                    response_format="b64_json", extra_body={"seed": 11, "steps": 2, "guidance": 3.0})
    png = np.asarray(Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json))).convert("RGB"), dtype=np.int16)
    ref = (np.clip(reference("a lighthouse", 11), 0, 1) * 255).round().astype(np.int16)
    assert png.shape == ref.shape and int(np.abs(png - ref).max()) <= 1
    with pytest.raises(openai.BadRequestError, match="steps 0"):
        client.images.generate(prompt="x", size=f"{SIZE[0]}x{SIZE[1]}", extra_body={"steps": 0})


BAD_REQUESTS = [  # (endpoint, body, the field the 400 names)
    ("images", {"prompt": "x", "size": "81x48"}, "size"),  # not a multiple of 16 pixels
    ("images", {"prompt": "x", "size": "80x4096"}, "size"),  # beyond the tiny model's side
    ("images", {"prompt": "x", "size": "big"}, "size"),
    ("images", {"prompt": "x", "steps": 0}, "steps"),
    ("images", {"prompt": "x", "steps": -3}, "steps"),
    ("images", {"prompt": "x", "steps": "two"}, "steps"),
    ("images", {"prompt": "x", "n": 5}, "n"),  # above --max-batch 4
    ("images", {"prompt": "x", "n": 0}, "n"),
    ("images", {"prompt": "x" * 65}, "prompt"),  # the tiny text encoder takes 64 characters
    ("images", {"prompt": ""}, "prompt"),
    ("images", {"prompt": 3}, "prompt"),
    ("images", {"size": "80x48"}, "prompt"),
    ("images", {"prompt": "x", "stpes": 2}, "stpes"),  # an unknown field: no silent default
    ("images", {"prompt": "x", "response_format": "url"}, "response_format"),
    ("images", {"prompt": "x", "seed": -1}, "seed"),
    ("images", {"prompt": "x", "guidance": "high"}, "guidance"),
    ("images", {"prompt": "x", "model": "dall-e-3"}, "model"),
    ("images", ["not", "an", "object"], None),
    ("videos", {"prompt": "x", "num_frames": 4}, "num_frames"),  # Wan: 4k + 1 frames
    ("videos", {"prompt": "x", "seconds": "long"}, "seconds"),
]


def test_bad_input_is_refused_before_any_rank(ready):
    before = _metric(ready, 'usp_dit_batch_images_count')
    for endpoint, body, param in BAD_REQUESTS:
        url = ready.url + ("/v1/images/generations" if endpoint == "images" else "/v1/videos")
        status, answer = _post(url, body)
        assert status == 400, (body, answer)
        assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["message"]
        assert answer["error"]["param"] == param, (body, answer)
    status, payload, _ = _request("POST", ready.url + "/v1/images/generations", raw=b"{not json")
    assert status == 400 and b"not JSON" in payload
    assert _metric(ready, 'usp_dit_batch_images_count') == before  # no batch ran


def _metric(server: Server, name: str) -> float:
    for line in _get(server.url + "/metrics")[1].decode().splitlines():
        if line.split(" ")[0] == name:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_64_requests_8_in_flight_answered_once_each(ready):
    key = 'usp_dit_requests_total{kind="image",status="200"}'
    before = _metric(ready, key)

    def one(i: int):
        return _post(ready.url + "/v1/images/generations", _image_body(f"prompt {i}", seed=1000 + i, steps=1))

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(one, range(64)))
    assert all(status == 200 for status, _ in answers), [b for s, b in answers if s != 200][:2]
    assert sorted(body["seed"] for _, body in answers) == list(range(1000, 1064))
    assert all(len(body["data"]) == 1 for _, body in answers)
    assert _metric(ready, key) - before == 64
    assert max(body["batch_size"] for _, body in answers) > 1  # the queue filled and batches formed


def _wait_status(server: Server, video_id: str, wanted: set[str], timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, body, _ = _get(f"{server.url}/v1/videos/{video_id}")
        assert status == 200, body
        job = json.loads(body)
        if job["status"] in wanted:
            return job
        time.sleep(0.1)
    raise AssertionError(f"video {video_id} still {job['status']} after {timeout} s")


def test_batched_equals_unbatched_and_a_video_is_cancelled(ready):
    # A long video holds the ranks while four compatible image requests queue up behind it; cancelling
    # it between two denoising steps lets the four run as one batch.
    status, video = _post(ready.url + "/v1/videos", {"prompt": "a long one", "steps": 200, "num_frames": 5,
                                                     "size": f"{SIZE[0]}x{SIZE[1]}"})
    assert status == 200 and video["status"] == "queued"
    _wait_status(ready, video["id"], {"in_progress"})
    bodies = [_image_body(f"batch {i}", seed=50 + i) for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(_post, ready.url + "/v1/images/generations", b) for b in bodies]
        deadline = time.monotonic() + 30
        while json.loads(_get(ready.url + "/health")[1])["queue"] < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        status, _, _ = _request("DELETE", f"{ready.url}/v1/videos/{video['id']}")
        assert status == 200
        batched = [f.result() for f in futures]
    cancelled = _wait_status(ready, video["id"], {"cancelled", "completed", "failed"})
    assert cancelled["status"] == "cancelled" and cancelled["progress"] < 100
    assert _get(f"{ready.url}/v1/videos/{video['id']}/content")[0] == 409
    assert all(status == 200 and body["batch_size"] == 4 for status, body in batched), batched
    for body, (status, answer) in zip(bodies, batched):
        alone = _post(ready.url + "/v1/images/generations", body)[1]
        assert alone["batch_size"] == 1
        assert _rel(_npy(answer["data"][0]), _npy(alone["data"][0])) <= 1e-5


def test_a_fault_on_one_rank_fails_that_request_only(ready, reference):
    status, body = _post(ready.url + "/v1/images/generations", _image_body(f"{FAULT_SENTINEL} here", seed=1))
    assert status == 500
    assert f"injected fault on rank {FAULT_RANK}" in body["error"]["message"]
    assert _metric(ready, 'usp_dit_failures_total{reason="pipeline"}') == 1
    status, body = _post(ready.url + "/v1/images/generations", _image_body("a red fox in snow", seed=7))
    assert status == 200
    assert _rel(_npy(body["data"][0]), reference("a red fox in snow", 7)) <= 1e-4
    assert _get(ready.url + "/health")[0] == 200


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory) -> Path:
    """A LoRA of the tiny Wan transformer (every projection of attention, random A and B: it
    changes the image), saved as Diffusers saves one."""
    import torch
    from diffusers import WanPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from usp_dit.demo.tiny_wan import tiny_wan_pipeline
    from usp_dit.serve.families import TINY_TEXT_LEN

    pipe = tiny_wan_pipeline(max_text_len=TINY_TEXT_LEN)
    torch.manual_seed(3)
    pipe.transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"],
                                            init_lora_weights=False))
    folder = tmp_path_factory.mktemp("lora")
    WanPipeline.save_lora_weights(folder, transformer_lora_layers=get_peft_model_state_dict(pipe.transformer))
    return folder


def _lora_reference(folder: Path, prompt: str, seed: int, scale: float) -> np.ndarray:
    """The stock WanPipeline with the LoRA loaded at ``scale``, one process."""
    import torch

    from usp_dit.demo.tiny_wan import tiny_wan_pipeline
    from usp_dit.serve.families import TINY_TEXT_LEN

    pipe = tiny_wan_pipeline(max_text_len=TINY_TEXT_LEN)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(folder), adapter_name="style")
    pipe.set_adapters(["style"], [scale])
    out = pipe(prompt=prompt, height=SIZE[1], width=SIZE[0], num_frames=1, num_inference_steps=2, guidance_scale=3.0,
               generator=torch.Generator().manual_seed(seed), max_sequence_length=TINY_TEXT_LEN, output_type="np")
    return out.frames[0, 0]


def test_a_lora_registered_by_name_applies_to_its_requests_alone(ready, reference, lora_dir):
    url, images = ready.url + "/v1/loras", ready.url + "/v1/images/generations"
    assert _post(url, {"name": "style", "path": str(lora_dir)}) == (
        200, {"object": "lora", "name": "style", "path": str(lora_dir)})
    for bad, param in (({"name": "style", "path": str(lora_dir)}, "name"),  # registered already
                       ({"name": "x", "path": str(lora_dir / "missing.safetensors")}, "path"),
                       ({"name": "not an identifier", "path": str(lora_dir)}, "name")):
        status, body = _post(url, bad)
        assert status == 400 and body["error"]["param"] == param, body
    status, body = _post(images, _image_body("a cat", 5, lora={"other": 1.0}))
    assert status == 400 and "no adapter named 'other'" in body["error"]["message"]
    # Sent together: three different adapter settings, three batches; each as its own request alone.
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(_post, images, _image_body("a cat", 5, **extra))
                   for extra in ({"lora": {"style": 0.8}}, {}, {"lora": {"style": 0.3}})]
        (s1, full), (s2, plain), (s3, light) = (f.result() for f in futures)
    assert (s1, s2, s3) == (200, 200, 200)
    assert _rel(_npy(full["data"][0]), _lora_reference(lora_dir, "a cat", 5, 0.8)) <= 1e-4
    assert _rel(_npy(light["data"][0]), _lora_reference(lora_dir, "a cat", 5, 0.3)) <= 1e-4
    assert _rel(_npy(plain["data"][0]), reference("a cat", 5)) <= 1e-4
    assert _rel(_npy(full["data"][0]), _npy(plain["data"][0])) > 1e-3  # the adapter does change the image
    status, body, _ = _request("DELETE", url + "/style")
    assert status == 200 and json.loads(body)["deleted"]
    assert json.loads(_get(url)[1])["data"] == []
    assert _request("DELETE", url + "/style")[0] == 404
    status, body = _post(images, _image_body("a cat", 5, lora={"style": 0.8}))
    assert status == 400
    status, body = _post(images, _image_body("a cat", 5))  # every rank unloaded it before this batch
    assert status == 200 and _rel(_npy(body["data"][0]), reference("a cat", 5)) <= 1e-4


def test_video_job_polled_and_downloaded(ready, reference):
    import imageio.v3 as iio

    status, video = _post(ready.url + "/v1/videos", {"prompt": "waves", "steps": 3, "num_frames": 5, "seed": 4,
                                                     "size": f"{SIZE[0]}x{SIZE[1]}", "guidance": 3.0})
    assert status == 200
    seen = set()
    deadline = time.monotonic() + 60
    while (job := json.loads(_get(f"{ready.url}/v1/videos/{video['id']}")[1]))["status"] != "completed":
        assert job["status"] in ("queued", "in_progress") and time.monotonic() < deadline, job
        seen.add(job["progress"])
        time.sleep(0.02)
    assert job["progress"] == 100 and any(0 < p < 100 for p in seen), seen  # progress between steps
    status, mp4, headers = _get(f"{ready.url}/v1/videos/{video['id']}/content")
    assert status == 200 and headers["content-type"] == "video/mp4" and mp4[4:8] == b"ftyp"
    frames = iio.imread(mp4, extension=".mp4")
    assert frames.shape == (5, SIZE[1], SIZE[0], 3)
    ref = (reference("waves", 4, steps=3, frames=5) * 255).astype(np.float64)
    assert np.abs(frames - ref).mean() < 8  # H.264 is lossy: a mean error of a few levels of 255
    assert _get(f"{ready.url}/v1/videos/nonexistent")[0] == 404


def test_sigterm_drains_then_exits_0(ready):
    workers = ready.rank_pids()
    rank0 = workers[0]
    status, video = _post(ready.url + "/v1/videos", {"prompt": "last", "steps": 20, "num_frames": 5,
                                                     "size": f"{SIZE[0]}x{SIZE[1]}"})
    _wait_status(ready, video["id"], {"in_progress"})
    with ThreadPoolExecutor(2) as pool:
        queued = [pool.submit(_post, ready.url + "/v1/images/generations", _image_body(f"q{i}", seed=i)) for i in range(2)]
        # SIGTERM only once the server holds both (a fixed sleep let a loaded CI machine deliver them
        # after the signal, and they were rightly refused with 503)
        deadline = time.monotonic() + 30
        while (h := json.loads(_get(ready.url + "/health")[1]))["queue"] + h["running"] < 3:
            assert time.monotonic() < deadline, f"the two requests were not taken within 30 s: {h}"
            time.sleep(0.05)
        os.kill(rank0, signal.SIGTERM)
        time.sleep(0.3)
        status, body = _post(ready.url + "/v1/images/generations", _image_body("too late", seed=0))
        assert status == 503, body
        answers = [f.result() for f in queued]
        assert [a[0] for a in answers] == [200, 200], answers  # the queue was answered
    assert ready.proc.wait(60) == 0, ready.tail()
    assert not [p for p in workers.values() if _alive(p)]


# ---------------------------------------------------------------------------------------------
# A second, 2-rank server: a rank killed mid-request


def test_a_killed_rank_fails_requests_and_the_job_exits_nonzero(tmp_path):
    srv = Server(tmp_path / "server2.log", 2, "--ulysses", "2", "--steps", "2", "--max-steps", "1000")
    try:
        srv.wait_ready()
        workers = srv.rank_pids()
        outcome: dict = {}

        def long_request():
            try:
                outcome["answer"] = _post(srv.url + "/v1/images/generations", _image_body("slow", seed=0, steps=1000))
            except OSError as err:  # the connection closed: an error too, never silence
                outcome["answer"] = (None, repr(err))
            outcome["at"] = time.monotonic()

        client = threading.Thread(target=long_request)
        client.start()
        deadline = time.monotonic() + 30
        while json.loads(_get(srv.url + "/health")[1])["running"] == 0:
            assert time.monotonic() < deadline and client.is_alive(), outcome
            time.sleep(0.05)
        killed_at = time.monotonic()
        os.kill(workers[1], signal.SIGKILL)
        while time.monotonic() - killed_at < 10:  # /health fails within 10 s
            try:
                if _get(srv.url + "/health", timeout=2)[0] != 200:
                    break
            except OSError:
                break
            time.sleep(0.1)
        assert time.monotonic() - killed_at < 10, "/health still answered 200 after 10 s"
        client.join(30)
        assert not client.is_alive(), "no answer within 30 s"
        status, body = outcome["answer"]
        assert status in (None, 500, 503), body
        assert outcome["at"] - killed_at < 30
        assert srv.proc.wait(30) != 0
        assert not [p for p in workers.values() if _alive(p)], "orphan ranks"
        with pytest.raises(OSError):
            _get(srv.url + "/health", timeout=2)
    finally:
        srv.stop()


# ---------------------------------------------------------------------------------------------
# A third server: two replicas of two ranks (Note [replicas] in usp_dit.serve.control)


@pytest.fixture
def replica_server(tmp_path):
    srv = Server(tmp_path / "replicas.log", 4, "--replicas", "2", "--ulysses", "2", "--steps", "2", "--max-batch", "2",
                 "--hang-timeout", "90", env={"USP_DIT_SERVE_FAULT_RANK": "1,3"})  # a rank of each replica
    try:
        yield srv  # a fixture value: a failure's report carries its log (tests/conftest.py)
    finally:
        srv.stop()


def test_two_replicas_share_the_queue_cancel_and_fail_apart(replica_server, reference):
    srv = replica_server
    srv.wait_ready()
    workers = srv.rank_pids()
    # Images: both replicas serve the one queue, each answer equals one process.
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda i: _post(srv.url + "/v1/images/generations", _image_body(f"r{i}", seed=i)),
                                range(12)))
    assert all(status == 200 for status, _ in answers), answers[:2]
    assert {body["replica"] for _, body in answers} == {0, 1}
    for i in (0, 11):
        assert _rel(_npy(answers[i][1]["data"][0]), reference(f"r{i}", i)) <= 1e-4
    # Videos and faults, placed for certain: while video 1 holds one replica, a faulty request runs
    # on the other and fails alone (500 naming a rank of that replica); video 2 then takes that
    # replica; video 1 is cancelled between two steps, and the second faulty request runs where it
    # was. Video 2 is cancelled last: a DELETE works on the replica rank 0 runs and on the remote one.
    long = {"prompt": "long", "steps": 200, "num_frames": 5, "size": f"{SIZE[0]}x{SIZE[1]}"}

    def fault(i: int) -> str:
        status, body = _post(srv.url + "/v1/images/generations", _image_body(f"{FAULT_SENTINEL} {i}", seed=i))
        assert status == 500 and "injected fault on rank" in body["error"]["message"], body
        return body["error"]["message"]

    def cancel(video: dict) -> None:
        assert _request("DELETE", f"{srv.url}/v1/videos/{video['id']}")[0] == 200
        done = _wait_status(srv, video["id"], {"cancelled", "completed", "failed"})
        assert done["status"] == "cancelled" and done["progress"] < 100, done  # 1 step of 200 shows as 0 %

    first = _wait_status(srv, _post(srv.url + "/v1/videos", long)[1]["id"], {"in_progress"})
    faults = [fault(0)]
    second = _wait_status(srv, _post(srv.url + "/v1/videos", long)[1]["id"], {"in_progress"})
    assert {first["replica"], second["replica"]} == {0, 1}
    cancel(first)
    faults.append(fault(1))
    cancel(second)
    ranks_of = {0: ("rank 0", "rank 1"), 1: ("rank 2", "rank 3")}  # each replica's global ranks
    for message, replica in zip(faults, (second["replica"], first["replica"])):
        assert any(rank in message for rank in ranks_of[replica]), (replica, message)
    with ThreadPoolExecutor(4) as pool:
        after = list(pool.map(lambda i: _post(srv.url + "/v1/images/generations", _image_body("after", seed=3)),
                              range(4)))
    assert all(status == 200 for status, _ in after)
    assert _rel(_npy(after[0][1]["data"][0]), reference("after", 3)) <= 1e-4
    # SIGTERM: every replica stops, the job exits 0.
    os.kill(workers[0], signal.SIGTERM)
    assert srv.proc.wait(60) == 0, srv.tail()
    assert not [p for p in workers.values() if _alive(p)]
