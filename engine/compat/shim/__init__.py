"""The directory `tiers launch --as-deepspeed` puts first on its processes' PYTHONPATH: its `deepspeed` package is
the compat layer (Note [the deepspeed shim]). A package itself only so that installs ship it; importing
engine.compat.shim.deepspeed under that name is refused."""
