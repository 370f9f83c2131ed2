"""The examples as a user meets them on the command line (issue 13, items 12 and 13).

Process tests (few: each pays the imports, ~10 s on two shared cores):
  * a bad value under real torchrun on 2 ranks (degrees that do not fit, a missing model folder,
    an unknown backend, a size the model cannot take) prints exactly one ``error: ...`` line and
    no worker traceback; the workers exit 2. torchrun itself then exits 1 and prints its own
    summary of the failed workers, with its own ChildFailedError traceback: that part is the
    launcher's and no worker can change it, so the test checks that every traceback frame in the
    output is torchrun's. torchrun stops the other workers once the first has exited: a rank still
    importing then ends by its SIGTERM (-15) instead of reaching its own exit 2.
  * examples/finetune_llm.py on 2 ranks (ring 2, tiny Qwen2): both loss curves and MATCH (issue 18).
  * Ctrl-C on a running example (one process): exit 130, no traceback, and the one-line notice
    that it runs on one rank. Under torchrun on 2 ranks: torchrun forwards SIGINT to its workers,
    which end (130) with no traceback within 5 s. torchrun itself then exits 1 with its own
    SignalException traceback: the launcher's, as above. Both start the job as a terminal runs a
    foreground job (see "Ctrl-C" below), whatever the test runner's SIGINT.
  * ``scripts/test.sh PATH`` runs just that file; ``scripts/test.sh FLAGS`` still runs tests/.
  * The model families added after the first examples (issue 15), each once on 2 ranks in one
    torchrun job (tests/_examples_job.py: the start-up, ~8 s of CPU, paid once, not six times):
    HunyuanVideo (cfg 2, true CFG: a step's two calls on the two cfg groups at once), LTX-Video (cfg 2:
    its batched CFG split), Flux.2 (cfg 2: the images split), Qwen-Image (ring 2, true CFG), SD3
    (Ulysses 2), Chroma (cfg 2, one image: true CFG's two calls on the two cfg groups at once), 2 steps
    each; every run prints MATCH against one rank.
In-process tests: the examples' checks of sizes, frame counts, guidance and cfg degrees, MP4 output
and every family's defaults, the LLM example's checks and its MISMATCH verdict, and
``usp_dit.distributed.logs.configure_logging`` (INFO and warnings on rank 0 only).
"""
from __future__ import annotations

import importlib.util
import logging
import os
import re
import select
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from usp_dit.cli.launch import UsageError
from usp_dit.distributed import logs

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TORCHRUN_EXIT = 1  # torchrun's own exit code when a worker fails (it raises ChildFailedError)
SIGTERM_EXIT = -signal.SIGTERM  # a worker that torchrun stopped because another had already failed


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error")
    return env


def _example(name: str):
    """examples/<name>.py as a module (its main() does not run)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------
# A user error under torchrun


def _worker_exit_codes(output: str) -> tuple[int, list[int]]:
    """(root cause's exit code, every failed worker's) from torchrun's failure summary."""
    codes = [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", output)]
    root = re.search(r"Root Cause.*?exitcode\s*:\s*(-?\d+)", output, re.S)
    assert root and codes, f"no torchrun failure summary:\n{output[-3000:]}"
    return int(root.group(1)), codes


# Each case is a torchrun job (~5 s of start-up). The path from a bad value to one line and exit 2 is
# the same for every argument checked before the process group starts (degrees, model path,
# backend: the argument parser's checks); the size is checked later, against the model. CI keeps one
# of each; ``launch.check_model_path`` and ``check_backend``'s messages are tested in process below
# (the video example's --model-path, the LLM example's --backend).
@pytest.mark.parametrize("script, args, message", [
    ("generate_image", ["--ulysses", "3"], "error: --ulysses 3 on 2 rank(s): world_size=2 is not a multiple of"),
    pytest.param("generate_image", ["--model", "/nonexistent"], "error: --model /nonexistent: no such file or folder",
                 marks=pytest.mark.slow),
    pytest.param("finetune_video", ["--backend", "nope"],
                 "error: --backend 'nope' is not a kernel; choose 'auto' or one of", marks=pytest.mark.slow),
    ("generate_video", ["--height", "1000"], "error: --height 1000 must be a positive multiple of 16"),
], ids=["degrees", "model-path", "backend", "size"])
def test_user_error_is_one_line_and_exit_2_under_torchrun(script, args, message, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(EXAMPLES / f"{script}.py"), *args]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=240)
    output = proc.stdout + proc.stderr
    assert proc.returncode == TORCHRUN_EXIT, output[-3000:]
    root, codes = _worker_exit_codes(output)
    assert root == 2 and set(codes) <= {2, SIGTERM_EXIT}, (codes, output[-3000:])
    error_lines = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and error_lines[0].startswith(message), error_lines
    frames = re.findall(r'File "([^"]+)"', output)
    assert all("torch/distributed/" in f or f.startswith("<frozen") for f in frames), frames  # torchrun's own


# ---------------------------------------------------------------------------------------------
# Ctrl-C


# A terminal's Ctrl-C sends SIGINT to its foreground process group, where SIGINT is at its default.
# The test runner's need not be: a shell without job control (`bash .ci/run > log &`, a tool that
# runs commands with `&`) starts a background job with SIGINT and SIGQUIT ignored, ignored
# dispositions are inherited across fork and exec, and Python installs no KeyboardInterrupt handler
# when SIGINT is ignored at start-up. An example inheriting that never sees the signal (issue 27,
# item 4). So each test starts its job as a terminal's foreground job: in a session (and process
# group) of its own, SIGINT and SIGQUIT at their defaults; and sends SIGINT to that group.

