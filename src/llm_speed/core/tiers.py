"""Configuration tiers by shared memory per block: each op family keeps its tables in tiers (a subclass of
:class:`Tier` holding them), largest first, and a device takes the first whose shared memory it has."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TypeVar

from .hardware import Hardware


@dataclasses.dataclass(frozen=True)
class Tier:
    """Configurations for devices with at least ``min_smem_bytes`` of shared memory per block."""

    name: str
    min_smem_bytes: int


T = TypeVar("T", bound=Tier)


def first_fitting(tiers: Sequence[T], hardware: Hardware) -> T:
    """The first of ``tiers`` (largest first) whose shared memory ``hardware`` has; else the smallest."""
    for tier in tiers:
        if hardware.smem_per_block_bytes >= tier.min_smem_bytes:
            return tier
    return tiers[-1]
