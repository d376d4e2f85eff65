import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _load(env: dict) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("UNBROKEN_")}
    clean.update(env, DJANGO_SETTINGS_MODULE="controlplane.settings", PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-c", "import django; django.setup()"], env=clean, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_it_refuses_the_default_secret_key_with_debug_off(tmp_path):
    r = _load({"UNBROKEN_DATA_DIR": str(tmp_path)})
    assert r.returncode != 0
    assert "UNBROKEN_SECRET_KEY is the default" in r.stderr


def test_it_starts_with_a_secret_key_file(tmp_path):
    (tmp_path / "key").write_text("a-long-random-value-for-this-test-only-0123456789\n")
    r = _load({"UNBROKEN_DATA_DIR": str(tmp_path), "UNBROKEN_SECRET_KEY_FILE": str(tmp_path / "key")})
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("value", ["maybe", "1", "yes", "0", "no"])
def test_it_rejects_a_boolean_that_is_not_true_or_false(tmp_path, value):
    r = _load({"UNBROKEN_DATA_DIR": str(tmp_path), "UNBROKEN_DEBUG": value})
    assert r.returncode != 0 and f"UNBROKEN_DEBUG={value!r}: use true or false" in r.stderr


def test_it_reads_true_and_false_in_any_case(tmp_path):
    r = _load({"UNBROKEN_DATA_DIR": str(tmp_path), "UNBROKEN_DEBUG": "True"})
    assert r.returncode == 0, r.stderr
