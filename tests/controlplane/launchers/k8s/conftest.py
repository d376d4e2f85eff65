"""Fixtures for the Kubernetes launcher tests: a fresh loopback API server per test (``cluster``), the
launcher pointed at it, and ``use_fake_cluster`` for code that calls get_launcher("kubernetes")."""

from __future__ import annotations

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from controlplane.launchers.kubernetes import KubernetesLauncher

from k8shelpers import INGEST_URL, Cluster
from kfake import KFakeThread


def pytest_collection_modifyitems(items):
    # kmock 0.8 loads its bundled resource list with a deprecated importlib.resources call.
    mark = pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.path).startswith(here):
            item.add_marker(mark)


@pytest.fixture()
def cluster():
    srv = KFakeThread().start()
    c = Cluster(srv)
    yield c
    c.api.close()
    srv.stop()


@pytest.fixture()
def launcher(cluster):
    return KubernetesLauncher(api_client=cluster.api, ingest_url=INGEST_URL, delete_wait_s=0.5,
                              sleep=lambda s: time.sleep(min(s, 0.05)))


@pytest.fixture()
def use_fake_cluster(monkeypatch, launcher):
    """Make get_launcher("kubernetes") (the lead's services and tasks) use the fake cluster."""
    monkeypatch.setattr(KubernetesLauncher, "from_settings", classmethod(lambda cls: launcher))
    return launcher

