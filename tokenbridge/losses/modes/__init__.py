"""The loss-mode registry: one `LossMode` object per mode, by name, read by the config, the
preflight and the loop (`trainer.loss_terms`, `trainer.onpolicy`).

Adding a mode is its loss module plus one class here (the family modules show the shapes:
`position_modes`, `chunk_modes`, `onpolicy_modes`). What each reader takes from a mode:
`LossMode`'s docstring and docs/losses.md.
"""

from tokenbridge.losses.modes.chunk_modes import Alm, ChunkMode, Gold, XToken
from tokenbridge.losses.modes.loss_mode import CE, LossMode, NoOptions
from tokenbridge.losses.modes.onpolicy_modes import OPDPG, OPDTopK
from tokenbridge.losses.modes.position_modes import KDTopK, PositionMode

MODES: dict[str, LossMode] = {
    mode.name: mode for mode in (CE(), KDTopK(), XToken(), Gold(), Alm(), OPDTopK(), OPDPG())
}

# the modes a teacher can be given (``teachers[i].loss``): every mode but ce
KD_MODES = tuple(name for name, mode in MODES.items() if mode.distills)

__all__ = ["KD_MODES", "MODES", "ChunkMode", "LossMode", "NoOptions", "PositionMode"]
