"""Unit conversions every layer shares: what spec files say (TFLOP/s, GiB, GB/s, Gbit/s, us) against
what the code computes in (FLOP/s, bytes, bytes/s, s), and the solver's integer clock."""

from __future__ import annotations

FLOP_S_PER_TFLOP_S = 1e12
BYTES_PER_GIB = 2**30
BYTES_PER_MIB = 2**20
BYTES_S_PER_GBYTE_S = 1e9
BYTES_S_PER_GBIT_S = 1e9 / 8
US_PER_S = 1e6
NS_PER_S = 1e9
