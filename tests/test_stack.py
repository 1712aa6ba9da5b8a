"""issue395.stack: the stack every output carries names what ran, so two results merge only where
they compare."""

from __future__ import annotations

from importlib import metadata

import pytest
import torch

from issue395.stack import STACK_KEYS, environment, linear_attention_kernels, package_version

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
