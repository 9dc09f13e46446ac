"""``qwen4exp-serve``'s CPU defaults (``qwen4exp.serve.cpu_env``): what it fills in, and what it leaves to the user."""

import os

import pytest

from qwen4exp import serve


def test_threads_split_into_contiguous_core_groups():
    assert serve.cpu_threads_bind(2, [0, 1]) == "0|1"
    assert serve.cpu_threads_bind(2, [4, 5, 6, 7, 8]) == "4,5|6,7"  # the fifth core goes unused
    with pytest.raises(ValueError, match="3 CPU workers need at least 3 cores, 2 allowed"):
        serve.cpu_threads_bind(3, [0, 1])


@pytest.mark.parametrize("args,want", [([], 1), (["--tensor-parallel-size", "2"], 2), (["-tp=4"], 4),
                                       (["-tp", "2", "--tensor-parallel-size=3"], 3)])
def test_parallel_size_read_from_the_command_line(args, want):
    assert serve._arg_int(args, ("--tensor-parallel-size", "-tp")) == want


def test_bad_parallel_size_names_the_flag():
    with pytest.raises(SystemExit, match=r"--tensor-parallel-size needs an integer, got 'two'"):
        serve._arg_int(["--tensor-parallel-size", "two"], ("--tensor-parallel-size", "-tp"))


@pytest.mark.vllm
def test_cpu_env_binds_ranks_beyond_the_numa_nodes(tmp_path):
    """More workers than NUMA nodes: the binding is filled in (or, with fewer cores than workers, a clear error); a
    user's own binding is kept; one worker needs none."""
    from vllm.utils.cpu_resource_utils import get_visible_memory_node

    ranks = len(get_visible_memory_node()) + 1
    base = dict(QWEN4EXP_CACHE_DIR=str(tmp_path))
    args = ["m", "--tensor-parallel-size", str(ranks)]
    if len(os.sched_getaffinity(0)) >= ranks:
        env = serve.cpu_env(args, dict(base))
        assert env["VLLM_CPU_OMP_THREADS_BIND"] == serve.cpu_threads_bind(ranks)
        assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    else:
        with pytest.raises(ValueError, match=f"{ranks} CPU workers need at least {ranks} cores"):
            serve.cpu_env(args, dict(base))
    kept = serve.cpu_env(args, dict(base, VLLM_CPU_OMP_THREADS_BIND="0-1|2-3"))
    assert kept["VLLM_CPU_OMP_THREADS_BIND"] == "0-1|2-3"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in serve.cpu_env(["m"], dict(base))
