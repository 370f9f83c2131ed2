"""The examples as a user meets them on the command line (issue 13, items 12 and 13).

Process tests (few: each pays the imports, ~10 s on two shared cores):
  * a bad value under real torchrun on 2 ranks (degrees that do not fit, a missing model folder,
    an unknown backend, a size the model cannot take) prints exactly one ``error: ...`` line and
    no worker traceback; the workers exit 2. torchrun itself then exits 1 and prints its own
    summary of the failed workers, with its own ChildFailedError traceback: that part is the
    launcher's and no worker can change it, so the test checks that every traceback frame in the
    output is torchrun's. torchrun stops the other workers once the first has exited: a rank still
    importing then ends by its SIGTERM (-15) instead of reaching its own exit 2.
  * Ctrl-C on a running example (one process): exit 130, no traceback, and the one-line notice
    that it runs on one rank.
  * ``scripts/test.sh PATH`` runs just that file; ``scripts/test.sh FLAGS`` still runs tests/.
In-process tests: the examples' checks of sizes, frame counts and MP4 output, and
``usp_dit.logs.configure_logging`` (INFO and warnings on rank 0 only).
"""
from __future__ import annotations

import importlib.util
import logging
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from usp_dit import logs
from usp_dit.launch import UsageError

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


@pytest.mark.parametrize("script, args, message", [
    ("generate_image", ["--ulysses", "3"], "error: --ulysses 3 on 2 rank(s): world_size=2 is not a multiple of"),
    ("generate_image", ["--model", "/nonexistent"], "error: --model /nonexistent: no such file or folder"),
    ("finetune_video", ["--backend", "nope"], "error: --backend 'nope' is not a kernel; choose 'auto' or one of"),
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


def test_ctrl_c_exits_130_quietly(tmp_path):
    cmd = [sys.executable, str(EXAMPLES / "generate_image.py"), "--height", "64", "--width", "64", "--steps", "1000",
           "--no-check", "--output", str(tmp_path / "x.png")]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in proc.stdout:  # until the example has started (its first line), or it ends
        seen.append(line)
        if "running on one rank" in line:
            break
    time.sleep(1.0)  # into loading or denoising, past argument checking
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=120)
    output = "".join(seen) + rest
    assert proc.returncode == 130, output[-3000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    notices = [line for line in output.splitlines() if "running on one rank" in line]
    assert len(notices) == 1 and "torchrun --standalone --nproc-per-node N generate_image.py" in notices[0], notices


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


# ---------------------------------------------------------------------------------------------
# usp_dit.logs


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
