"""Configuration tiers by shared memory per block: each op family keeps its tables in tiers (a subclass of
:class:`Tier` holding them), largest first, and a device takes the first whose shared memory it has."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TypeVar

from .hardware import KIB, Hardware


@dataclasses.dataclass(frozen=True)
class Tier:
    """Configurations for devices with at least ``min_smem_bytes`` of shared memory per block."""

    name: str
    min_smem_bytes: int


T = TypeVar("T", bound=Tier)


# The attention tiers' names and floors, largest first (llm_speed.attention.configs holds their tables; the
# launch policy names them; the torch-free performance model reads which one a GPU takes from here).
ATTENTION_TIER_FLOORS = (Tier("227 KB", 227 * KIB), Tier("99 KB", 99 * KIB), Tier("under 99 KB", 0))


def first_fitting(tiers: Sequence[T], hardware: Hardware) -> T:
    """The first of ``tiers`` (largest first) whose shared memory ``hardware`` has; else the smallest."""
    for tier in tiers:
        if hardware.smem_per_block_bytes >= tier.min_smem_bytes:
            return tier
    return tiers[-1]