DENOISING = re.compile(rb"\| *[1-9]\d*/100000 \[")  # rank 0's progress bar past its first step
START_S = 240.0  # imports, the tiny pipeline and a step, on two shared cores with the rest of the suite
# From Ctrl-C until the job's processes are gone. torchrun's workers leave by os._exit
# (usp_dit.cli.launch._exit): within 0.1 s at load 4. Python's own teardown takes longer and is not
# usp_dit's: torchrun's ~0.6 s (over 5 s once, beside the suite's jobs at load ~10), one process's
# ~1.5 s alone and 2.5-3.5 s at load 5 (over 5 s once at load 9). Their bounds only tell a lost
# Ctrl-C, or torchrun's SIGKILL after --shutdown-timeout (30 s), from a slow exit.
WORKERS_STOP_S = 5.0
TORCHRUN_STOP_S = 20.0
ONE_PROCESS_STOP_S = 60.0


# The job's first moments: SIGINT and SIGQUIT at their defaults, as a shell sets them for a
# foreground job, then exec of the command (same pid). A wrapper rather than Popen's preexec_fn,
# which runs Python between fork and exec: unsafe in a test process with torch's threads.
_DEFAULT_SIGNALS_THEN_EXEC = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                              "signal.signal(signal.SIGQUIT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])")


def _foreground_job(cmd: list[str], cwd: Path) -> subprocess.Popen:
    """``cmd`` in a new session (its own process group, as a shell's job), SIGINT at its default."""
    return subprocess.Popen([sys.executable, "-c", _DEFAULT_SIGNALS_THEN_EXEC, *cmd], cwd=cwd, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def _read_until(proc: subprocess.Popen, pattern: re.Pattern[bytes], timeout: float) -> bytes:
    """``proc``'s output up to where ``pattern`` first matches (AssertionError after ``timeout``)."""
    fd, out = proc.stdout.fileno(), b""
    deadline = time.monotonic() + timeout
    while not pattern.search(out):
        left = deadline - time.monotonic()
        assert left > 0, f"no {pattern.pattern!r} within {timeout:.0f} s:\n{out.decode(errors='replace')[-3000:]}"
        if select.select([fd], [], [], left)[0]:
            chunk = os.read(fd, 65536)
            assert chunk, f"ended ({proc.wait()}) before {pattern.pattern!r}:\n{out.decode(errors='replace')[-3000:]}"
            out += chunk
    return out


def _alive(pid: int) -> bool:
    """``pid`` still runs (a zombie has ended; only its parent's wait is missing)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _children(pid: int) -> list[int]:
    """The processes ``pid``'s main thread started (torchrun's workers)."""
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _kill_groups(leaders: list[int]) -> None:
    """SIGKILL the process group of each leader still running: a failed test leaves nothing behind."""
    for pid in leaders:
        if _alive(pid):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _ctrl_c(proc: subprocess.Popen) -> None:
    """Ctrl-C as a terminal sends it: SIGINT to the job's process group."""
    os.killpg(proc.pid, signal.SIGINT)


def _rest_of_output(proc: subprocess.Popen, timeout: float) -> bytes:
    """``proc``'s output until it ends; AssertionError if it still runs after ``timeout``."""
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired as err:
        raise AssertionError(f"still running {timeout:.0f} s after Ctrl-C:\n"
                             f"{(err.output or b'').decode(errors='replace')[-3000:]}") from None


def _still_running(pids: list[int], deadline: float) -> list[int]:
    """Those of ``pids`` still running at ``deadline`` (``time.monotonic()``), polled until then."""
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [pid for pid in pids if _alive(pid)]


def _image_cmd(tmp_path: Path) -> list[str]:
    # 100000 steps: the run is still denoising whenever the interrupt comes
    return [str(EXAMPLES / "generate_image.py"), "--height", "64", "--width", "64", "--steps", "100000",
            "--no-check", "--output", str(tmp_path / "x.png")]


