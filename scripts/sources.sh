#!/usr/bin/env bash
# Fill the source cache with NeMo-RL and the Megatron / Automodel sources it pins (scripts/sources.py:
# the pins in scripts/sources.pins; nothing is written inside this repository).
#   bash scripts/sources.sh                  # clone the public repositories (network)
#   bash scripts/sources.sh --from DIR       # offline: the local git directories / mirrors found in DIR
#   bash scripts/sources.sh status           # which NeMo-RL worlds the cache holds
exec python3 "$(dirname "$0")/sources.py" "$@"
