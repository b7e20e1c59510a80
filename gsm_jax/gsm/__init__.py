"""The GSM core's configuration: what a user writes, checked, and what it means for a model.

- `schema`: `GSMConfig` (spec §5), its constants and validation, config files;
- `profile_io`: profiles (schema ``gsm-jax/profile/v1``): build, select, write, read;
- `resolve`: which (layer, site) pairs and which batch rows a config smooths
  (`resolve_mask`, `describe`, `row_enabled`, `rollout_value`);
- `watcher`: `ConfigWatcher`, hot reload of a config file.

`gsm_jax.config` re-exports these names, as before the split. The arrays of the jitted
step (`GSMInputs`, the models' GSM hooks) are built a layer up, in `gsm_jax.gsm_runtime`.
This package imports nothing on its own, so each module costs only what it needs.
"""