def test_ctrl_c_exits_130_quietly(tmp_path):
    with _foreground_job([sys.executable, *_image_cmd(tmp_path)], tmp_path) as proc:
        try:
            seen = _read_until(proc, DENOISING, START_S)
            _ctrl_c(proc)
            rest = _rest_of_output(proc, ONE_PROCESS_STOP_S)
        finally:
            _kill_groups([proc.pid])
    output = (seen + rest).decode(errors="replace")
    assert proc.returncode == 130, output[-3000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    notices = [line for line in output.splitlines() if "running on one rank" in line]
    assert len(notices) == 1 and "torchrun --standalone --nproc-per-node N generate_image.py" in notices[0], notices


def test_ctrl_c_under_torchrun_ends_every_worker_quietly(tmp_path):
    """torchrun (torch/distributed/elastic/multiprocessing/api.py) starts each worker in a session of
    its own, so a terminal's Ctrl-C reaches torchrun alone; its handler sends SIGINT to every
    worker's process group, waits up to --shutdown-timeout (30 s) and then SIGKILLs, and re-raises
    its SignalException: torchrun exits 1 with that traceback, whatever the workers' codes."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           *_image_cmd(tmp_path)]
    workers: list[int] = []
    with _foreground_job(cmd, tmp_path) as proc:
        try:
            seen = _read_until(proc, DENOISING, START_S)  # rank 0 is past a step: both ranks denoise
            workers = _children(proc.pid)
            assert len(workers) == 2, workers
            signalled = time.monotonic()
            _ctrl_c(proc)
            left = _still_running(workers, signalled + WORKERS_STOP_S)
            assert not left, f"workers {left} still running {WORKERS_STOP_S:.0f} s after Ctrl-C"
            rest = _rest_of_output(proc, TORCHRUN_STOP_S)
        finally:
            _kill_groups([proc.pid, *workers])
    output = (seen + rest).decode(errors="replace")
    assert proc.returncode == TORCHRUN_EXIT, output[-3000:]
    for pid in workers:  # forwarded as SIGINT, not SIGTERM: the workers see a KeyboardInterrupt
        assert f"Sending process {pid} closing signal SIGINT" in output, output[-3000:]
    # One traceback, torchrun's own; none from a worker (KeyboardInterrupt, a failed collective).
    assert output.count("Traceback") == 1, output[-3000:]
    assert f"SignalException: Process {proc.pid} got signal: {int(signal.SIGINT)}" in output, output[-3000:]
    frames = re.findall(r'File "([^"]+)"', output)
    assert all("torch/distributed/" in f or f.startswith("<frozen") for f in frames), frames
    assert "KeyboardInterrupt" not in output, output[-3000:]


# ---------------------------------------------------------------------------------------------
# scripts/test.sh


def _test_sh(*args: str) -> str:
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "test.sh"), *args, "-p", "no:cacheprovider"],
                          env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_test_sh_runs_only_the_given_file_with_pytest_flags(tmp_path):
    probe = tmp_path / "test_probe.py"
    probe.write_text("def test_one():\n    assert 1 + 1 == 2\n\n\ndef test_two():\n    assert 2 * 2 == 4\n")
    out = _test_sh(str(probe), "-k", "one", "-x")
    assert re.search(r"\b1 passed, 1 deselected\b", out), out[-3000:]


def test_test_sh_without_paths_runs_the_tests_folder():
    # -o python_files narrows what counts as a test file, so the run is quick yet shows the folder.
    out = _test_sh("--collect-only", "-o", "python_files=test_partition.py")  # test.sh adds -q: one id a line
    ids = [line for line in out.splitlines() if "::" in line]
    assert ids and all(i.startswith("tests/test_partition.py::") for i in ids), out[-3000:]


# ---------------------------------------------------------------------------------------------
# The examples' checks, in process


@pytest.fixture
def one_rank(monkeypatch):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("argv, message", [
    (["--frames", "5"], "--frames 5 must be 8k + 1"),  # CogVideoX's VAE would return 8 frames
    (["--frames", "13"], "--frames 13 must be 8k + 1"),
    (["--model", "mochi", "--frames", "9"], "--frames 9 must be 6k + 1"),
    (["--model", "mochi", "--steps", "1"], "--steps 1 must be at least 2"),
    (["--width", "100"], "--width 100 must be a positive multiple of 16"),
    (["--model", "sana_video", "--width", "80"], "--width 80 must be a positive multiple of 32"),
    (["--output", "clip.avi"], "--output clip.avi must end in one of .webp, .gif, .mp4"),
    (["--ring-schedule", "sideways"], "argument --ring-schedule: invalid choice"),
])
def test_video_example_rejects(argv, message, one_rank):
    with pytest.raises(UsageError, match=re.escape(message)):
        _example("generate_video").parse_args(argv)


def test_video_example_takes_frame_counts_the_models_return(one_rank):
    ex = _example("generate_video")
    for argv, frames in ((["--frames", "17"], 17), (["--model", "mochi", "--frames", "7"], 7), ([], 9)):
        assert ex.parse_args(argv).frames == frames


def test_mp4_output_needs_imageio_ffmpeg(monkeypatch, one_rank):
    ex = _example("generate_video")
    real_find_spec = importlib.util.find_spec
    missing = ("imageio", "imageio_ffmpeg")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in missing
                        else real_find_spec(name, *a))
    with pytest.raises(UsageError, match=r"--output clip\.mp4 needs imageio and imageio_ffmpeg, not installed"):
        ex.parse_args(["--output", "clip.mp4"])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())  # both installed
    assert ex.parse_args(["--output", "clip.mp4"]).output == "clip.mp4"


def test_image_example_rejects_sizes_flux_cannot_take(one_rank):
    ex = _example("generate_image")
    with pytest.raises(UsageError, match=re.escape("--height 1000 must be a positive multiple of 16")):
        ex.parse_args(["--height", "1000"])
    assert ex.parse_args(["--height", "1008", "--width", "64"]).degrees == (1, 1, 1)


@pytest.fixture
def two_ranks(monkeypatch):
    """The world size torchrun would give 2 ranks (what the degree checks read), without a process group."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")


