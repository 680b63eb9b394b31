"""The directory `tiers launch --as-deepspeed` and `--as-colossalai` put first on their processes' PYTHONPATH: its
`deepspeed` and `colossalai` packages are the compat layers (Note [the deepspeed shim]). A package itself only so
that installs ship it; importing engine.compat.shim.deepspeed (or .colossalai) under that name is refused."""
