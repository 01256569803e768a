#!/usr/bin/env bash
# The fault-injection campaign run over vLLM 0.33.0's own manager tests,
# next to the same campaign run by kvgate's gate, so the two kill rates sit
# side by side.
#
#   scripts/mutate-vllm-own-tests.sh [KVGATE MUTATE ARGS...]
#
# e.g. --faults NAME... to run a few faults, --jobs N, --junit-xml PATH.
# Each fault runs in its own pytest session of tests/v1/core/prefix_cache/,
# test_prefix_caching.py, test_mamba_align_chunk_split.py,
# test_single_type_kv_cache_manager.py and test_deferred_block_free.py
# (through scripts/vllm-own-tests.sh, which installs their extra
# dependencies), with the fault applied at session start by the pytest
# plugin kvgate.mutate.pytest_plugin. Expect most of an hour on 2 cores: a
# fault those tests miss costs a whole session. Exit status is kvgate
# mutate's: 0 when the gate caught every applicable fault.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/fetch-vllm-tests.sh >/dev/null
export VLLM_TARGET_DEVICE=cpu
exec "${KVGATE_VENV:-.venv}/bin/kvgate" mutate --target vllm --suite both "$@"