@pytest.mark.parametrize("argv, message", [
    (["--model", "hunyuan_video", "--cfg", "2"],
     "--cfg 2 with --model hunyuan_video and no --true-cfg: HunyuanVideoPipeline is guidance-distilled (one "
     "transformer call a step), so there is no second call a step for the other cfg group"),
    (["--model", "hunyuan_video", "--cfg", "2", "--true-cfg", "1"],
     "--cfg 2 with --true-cfg 1.0: at a guidance scale <= 1 the pipeline runs no classifier-free guidance"),
    (["--model", "wan", "--cfg", "2", "--guidance", "1"],
     "--cfg 2 with --guidance 1.0: at a guidance scale <= 1 the pipeline runs no classifier-free guidance, so there "
     "is no second call a step"),
    (["--model", "mochi", "--cfg", "4"], "--cfg 4: the cfg groups run classifier-free guidance's two branches"),
    (["--model", "hunyuan_video", "--frames", "11"], "--frames 11 must be 4k + 1"),
    (["--model", "hunyuan_video", "--width", "136"], "--width 136 must be a positive multiple of 16"),
    (["--model", "ltx_video", "--frames", "13"], "--frames 13 must be 8k + 1"),
    (["--model", "ltx_video", "--width", "144"], "--width 144 must be a positive multiple of 32 (ltx_video: 32 pixels"),
    (["--model", "ltx_video", "--cfg", "2", "--guidance", "1"],
     "--cfg 2 with --guidance 1.0: at a guidance scale <= 1 the pipeline runs no classifier-free guidance"),
    (["--model", "ltx_video", "--true-cfg", "4"], "--true-cfg with --model ltx_video: only HunyuanVideo"),
    (["--model", "ltx_video", "--model-path", "/nonexistent"], "--model-path /nonexistent: no such file or folder"),
    (["--model", "wan_animate", "--cfg", "2"],
     "--cfg 2 with --model wan_animate and no --guidance: WanAnimatePipeline is unguided by default, at "
     "guidance_scale 1 as released (one transformer call a step), so there is no second call a step"),
    (["--model", "wan_animate", "--model-path", "Wan-AI/Wan2.2-Animate-14B-Diffusers", "--face-video", __file__],
     "--model wan_animate with --model-path needs --pose-video: the pose renderings and face crops"),
    (["--model", "wan_animate", "--pose-video", "/nonexistent.gif"], "--pose-video /nonexistent.gif: no such file"),
    (["--model", "wan", "--face-video", __file__], "--face-video with --model wan: only wan_animate takes pose and"),
    (["--model", "wan_animate", "--frames", "11"], "--frames 11 must be 4k + 1"),
    (["--model", "wan_animate2", "--frames", "11"], "--frames 11 must be 4k + 1"),
    (["--model", "wan_animate2", "--height", "40"], "--height 40 must be a positive multiple of 16"),
    (["--model", "minimax_h3", "--cfg", "2"],
     "--cfg 2 with --model minimax_h3: MiniMaxH3ModularPipeline is guidance-distilled (guidance in its weights: no "
     "guider, no guidance scale): one transformer call a step on one prompt, so there is no second branch"),
    (["--model", "minimax_h3", "--guidance", "3"],
     "--guidance with --model minimax_h3: MiniMaxH3ModularPipeline is guidance-distilled"),
    (["--model", "minimax_h3", "--model-path", "."],
     "--model-path with --model minimax_h3: the example runs the tiny denoise and decode steps alone"),
    (["--model", "minimax_h3", "--frames", "125"], "--frames 125 must be 17k + 5, e.g. 124 or 141 (MiniMax-H3's VAE"),
    (["--model", "minimax_h3", "--frames", "107"], "--frames 107 must be at least 124 (MiniMax-H3 generates 5 to 15 s"),
    (["--model", "minimax_h3", "--frames", "362"], "--frames 362 must be at most 345 (MiniMax-H3 generates 5 to 15 s"),
    (["--model", "minimax_h3", "--width", "80"], "--width 80 must be a positive multiple of 32 (minimax_h3: 16 pixels"),
    (["--model", "minimax_h3", "--steps", "1"], "--steps 1 must be at least 2 (MiniMax-H3's schedule counts its"),
], ids=["hunyuan-cfg2-distilled", "hunyuan-cfg2-true-cfg-1", "wan-cfg2-unguided", "cfg4", "hunyuan-frames",
        "hunyuan-size", "ltx-frames", "ltx-size", "ltx-cfg2-unguided", "ltx-true-cfg", "ltx-model-path",
        "wan-animate-cfg2-unguided", "wan-animate-model-path-no-pose", "wan-animate-no-pose-file",
        "wan-face-video", "wan-animate-frames", "wan-animate2-frames", "wan-animate2-size", "minimax-h3-cfg2-distilled",
        "minimax-h3-guidance", "minimax-h3-model-path", "minimax-h3-frames", "minimax-h3-too-short",
        "minimax-h3-too-long", "minimax-h3-size", "minimax-h3-steps"])
def test_video_example_rejects_what_the_new_families_cannot_take(argv, message, two_ranks):
    with pytest.raises(UsageError, match=re.escape(message)):
        _example("generate_video").parse_args(argv)


