"""Other frameworks' Python APIs on Tiers: `from engine.compat import deepspeed` in place of `import deepspeed`."""
