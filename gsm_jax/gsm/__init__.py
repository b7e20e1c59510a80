"""The GSM core's configuration, from a user's config to the arrays of the jitted step.

- `schema`: `GSMConfig` (spec §5), its constants and validation, config files;
- `profile_io`: profiles (schema ``gsm-jax/profile/v1``): build, select, write, read;
- `resolve`: which (layer, site) pairs and which batch rows a config smooths
  (`resolve_mask`, `describe`, `row_enabled`, `rollout_value`);
- `watcher`: `ConfigWatcher`, hot reload of a config file;
- `step_inputs`: `GSMInputs` for a batch, the kernel implementation, the precision.

`gsm_jax.config` and `gsm_jax.gsm_runtime` re-export these names, as before the split.
This package imports nothing on its own, so each module costs only what it needs.
"""