@pytest.mark.parametrize("argv, expected", [
    (["--model", "hunyuan_video"], (9, 96, 144, (2, 1, 1))),
    (["--model", "hunyuan_video", "--true-cfg", "4", "--ring", "2"], (9, 96, 144, (1, 2, 1))),
    (["--model", "ltx_video"], (17, 96, 160, (2, 1, 1))),
    (["--model", "ltx_video", "--cfg", "2", "--frames", "9", "--height", "64"], (9, 64, 160, (1, 1, 2))),
    (["--model", "cogvideox"], (9, 96, 144, (2, 1, 1))),  # the older families keep their defaults
    (["--model", "mochi", "--cfg", "2"], (13, 96, 144, (1, 1, 2))),
    # two calls a step (true CFG): the cfg groups run them at once
    (["--model", "hunyuan_video", "--true-cfg", "4", "--cfg", "2"], (9, 96, 144, (1, 1, 2))),
    (["--model", "wan", "--cfg", "2"], (9, 96, 144, (1, 1, 2))),
    (["--model", "ltx2", "--cfg", "2"], (17, 96, 160, (1, 1, 2))),
    (["--model", "sana_video", "--cfg", "2"], (9, 64, 96, (1, 1, 2))),
    (["--model", "sana_wm", "--cfg", "2"], (17, 96, 160, (1, 1, 2))),
    (["--model", "hunyuan_video15"], (9, 48, 96, (2, 1, 1))),
    (["--model", "hunyuan_video_framepack", "--true-cfg", "3", "--cfg", "2"], (9, 48, 80, (1, 1, 2))),
    (["--model", "hunyuan_video15", "--cfg", "2"], (9, 48, 96, (1, 1, 2))),
    (["--model", "motif_video", "--cfg", "2"], (9, 96, 144, (1, 1, 2))),
    (["--model", "latte", "--cfg", "2", "--frames", "4"], (4, 96, 144, (1, 1, 2))),  # any frame count: an image VAE
    (["--model", "allegro", "--cfg", "2", "--frames", "8"], (8, 96, 144, (1, 1, 2))),  # rounded up to latent frames
    (["--model", "wan_animate"], (13, 80, 144, (2, 1, 1))),
    (["--model", "wan_animate", "--cfg", "2", "--guidance", "2"], (13, 80, 144, (1, 1, 2))),
    (["--model", "wan_animate2", "--cfg", "2"], (9, 48, 80, (1, 1, 2))),
    (["--model", "minimax_h3"], (124, 64, 96, (2, 1, 1))),
    (["--model", "minimax_h3", "--ring", "2", "--frames", "141"], (141, 64, 96, (1, 2, 1))),
])
def test_video_example_fills_each_familys_defaults(argv, expected, two_ranks):
    args = _example("generate_video").parse_args(argv)
    assert (args.frames, args.height, args.width, args.degrees) == expected


def test_video_example_runs_minimax_h3_at_its_own_frame_rate_and_plans_it_unguided(two_ranks):
    """MiniMax-H3's video (and soundtrack) at its 24 fps unless --fps says otherwise; --degrees auto
    asks the planner for the guidance-distilled model (no cfg axis to fill)."""
    ex = _example("generate_video")
    assert (ex.parse_args(["--model", "minimax_h3"]).fps, ex.parse_args(["--model", "wan"]).fps) == (24, 8)
    assert ex.parse_args(["--model", "minimax_h3", "--fps", "12"]).fps == 12
    assert ex.parse_args(["--model", "minimax_h3", "--degrees", "auto"]).degrees[2] == 1


def test_video_example_generates_with_the_tiny_hunyuan_video15(two_ranks):
    """One process, no grid: the tiny HunyuanVideo 1.5 pipeline and its guider-held scale (--guidance)."""
    example = _example("generate_video")
    args = example.parse_args(["--model", "hunyuan_video15", "--steps", "1", "--guidance", "3"])
    pipe = example.load_pipeline(args, torch.device("cpu"))
    pipe.set_progress_bar_config(disable=True)
    frames = example.generate(pipe, args)
    assert frames.shape == (9, 48, 96, 3) and pipe.guider.guidance_scale == 3.0


def test_video_example_generates_with_the_tiny_motif_video(two_ranks):
    """One process, no grid: the tiny Motif-Video pipeline (decoder block), its guider-held scale."""
    example = _example("generate_video")
    args = example.parse_args(["--model", "motif_video", "--steps", "1", "--guidance", "3", "--height", "48",
                               "--width", "80"])
    pipe = example.load_pipeline(args, torch.device("cpu"))
    pipe.set_progress_bar_config(disable=True)
    frames = example.generate(pipe, args)
    assert frames.shape == (9, 48, 80, 3) and pipe.guider.guidance_scale == 3.0


def test_video_example_generates_with_the_tiny_framepack(two_ranks):
    """One process, no grid: the tiny FramePack pipeline from the default gradient image, one
    section of --frames (the image's latent frame prepended: 9 frames come back as 13)."""
    example = _example("generate_video")
    args = example.parse_args(["--model", "hunyuan_video_framepack", "--steps", "1", "--true-cfg", "2"])
    pipe = example.load_pipeline(args, torch.device("cpu"))
    pipe.set_progress_bar_config(disable=True)
    assert example.generate(pipe, args).shape == (13, 48, 80, 3)


def test_video_example_generates_with_the_tiny_sana_wm(two_ranks):
    """One process, no grid: the tiny SANA-WM pipeline from the default gradient image along the forward
    camera trajectory (one pose a frame); its output is one video, not a batch of them."""
    example = _example("generate_video")
    args = example.parse_args(["--model", "sana_wm", "--steps", "1", "--frames", "9", "--height", "64",
                               "--width", "96"])
    pipe = example.load_pipeline(args, torch.device("cpu"))
    pipe.set_progress_bar_config(disable=True)
    assert example.generate(pipe, args).shape == (9, 64, 96, 3) and example.video_tokens(args, pipe) == 2 * 2 * 3


def test_video_example_generates_with_the_tiny_latte(two_ranks):
    """One process, no grid: the tiny Latte pipeline built for --frames, its video_length and prompt keywords."""
    example = _example("generate_video")
    args = example.parse_args(["--model", "latte", "--steps", "1", "--frames", "2", "--height", "48", "--width", "64"])
    pipe = example.load_pipeline(args, torch.device("cpu"))
    pipe.set_progress_bar_config(disable=True)
    assert example.generate(pipe, args).shape == (2, 48, 64, 3) and example.video_tokens(args, pipe) == 2 * 3 * 4


def test_video_example_generates_with_the_tiny_allegro(two_ranks):
    """One process, no grid: the tiny Allegro pipeline, its VAE's one tile fitted to the video."""
    example = _example("generate_video")
    args = example.parse_args(["--model", "allegro", "--steps", "1", "--frames", "5", "--height", "48", "--width", "64"])
    pipe = example.load_pipeline(args, torch.device("cpu"))
    pipe.set_progress_bar_config(disable=True)
    assert example.generate(pipe, args).shape == (5, 48, 64, 3) and example.video_tokens(args, pipe) == 2 * 3 * 4


