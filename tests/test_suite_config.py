"""The suite's own guards (issue 32): a hanging test fails with a stack instead of stalling CI, and a
developer can draw new hypothesis examples on demand while CI stays derandomized."""

import subprocess
import sys
import textwrap

from hypothesis import settings


def test_every_test_runs_under_a_timeout(pytestconfig):
    assert pytestconfig.pluginmanager.hasplugin("timeout")
    assert 60 <= float(pytestconfig.getini("timeout")) <= 900


def test_a_hanging_test_fails_with_its_stack(tmp_path):
    (tmp_path / "test_hang.py").write_text(textwrap.dedent("""
        import threading
        def test_hangs():
            threading.Event().wait()
    """))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "timeout=2",
                          "--rootdir", str(tmp_path), str(tmp_path / "test_hang.py")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert "Timeout" in run.stdout and "test_hang.py" in run.stdout


def test_the_explore_profile_draws_new_examples_each_run():
    explore = settings.get_profile("explore")
    assert explore.derandomize is False and explore.max_examples >= 500
    assert settings.get_profile("ci").derandomize is True
