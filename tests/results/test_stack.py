"""issue395.results.stack: the stack every output carries names what ran, so two results merge only where
they compare."""

from __future__ import annotations

from importlib import metadata

import pytest
import torch

from issue395.constants import MiB
from issue395.estimator.stacks import package_version
from issue395.results.stack import STACK_KEYS, environment, linear_attention_kernels, measure_context

KERNELS = ("flash-linear-attention", "causal-conv1d")


def _installed(name):
    return package_version(name) != "not installed"


def test_every_key_two_merged_results_must_share_is_one_the_stamp_writes():
    env = environment("synthetic", True, "in one process", ["--dry-run"])
    assert set(STACK_KEYS) <= set(env)


def test_on_cpu_the_stamp_names_no_gpu_and_the_installed_versions():
    env = environment("synthetic", False, "in one process", ["--models", "smol"])
    assert env["gpu"] is None and env["driver"] is None
    assert env["torch"] == torch.__version__ and env["cuda"] == torch.version.cuda
    assert env["soup_cli"] == metadata.version("soup-cli")
    assert env["transformers"] == metadata.version("transformers")
    assert (env["weights"], env["dry_run"], env["arms"], env["command"]) == (
        "synthetic", False, "in one process", "--models smol")


def test_without_torch_its_version_is_read_from_its_package_and_no_gpu_is_named():
    env = environment("synthetic", True, "2 children", [], with_torch=False)
    assert env["torch"] == metadata.version("torch")
    assert env["gpu"] is None and env["cuda"] is None


def test_a_package_that_is_not_installed_reads_so():
    assert package_version("issue395-no-such-package") == "not installed"
    assert package_version("soup-cli") == metadata.version("soup-cli")


@pytest.mark.skipif(any(map(_installed, KERNELS)), reason="a linear-attention kernel is installed here")
def test_a_stack_without_the_linear_attention_kernels_reads_as_it_always_did():
    assert linear_attention_kernels() == {}
    assert "linear_attention_kernels" not in environment("synthetic", True, "in one process", [])


def test_the_stack_stamps_context_is_total_minus_free_less_the_allocators_reserve(monkeypatch):
    import torch

    calls = []  # FAKE: the CUDA calls measure_context makes; the arithmetic is the real one
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "init", lambda: calls.append("init"))
    monkeypatch.setattr(torch.cuda, "current_blas_handle", lambda: calls.append("cublas"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (140 * 10**9, 150 * 10**9))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 32 * MiB)
    got = measure_context()
    assert calls == ["init", "cublas"]
    assert got["context_bytes"] == 10 * 10**9 - 32 * MiB and got["cuda_total_bytes"] == 150 * 10**9
