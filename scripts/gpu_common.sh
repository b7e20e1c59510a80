# Sourced by the prepared accelerator checks: pick the python, refuse to run a real check
# without an accelerator (--dry-run runs the same code on CPU), bound the run at 8 minutes.
gpu_check_run() {
  local script="$1"; shift
  local root; root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  local py="${PYTHON:-python3}"
  if [ -z "${PYTHON:-}" ] && [ -x "$root/.venv/bin/python" ]; then py="$root/.venv/bin/python"; fi
  if [[ " $* " != *" --dry-run "* ]]; then
    "$py" -c "import jax, sys; d = jax.devices()[0]; print('[gpu_check] device:', d.device_kind); sys.exit(d.platform == 'cpu')" \
      || { echo "[gpu_check] no accelerator found (use --dry-run on CPU)" >&2; return 2; }
  fi
  PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}" \
    timeout 480 "$py" "$root/scripts/$script" "$@"
}
