"""Paths, under the name they had before :mod:`routetool.io.paths` (what is at a path, writing
outputs safely) and :mod:`routetool.io.inputs` (the checks of a command's outputs) took them.

New code imports from those two modules; nothing in routetool imports this one, so that it
can sit above both without closing an import cycle.
"""

from routetool.io.inputs import check_output_paths, refuse_rank_folder  # noqa: F401
from routetool.io.paths import (  # noqa: F401
    PATH_KINDS, atomic_write, check_output_folder, claim_outputs, default_file_mode, forget_claims, missing_folders,
    path_kind, publish_folder, refuse_special_file, rename_noreplace, require_input, resolved, same_file, staged_folder,
)