@pytest.mark.parametrize("argv, message", [
    (["--family", "flux2", "--height", "42"], "--height 42 must be a positive multiple of 4 (tiny Flux.2"),
    (["--family", "flux2", "--model", "org/flux2", "--height", "1000"],
     "--height 1000 must be a positive multiple of 16 (Flux.2"),
    (["--family", "flux2", "--negative-prompt", "dim"], "--negative-prompt with --family flux2: Flux.2 is guidance"),
    (["--family", "flux2", "--cfg", "2", "--num-images", "3"],
     "--num-images 3 must be a positive multiple of --cfg 2 (Flux.2 is guidance-distilled, one transformer call"),
    (["--family", "qwen_image", "--width", "72"], "--width 72 must be a positive multiple of 16 (tiny Qwen-Image"),
    (["--family", "qwen_image", "--cfg", "2", "--guidance", "1", "--num-images", "1"],
     "--num-images 1 must be a positive multiple of --cfg 2 (with --guidance <= 1 Qwen-Image runs no CFG"),
    (["--family", "sd3", "--width", "68"], "--width 68: the tiny SD3 transformer's position table covers at most 64"),
    (["--family", "sd3", "--width", "62"], "--width 62 must be a positive multiple of 4 (tiny SD3"),
    (["--family", "sd3", "--cfg", "2", "--guidance", "1", "--num-images", "1"],
     "--num-images 1 must be a positive multiple of --cfg 2 (with --guidance <= 1 SD3 runs no CFG"),
    (["--family", "sd3", "--num-images", "0"], "--num-images 0 must be at least 1"),
    (["--family", "flux", "--negative-prompt", "dim"], "--negative-prompt with --family flux: Flux is guidance"),
    (["--family", "chroma", "--height", "50"], "--height 50 must be a positive multiple of 4 (tiny Chroma"),
    (["--family", "chroma", "--cfg", "2", "--guidance", "1", "--num-images", "3"],
     "--num-images 3 must be a positive multiple of --cfg 2 (with --guidance <= 1 Chroma runs no CFG"),
    (["--family", "sdxl"], "argument --family: invalid choice: 'sdxl'"),
], ids=["flux2-tiny-size", "flux2-real-size", "flux2-negative", "flux2-images", "qwen-size",
        "qwen-unguided-images", "sd3-tiny-max", "sd3-size", "sd3-unguided-cfg2", "sd3-no-images", "flux-negative",
        "chroma-size", "chroma-unguided-images", "unknown-family"])
def test_image_example_rejects_what_each_family_cannot_take(argv, message, two_ranks):
    with pytest.raises(UsageError, match=re.escape(message)):
        _example("generate_image").parse_args(argv)


NEGATIVE = "blurry, low quality"  # the image example's default negative prompt (Qwen-Image, SD3)


