"""Distributed tests run under torchrun (see launch.py): one process group for the whole session.

Mark a test with `@pytest.mark.world(2)` (or several sizes: `world(2, 4)`); it runs only in the launch of that
world size. Tests must call collectives in the same order on every rank, so they never skip on some ranks only.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from megatron_branch.parallel.groups import destroy_parallel, init_distributed


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "world(*sizes): world sizes this distributed test runs at")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    world = int(os.environ.get("MEGATRON_BRANCH_TEST_WORLD", os.environ.get("WORLD_SIZE", "1")))
    for item in items:
        item.add_marker(pytest.mark.distributed)
        m = item.get_closest_marker("world")
        sizes = m.args if m else (2,)
        if world not in sizes:
            item.add_marker(pytest.mark.skip(reason=f"runs at world size {sizes}, this launch has {world}"))


@pytest.fixture(scope="session", autouse=True)
def _process_group() -> None:
    if "RANK" not in os.environ:
        pytest.skip("distributed tests run under torchrun: python tests/distributed/launch.py N")
    init_distributed(timeout_s=240)
    torch.set_num_threads(1)
    yield
    destroy_parallel()
    if dist.is_initialized():
        dist.barrier()


@pytest.fixture(autouse=True)
def _fresh_parallel_state() -> None:
    yield
    destroy_parallel()
