"""Run the tritonserver binary that the nvidia-pytriton wheel ships (with its python backend), on 127.0.0.1.

The wheel keeps one python-backend stub per Python version; the server needs the one matching this
interpreter inside its backend directory, so a small workspace is prepared first (as PyTriton does). The
server's PATH starts with this interpreter's bin directory, so the model's stub finds the same packages.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ..errors import SpecExportError


def _pytriton_dist() -> tuple[Path, Path]:
    import importlib.util
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.origin:
        raise SpecExportError("serving locally needs the tritonserver from nvidia-pytriton: "
                              "pip install 'specexport[triton]' (or run the repository in an NVIDIA Triton container)")
    root = Path(spec.origin).parent
    return root / "tritonserver", root.parent / "nvidia_pytriton.libs"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare_workspace(workdir: Path) -> Path:
    dist, _ = _pytriton_dist()
    ws = workdir / "tritonserver"
    if not ws.exists():
        shutil.copytree(dist, ws, ignore=shutil.ignore_patterns("python_backend_stubs"))
        version = f"{sys.version_info[0]}.{sys.version_info[1]}"
        stub = dist / "python_backend_stubs" / version / "triton_python_backend_stub"
        if not stub.exists():
            raise SpecExportError(f"nvidia-pytriton has no python-backend stub for Python {version}")
        shutil.copy2(stub, ws / "backends" / "python" / "triton_python_backend_stub")
    return ws


@dataclass
class TritonServer:
    process: subprocess.Popen
    http_port: int
    grpc_port: int
    metrics_port: int
    log_path: Path

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise SpecExportError(f"tritonserver exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise SpecExportError(f"tritonserver was not ready within {timeout:.0f}s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_server(repo: str, http_port: int = 0, grpc_port: int = 0, metrics_port: int = 0,
                 workdir: str | None = None, log_path: str | None = None) -> TritonServer:
    """Start tritonserver on 127.0.0.1 (port 0: a free port) over `repo`; returns without waiting for ready."""
    _, libs = _pytriton_dist()
    work = Path(workdir or tempfile.mkdtemp(prefix="specexport-triton-"))
    ws = prepare_workspace(work)
    ports = [p or free_port() for p in (http_port, grpc_port, metrics_port)]
    env = dict(os.environ)
    # this interpreter's libpython first: the stub links libpython3.X dynamically, and another copy of the same
    # minor version (a distribution's) may not match this interpreter's compiled standard modules
    libdir = sysconfig.get_config_var("LIBDIR")
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [libdir, str(libs), env.get("LD_LIBRARY_PATH")]))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    log = Path(log_path) if log_path else work / "tritonserver.log"
    cmd = [str(ws / "bin" / "tritonserver"), f"--model-repository={Path(repo).resolve()}",
           f"--backend-directory={ws / 'backends'}", f"--http-port={ports[0]}", f"--grpc-port={ports[1]}",
           f"--metrics-port={ports[2]}", "--http-address=127.0.0.1", "--grpc-address=127.0.0.1",
           "--metrics-address=127.0.0.1", "--log-verbose=0", "--exit-timeout-secs=10"]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=work)
    return TritonServer(proc, *ports, log)
