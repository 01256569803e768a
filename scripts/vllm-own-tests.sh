#!/usr/bin/env bash
# Run the installed vLLM release's own tests against it, optionally with
# kvgate's partial-tail hold overlay loaded and switched on.
#
#   scripts/vllm-own-tests.sh [--overlay] [PYTEST ARGS...]
#
# --overlay   load kvgate.impl.hold_overlay into the pytest session (through
#             the pytest plugin kvgate.impl.hold_overlay_pytest) and set
#             VLLM_E2_MAMBA_RETAIN_CHECKPOINT=1; without it the switch is 0
#             and nothing of kvgate is loaded.
# PYTEST ARGS are passed to pytest unchanged, run from inside the fetched
#             tests (.cache/vllm-<version>-tests), so paths read tests/v1/...
#             If none of them names an existing test path (a file or folder,
#             optionally with ::node), the default selection runs:
#             tests/v1/core/prefix_cache/ and tests/v1/core/test_prefix_caching.py.
#
# Exit status is pytest's. Sets up the venv (scripts/setup.sh), fetches the
# tests (scripts/fetch-vllm-tests.sh) and installs requirements/vllm-tests.txt
# on top, once. HF_HUB_OFFLINE defaults to 1, and then the tests of the default
# selection that need a model's files from the Hugging Face hub are
# deselected (they cannot pass offline, hold or no hold); HF_HUB_OFFLINE=0
# keeps them. Offline, unless HF_HUB_CACHE is set, the model configs the
# scheduler tests name come from .cache/hf-config-stand-ins, written once by
# scripts/vllm-own-hf-configs.py from transformers' config classes (configs
# only: a test that needs weights, a tokenizer or a processor still fails, and
# a campaign's baseline leaves it out).
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
venv="${KVGATE_VENV:-.venv}"
case "$venv" in /*) ;; *) venv="$root/$venv" ;; esac

overlay=0
if [ "${1:-}" = "--overlay" ]; then
  overlay=1
  shift
fi

# KVGATE_SKIP_SETUP=1: the venv is set up already (the matrix's release venvs).
[ "${KVGATE_SKIP_SETUP:-0}" = 1 ] || bash scripts/setup.sh
tests_dir="$root/$(bash scripts/fetch-vllm-tests.sh)"
stamp="$venv/.kvgate-vllm-tests"
want="$(sha256sum requirements/vllm-tests.txt | cut -c1-16)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  "$venv/bin/python" -m pip --disable-pip-version-check -q install --no-deps \
    -r requirements/vllm-tests.txt
  echo "$want" > "$stamp"
fi

cd "$tests_dir"
has_path=0
for arg in "$@"; do
  case "$arg" in -*) continue ;; esac
  if [ -e "${arg%%::*}" ]; then
    has_path=1
    break
  fi
done
selection=()
if [ "$has_path" = 0 ]; then
  selection=(tests/v1/core/prefix_cache/ tests/v1/core/test_prefix_caching.py)
fi

export VLLM_TARGET_DEVICE=cpu
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
if [ "$HF_HUB_OFFLINE" = 1 ] && [ -z "${HF_HUB_CACHE:-}" ]; then
  export HF_HUB_CACHE="$root/.cache/hf-config-stand-ins"
  "$venv/bin/python" "$root/scripts/vllm-own-hf-configs.py" "$HF_HUB_CACHE"
fi
if [ "$HF_HUB_OFFLINE" = 1 ]; then
  # Qwen/Qwen3.5-0.8B and facebook/opt-125m: model configs from the hub.
  selection+=(
    --deselect tests/v1/core/prefix_cache/test_hybrid_prefix_cache_hit_rate.py::test_prefix_cache_hit_rate
    --deselect tests/v1/core/test_prefix_caching.py::test_nixl_hisparse_full_block_import_keeps_a_writable_tail
  )
fi
plugin=()
if [ "$overlay" = 1 ]; then
  export VLLM_E2_MAMBA_RETAIN_CHECKPOINT=1
  plugin=(-p kvgate.impl.hold_overlay_pytest)
else
  export VLLM_E2_MAMBA_RETAIN_CHECKPOINT=0
fi
# Their own config and rootdir (node ids read tests/v1/...), not kvgate's.
exec "$venv/bin/python" -m pytest -c "$root/scripts/vllm-own-tests.ini" --rootdir "$tests_dir" \
  "${plugin[@]}" "$@" "${selection[@]}"
