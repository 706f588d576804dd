"""Running one distributed job as several local processes (examples/distributed.py, or any
program taking its coordinator arguments), for the multi-process tests of loading and of
object storage."""

import socket
import subprocess
import sys
import time
from pathlib import Path

import _loopback
from _child import cpu_environment

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "distributed.py"
PROCESSES = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(
    tmp_path: Path, mode: str, mesh: str, timeout: float = 120, *, program: list[str] | None = None
) -> list[str]:
    """Runs `mode` as PROCESSES processes of one distributed job (examples/distributed.py,
    or `program` with its arguments); returns what each printed. Fails (after killing the
    others) as soon as one exits with an error, or at `timeout`. Skips the test, with the
    reason, on a host that opens no TCP connection (the coordinator listens on one)."""
    _loopback.needed()
    env = cpu_environment(JAX_NUM_CPU_DEVICES="4")
    env.pop("XLA_FLAGS", None)  # no --xla_force_host_platform_device_count from outside
    program = program or [str(EXAMPLE), mode, str(tmp_path / "run"), "--mesh", mesh]
    command = [sys.executable, *program, "--coordinator", f"127.0.0.1:{free_port()}",
               "--num-processes", str(PROCESSES)]  # fmt: skip
    logs = [tmp_path / f"{mode}-{i}.log" for i in range(PROCESSES)]
    processes: list[subprocess.Popen] = []
    try:
        for i, log in enumerate(logs):
            with log.open("w") as out:  # a file, not a pipe: a full pipe would block the job
                argv = [*command, "--process-id", str(i)]
                processes.append(
                    subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
                )
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in processes):
            failed = any(p.returncode not in (None, 0) for p in processes)
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.wait()
    outputs = [log.read_text() for log in logs]
    codes = [p.returncode for p in processes]
    shown = "\n".join(
        f"--- process {i} (exit {code}):\n{out[-4000:]}"
        for i, (code, out) in enumerate(zip(codes, outputs, strict=True))
    )
    assert codes == [0] * PROCESSES, f"{mode} run failed or timed out after {timeout} s:\n{shown}"
    return outputs


def lines(output: str, word: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("process") and word in line]
