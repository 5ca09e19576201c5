"""The OpenMP wait policy chosen at import (specsample.openmp)."""

import subprocess
import sys

from specsample.openmp import SLEEP, SPIN, busy_cores, choose_wait_policy

from conftest import needs_kernels


def test_idle_machine_spins_and_busy_machine_sleeps():
    assert choose_wait_policy({}, 0.3, 2) == SPIN
    assert choose_wait_policy({}, 1.0, 2) == SLEEP
    assert choose_wait_policy({}, 7.9, 16) == SPIN


def test_busy_cores_is_a_fraction_of_the_cores():
    assert 0.0 <= busy_cores(0.02) <= (__import__("os").cpu_count() or 1) + 1e-9


def test_the_users_setting_wins():
    assert choose_wait_policy({"OMP_WAIT_POLICY": "ACTIVE"}, 0.0, 2) == {}
    assert choose_wait_policy({"GOMP_SPINCOUNT": "1000"}, 9.0, 2) == {}


def test_import_sets_one_policy():
    """Importing specsample, with neither variable set, sets exactly one of them."""
    code = (
        "import os; os.environ.pop('OMP_WAIT_POLICY', None); os.environ.pop('GOMP_SPINCOUNT', None)\n"
        "import specsample\n"
        "print(sum(v in os.environ for v in ('OMP_WAIT_POLICY', 'GOMP_SPINCOUNT')))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.split()
    assert out == ["1"]


LOAD_AND_COUNT = """
import os, sys, time
from specsample import SpecSampler
from specsample.openmp import in_passing_thread
def threads(): return len(os.listdir("/proc/self/task"))
before = threads()
if sys.argv[1] == "passing":
    sampler = in_passing_thread(SpecSampler.load, None, "none", backend="gguf")
else:
    sampler = SpecSampler.load(None, "none", backend="gguf")
time.sleep(0.2)  # a finished team's threads take a moment to exit
print(threads() - before)
"""


@needs_kernels
def test_a_load_on_a_passing_thread_leaves_no_openmp_team_behind():
    """Loading runs parallel regions (the kernels, torch). On the main thread they leave a team of OpenMP
    threads that a server's decoding thread would double (libgomp then stops spinning); on a passing
    thread the team ends with it."""
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "2"}
    left = {
        where: int(subprocess.run([sys.executable, "-c", LOAD_AND_COUNT, where], env=env, capture_output=True,
                                  text=True, check=True).stdout.split()[-1])
        for where in ("main", "passing")
    }
    assert left == {"main": 1, "passing": 0}


def test_the_default_threads_follow_omp_num_threads(monkeypatch):
    """OMP_NUM_THREADS=1 set torch's and the kernels' teams to one thread and left llama.cpp's (and every other
    default of `default_threads`) on every core. Its first level counts, at most the cores; nonsense is ignored."""
    import os

    from specsample.openmp import default_threads

    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert default_threads() == cores
    for value, threads in (("1", 1), ("1,1", 1), (" 1 ", 1), (str(cores + 5), cores), ("0", cores), ("x", cores),
                           ("", cores)):
        monkeypatch.setenv("OMP_NUM_THREADS", value)
        assert default_threads() == threads, value
