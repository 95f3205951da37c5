"""Repository tooling, not part of the installed package: the README's family table
(`python -m tools.family_table --write`), the presets of `configs/` (`tools.presets`) and how
far each loads without weights (`tools.preset_check`)."""