@pytest.mark.parametrize("argv, expected", [
    # flux: the main job (scripts/main.sh) as before: 1008 x 1008, guidance 3.5, flux_usp.png.
    ([], (1008, 1008, 3.5, None, "flux_usp.png", (2, 1, 1), 1)),
    (["--cfg", "2"], (1008, 1008, 3.5, None, "flux_usp.png", (1, 1, 2), 2)),
    (["--family", "flux2", "--cfg", "2"], (60, 100, None, None, "flux2_usp.png", (1, 1, 2), 2)),
    (["--family", "flux2", "--model", "org/flux2"], (1024, 1024, None, None, "flux2_usp.png", (2, 1, 1), 1)),
    # Qwen-Image and Chroma call the transformer once per guidance branch: the cfg groups run a
    # step's two calls at once, so one image (or any count) uses both.
    (["--family", "qwen_image", "--cfg", "2"], (144, 240, None, NEGATIVE, "qwen_image_usp.png", (1, 1, 2), 1)),
    (["--family", "qwen_image", "--cfg", "2", "--num-images", "3"],
     (144, 240, None, NEGATIVE, "qwen_image_usp.png", (1, 1, 2), 3)),
    # SD3 batches CFG: the cfg axis splits [uncond, cond] of a single image.
    (["--family", "sd3", "--cfg", "2", "--guidance", "5"], (44, 60, 5.0, NEGATIVE, "sd3_usp.png", (1, 1, 2), 1)),
    (["--family", "sd3", "--cfg", "2", "--num-images", "3"], (44, 60, None, NEGATIVE, "sd3_usp.png", (1, 1, 2), 3)),
    (["--family", "chroma", "--cfg", "2"], (60, 100, None, NEGATIVE, "chroma_usp.png", (1, 1, 2), 1)),
    # unguided (one call a step): the cfg axis splits the images, as for Flux
    (["--family", "chroma", "--cfg", "2", "--guidance", "1"], (60, 100, 1.0, NEGATIVE, "chroma_usp.png", (1, 1, 2), 2)),
    # Z-Image batches CFG ([cond, uncond] of one call): the cfg axis splits it, one image uses both
    (["--family", "zimage", "--cfg", "2"], (60, 100, None, NEGATIVE, "zimage_usp.png", (1, 1, 2), 1)),
    # HiDream batches CFG, as SD3: the cfg axis splits [uncond, cond] of a single image.
    (["--family", "hidream", "--cfg", "2"], (20, 20, None, NEGATIVE, "hidream_usp.png", (1, 1, 2), 1)),
    (["--family", "longcat_image", "--cfg", "2"], (384, 640, None, NEGATIVE, "longcat_image_usp.png", (1, 1, 2), 1)),
    (["--family", "ovis_image", "--cfg", "2"], (60, 100, None, NEGATIVE, "ovis_image_usp.png", (1, 1, 2), 1)),
    # Bria batches CFG, as SD3: the cfg axis splits [uncond, cond] of a single image.
    (["--family", "bria", "--cfg", "2"], (60, 100, None, NEGATIVE, "bria_usp.png", (1, 1, 2), 1)),
    # PixArt-Sigma batches CFG: the cfg axis splits [uncond, cond] of a single image.
    (["--family", "pixart", "--cfg", "2"], (40, 56, None, NEGATIVE, "pixart_usp.png", (1, 1, 2), 1)),
    # NucleusMoE-Image: two calls a step (true CFG), run on the two cfg groups at once.
    (["--family", "nucleus_moe", "--cfg", "2"], (80, 112, None, NEGATIVE, "nucleus_moe_usp.png", (1, 1, 2), 1)),
    # JoyImage-Edit: two calls a step (CFG), run on the two cfg groups at once.
    (["--family", "joyimage", "--cfg", "2"], (80, 112, None, NEGATIVE, "joyimage_usp.png", (1, 1, 2), 1)),
    # JoyImage-Edit-Plus batches [negative, positive]: the cfg axis splits them.
    (["--family", "joyimage_plus", "--cfg", "2"], (80, 112, None, NEGATIVE, "joyimage_plus_usp.png", (1, 1, 2), 1)),
    # Lumina-Next batches [cond, uncond] in one call: the cfg axis splits them, one image uses both.
    (["--family", "lumina_next", "--cfg", "2"], (80, 112, None, NEGATIVE, "lumina_next_usp.png", (1, 1, 2), 1)),
    # OmniGen batches [cond, uncond] (its negative prompt built in): the cfg axis splits them.
    (["--family", "omnigen", "--cfg", "2"], (48, 80, None, None, "omnigen_usp.png", (1, 1, 2), 1)),
    # Ideogram 4: two transformers a step (asymmetric CFG), nothing for the cfg axis to pair: it splits the images.
    (["--family", "ideogram4", "--cfg", "2"], (20, 28, 4.0, None, "ideogram4_usp.png", (1, 1, 2), 2)),
    # PRX batches CFG: the cfg axis splits [uncond, cond] of a single image.
    (["--family", "prx", "--cfg", "2"], (20, 28, None, NEGATIVE, "prx_usp.png", (1, 1, 2), 1)),
    # DiT batches [cond, null class]: the cfg axis splits them; its --prompt is a class name.
    (["--family", "dit", "--cfg", "2"], (20, 20, None, None, "dit_usp.png", (1, 1, 2), 1)),
])
def test_image_example_fills_each_familys_defaults(argv, expected, two_ranks):
    a = _example("generate_image").parse_args(argv)
    assert (a.height, a.width, a.guidance, a.negative_prompt, a.output, a.degrees, a.num_images) == expected


def test_new_families_print_match_on_two_ranks(tmp_path):
    runs = {  # family: (one run of tests/_examples_job.py, the start of its first line on rank 0)
        "hunyuan_video": ("generate_video --model hunyuan_video --cfg 2 --true-cfg 4 --steps 2 "
                          "--output hv.gif", "cfg=2, ring=1, ulysses=1, device_type='cpu') on 2 ranks, cpu; "
                          "tiny random HunyuanVideoPipeline, 9 frames of 96x144 (162 video tokens)"),
        "ltx_video": ("generate_video --model ltx_video --cfg 2 --steps 2 --output ltx.gif",
                      "cfg=2, ring=1, ulysses=1, device_type='cpu') on 2 ranks, cpu; tiny random LTXPipeline, "
                      "17 frames of 96x160 (45 video tokens)"),
        "flux2": ("generate_image --family flux2 --cfg 2 --steps 2",
                  "cfg=2, ring=1, ulysses=1, device_type='cpu') on 2 ranks, cpu; tiny random Flux2Pipeline, "
                  "60x100 (375 image tokens), 2 steps, 2 image(s)"),
        "qwen_image": ("generate_image --family qwen_image --ring 2 --ulysses 1 --steps 2",
                       "cfg=1, ring=2, ulysses=1, device_type='cpu') on 2 ranks, cpu; tiny random QwenImagePipeline, "
                       "144x240 (135 image tokens), 2 steps, 1 image(s)"),
        "sd3": ("generate_image --family sd3 --steps 2",
                "cfg=1, ring=1, ulysses=2, device_type='cpu') on 2 ranks, cpu; tiny random StableDiffusion3Pipeline, "
                "44x60 (165 image tokens), 2 steps, 1 image(s)"),
        "chroma": ("generate_image --family chroma --cfg 2 --steps 2",
                   "cfg=2, ring=1, ulysses=1, device_type='cpu') on 2 ranks, cpu; tiny random ChromaPipeline, "
                   "60x100 (375 image tokens), 2 steps, 1 image(s)"),
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "tests" / "_examples_job.py"), *(run for run, _ in runs.values())]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # Each run's lines, from its header to the next run's header.
    blocks = re.split(r"(?m)^usp_dit \S+: USPMesh\(dp=1, ", proc.stdout)[1:]
    assert len(blocks) == len(runs), proc.stdout
    for (family, (_, header)), block in zip(runs.items(), blocks):
        assert block.startswith(header), (family, block)
        assert re.search(r"max\|diff\|/max\|one rank\| = \S+ \(tolerance 1e-04\): MATCH", block), (family, block)
    for name in ("hv.gif", "ltx.gif", "flux2_usp.png", "qwen_image_usp.png", "sd3_usp.png", "chroma_usp.png"):
        assert (tmp_path / name).is_file(), name
    from PIL import Image

    with Image.open(tmp_path / "flux2_usp.png") as image:
        assert image.size == (2 * 100, 60)  # two images side by side
    with Image.open(tmp_path / "ltx.gif") as video:
        assert (video.size, video.n_frames) == ((160, 96), 17)


