"""A whole drafter directory: DFlash (config.json + model.safetensors), tfm_config.json, and the
optional Weaver / TreeFlash weights beside them (DESIGN.md section 8)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .dflash import DFlashDrafter
from .tfm_config import TFM_CONFIG_NAME, TfmConfig
from .treeflash import TreeFlashApproximator
from .weaver import Weaver

__all__ = ["DrafterBundle", "load_drafter_dir"]


@dataclass
class DrafterBundle:
    """The models of one drafter directory. ``tfm`` is None for a plain (z-lab) DFlash directory."""

    dflash: DFlashDrafter
    tfm: TfmConfig | None
    weaver: Weaver | None
    treeflash: TreeFlashApproximator | None

    def validate_against_target(self, target_config: object) -> None:
        """One-line ValueError for the first model that does not fit the target."""
        self.dflash.validate_against_target(target_config)
        if self.weaver is not None:
            self.weaver.validate_against_target(target_config)
        if self.treeflash is not None:
            self.treeflash.validate_against_target(target_config)

    def save_pretrained(self, directory: str | Path) -> None:
        self.dflash.save_pretrained(directory)
        if self.tfm is not None:
            self.tfm.save(directory)
        if self.weaver is not None:
            self.weaver.save_pretrained(directory)
        if self.treeflash is not None:
            self.treeflash.save_pretrained(directory)


def load_drafter_dir(
    directory: str | Path,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    target_config: object | None = None,
) -> DrafterBundle:
    """Load every model the directory holds; with ``target_config`` check them against the target."""
    dflash = DFlashDrafter.from_pretrained(directory, dtype=dtype, device=device)
    tfm = TfmConfig.load(directory) if (Path(directory) / TFM_CONFIG_NAME).is_file() else None
    weaver = Weaver.from_pretrained(directory, dtype=dtype, device=device) if tfm and tfm.weaver else None
    treeflash = (
        TreeFlashApproximator.from_pretrained(directory, dtype=dtype, device=device) if tfm and tfm.treeflash else None
    )
    bundle = DrafterBundle(dflash=dflash, tfm=tfm, weaver=weaver, treeflash=treeflash)
    if target_config is not None:
        bundle.validate_against_target(target_config)
    return bundle
