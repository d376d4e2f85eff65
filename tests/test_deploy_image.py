"""The control plane image serves both backends: the files deploy/Dockerfile copies into its final stage
(its COPY lines, through Dockerfile.dockerignore) are laid out in a temporary directory, the app is started
from that tree alone (``python -S``: no editable install or .pth file can lend it a module the image lacks;
torch is refused as the image has none), and the operator API creates a local job and a Kubernetes job
(against the fake API server)."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")  # kmock 0.8
ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
K8S_TESTS = ROOT / "tests" / "controlplane" / "launchers" / "k8s"
PASSWORD = "image-test-operator-pw-0123"
SITE_PACKAGES = list(dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib")))

# Started as ``python -S boot.py <script or -m module> args...``: refuses what the image does not install,
# then runs the command the image would.
BOOT = '''
import importlib.abc, runpy, sys

class NotInTheImage(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "nvidia_resiliency_ext", "triton"):
            raise ModuleNotFoundError(f"{name} is not in the control plane image", name=name)
        return None

sys.meta_path.insert(0, NotInTheImage())
if sys.argv[1] == "-m":
    sys.argv = [sys.argv[2], *sys.argv[3:]]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
else:
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
'''


def final_stage_copies(dockerfile: Path) -> list[tuple[list[str], str]]:
    """(sources, destination) of each COPY in the last stage; not --from ones (from a build stage)."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    stages = re.split(r"(?im)^FROM\s", text)
    copies = []
    for line in stages[-1].splitlines():
        words = line.split()
        if not words or words[0].upper() != "COPY" or any(w.startswith("--from") for w in words):
            continue
        args = [w for w in words[1:] if not w.startswith("--")]
        copies.append((args[:-1], args[-1]))
    return copies


def _pattern(p: str) -> re.Pattern:
    p = p.strip().rstrip("/")
    rx = re.escape(p).replace(r"\*\*", "\0").replace(r"\*", "[^/]*").replace("\0", ".*")
    return re.compile(f"^{rx}(/.*)?$")


def dockerignored(ignore_file: Path):
    rules = [(line.startswith("!"), _pattern(line.lstrip("!")))
             for line in ignore_file.read_text().splitlines() if line.strip() and not line.startswith("#")]

    def ignored(rel: str) -> bool:
        out = False
        for negate, rx in rules:
            if rx.match(rel):
                out = not negate
        return out
    return ignored


def build_file_set(dest: Path) -> Path:
    """The final stage's /app: every COPY source (a file or a directory) minus what the context ignores."""
    ignored = dockerignored(DOCKERFILE.with_name("Dockerfile.dockerignore"))
    for sources, target in final_stage_copies(DOCKERFILE):
        for src in sources:
            path = ROOT / src
            assert path.exists(), f"deploy/Dockerfile copies {src}, which does not exist"
            files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
            for f in files:
                rel = f.relative_to(ROOT).as_posix()
                if ignored(rel):
                    continue
                if path.is_file():
                    out = dest / target / f.name if target.endswith("/") else dest / target
                else:
                    out = dest / target / f.relative_to(path)
                out.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(f, out)
    return dest


def test_it_reads_the_final_stages_copies():
    copies = dict((tuple(s), d) for s, d in final_stage_copies(DOCKERFILE))
    assert copies[("controlplane/",)] == "controlplane/"
    assert not any("requirements.lock" in s for s in copies)  # the build stage's copy is not in the image


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def fake_cluster():
    sys.path.insert(0, str(K8S_TESTS))
    try:
        from k8shelpers import Cluster
        from kfake import KFakeThread
    finally:
        sys.path.remove(str(K8S_TESTS))
    srv = KFakeThread().start()
    cluster = Cluster(srv)
    cluster.ready()
    yield cluster
    cluster.api.close()
    srv.stop()


def test_the_images_file_set_serves_a_local_and_a_kubernetes_job(tmp_path, fake_cluster):
    app = build_file_set(tmp_path / "app")
    assert not (app / "tests").exists() and (app / "trainer" / "wire.py").exists()
    (tmp_path / "boot.py").write_text(BOOT)
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": fake_cluster.srv.url}}],
        "users": [{"name": "test", "user": {"token": "not-checked"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "test"}}]}))
    port = _free_port()
    env = {
        "PATH": os.environ["PATH"], "HOME": str(tmp_path),
        # Only the image's tree and the installed packages: no repository checkout, no editable SDK.
        "PYTHONPATH": os.pathsep.join([str(app), *SITE_PACKAGES]),
        "DJANGO_SETTINGS_MODULE": "controlplane.settings",
        "UNBROKEN_SECRET_KEY": "image-test-only-secret-key-0123456789-abcdefghijklmnop",
        "UNBROKEN_DATA_DIR": str(tmp_path / "var"),
        "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}",
        "KUBECONFIG": str(kubeconfig),
        "UNBROKEN_K8S_INGEST_URL": "http://unbroken-web.unbroken.svc.cluster.local:8000",
        "UNBROKEN_OPERATOR_PASSWORD": PASSWORD,
    }
    boot = [sys.executable, "-S", str(tmp_path / "boot.py")]
    for cmd in (["manage.py", "migrate", "--noinput", "-v", "0"], ["manage.py", "ensure_operator"]):
        r = subprocess.run([*boot, str(app / cmd[0]), *cmd[1:]], cwd=app, env=env, capture_output=True,
                           text=True, timeout=180)
        assert r.returncode == 0, r.stderr[-3000:]
    web = subprocess.Popen([*boot, "-m", "uvicorn", "controlplane.asgi:application", "--host", "127.0.0.1",
                            "--port", str(port)], cwd=app, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(base, web)
        local = _post_job(base, {"name": "local", "spec": {"backend": "local", "preset": "tiny",
                                                           "procs_per_node": 2}})
        assert local["status"] == 201, local
        k8s = _post_job(base, {"name": "k8s", "spec": {
            "backend": "kubernetes", "nodes": 2, "procs_per_node": 8,
            "kubernetes": {"namespace": "train",  # the fake cluster's (k8shelpers.NS)
                           "image": "registry.example/trainer:1",
                           "nvrx_version": "0.4.1"}}})
        assert k8s["status"] == 201, k8s
        assert (local["body"]["backend"], k8s["body"]["backend"]) == ("local", "kubernetes")
    finally:
        web.terminate()
        out, _ = web.communicate(timeout=30)
    assert "Traceback" not in out, out[-3000:]


def _wait_healthy(base: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        try:
            with urllib.request.urlopen(f"{base}/healthz", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.2)
    raise AssertionError("the app from the image's file set did not answer /healthz within 60 s")


def _post_job(base: str, body: dict) -> dict:
    auth = base64.b64encode(f"operator:{PASSWORD}".encode()).decode()
    headers = {"Content-Type": "application/json", "Authorization": f"Basic {auth}"}
    req = urllib.request.Request(f"{base}/api/v1/jobs", data=json.dumps(body).encode(), method="POST",
                                 headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return {"status": r.status, "body": json.loads(r.read())}
    except urllib.error.HTTPError as e:
        return {"status": e.code, "body": e.read().decode()[:3000]}