# ---------------------------------------------------------------------------------------------
# usp_dit.distributed.logs


@pytest.fixture
def restore_logging(monkeypatch):
    """configure_logging changes process-wide state: put it back for the tests that follow."""
    loggers = [logging.getLogger(name) for name in logs.PEER_QUIET_LOGGERS]
    saved = [(lg, lg.level, list(lg.handlers)) for lg in loggers]
    for variable in ("DIFFUSERS_VERBOSITY", "TRANSFORMERS_VERBOSITY"):
        monkeypatch.setenv(variable, os.environ.get(variable, "warning"))  # restored at teardown
    with warnings.catch_warnings():
        yield
    for lg, level, handlers in saved:
        lg.setLevel(level)
        lg.handlers[:] = handlers


def test_rank_zero_prints_info_and_warnings(restore_logging, capsys):
    logs.configure_logging(rank=0)
    logs.configure_logging(rank=0)  # idempotent: still one line per record
    logs.get_logger("kernels").info("picked a kernel")
    logs.get_logger().warning("mind the gap")
    assert capsys.readouterr().err.splitlines() == ["picked a kernel", "warning: mind the gap"]


def test_other_ranks_print_errors_only(restore_logging, capsys):
    logs.configure_logging(rank=1)
    logs.get_logger("kernels").info("picked a kernel")
    logs.get_logger().warning("mind the gap")
    logging.getLogger("diffusers").warning("a diffusers notice")
    logs.get_logger().error("this rank failed")
    with warnings.catch_warnings(record=True) as seen:
        warnings.warn("a deprecation", DeprecationWarning)
    assert seen == []
    assert capsys.readouterr().err.splitlines() == ["[rank 1] error: this rank failed"]


# ---------------------------------------------------------------------------------------------
# examples/finetune_llm.py (issue 18): a causal LM on the grid against one process


def test_llm_example_prints_match_on_two_ranks(tmp_path):
    """Ring 2 on a tiny Qwen2, two AdamW steps: both loss curves, MATCH, exit 0 (~10 s, mostly imports)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(EXAMPLES / "finetune_llm.py"), "--model", "qwen2", "--ring", "2", "--steps", "2"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "USPMesh(dp=1, cfg=1, ring=2, ulysses=1, device_type='cpu') on 2 rank(s), cpu; tiny random Qwen2ForCausalLM" in out
    rows = re.findall(r"(?m)^\s+(\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)\s+(\S+)$", out)
    assert [int(r[0]) for r in rows] == [0, 1], out
    assert re.search(r"max \|diff\|/\|one process\| = \S+ \(tolerance 1e-05\): MATCH", out), out
    assert out.count("MATCH") == 1, "rank 0 alone prints"


@pytest.mark.parametrize("argv, message", [
    (["--seq-len", "1"], "--seq-len 1 must be at least 2 (a causal LM needs a next token to predict)"),
    (["--layout", "spiral"], "argument --layout: invalid choice: 'spiral'"),
    (["--model", "gpt2"], "argument --model: invalid choice: 'gpt2'"),
    (["--ulysses", "3"], "--ulysses 3 on 2 rank(s): world_size=2 is not a multiple of"),
    (["--backend", "nope"], "--backend 'nope' is not a kernel"),
])
def test_llm_example_rejects(argv, message, two_ranks):
    with pytest.raises(UsageError, match=re.escape(message)):
        _example("finetune_llm").parse_args(argv)


def test_llm_example_needs_a_token_per_rank(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(UsageError, match=re.escape("--seq-len 3 must be at least ulysses x ring = 4 (every rank")):
        _example("finetune_llm").parse_args(["--ring", "4", "--seq-len", "3"])


def test_llm_example_fills_the_grid_and_fails_on_a_mismatch(two_ranks, capsys):
    ex = _example("finetune_llm")
    assert ex.parse_args([]).degrees == (2, 1, 1)
    assert ex.parse_args(["--ring", "2"]).degrees == (1, 2, 1)
    args = ex.parse_args(["--dtype", "float64"])
    assert ex.report(args, [1.0, 0.5], [1.0, 0.5 + 1e-16]) is True
    assert ex.report(args, [1.0, 0.5], [1.0, 0.5 + 1e-9]) is False
    assert capsys.readouterr().out.rstrip().endswith("(tolerance 1e-10): MISMATCH")


def test_ltx2_example_turns_off_the_batch_one_guidance_calls_under_cfg_2(two_ranks):
    """LTX2Pipeline's spatio-temporal and modality guidance are calls of batch 1, which a cfg split
    refuses: with --cfg 2 the example turns them off; with --cfg 1 the pipeline's defaults stay."""
    ex = _example("generate_video")
    assert ex.ltx2_guidance(ex.parse_args(["--model", "ltx2", "--cfg", "2", "--guidance", "4"])) == {
        **ex.LTX2_CFG_ONLY, "audio_guidance_scale": 4.0}
    assert ex.ltx2_guidance(ex.parse_args(["--model", "ltx2"])) == {}
