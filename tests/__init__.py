import os

# Inductor checks, once per process and cache folder, that the C++ compiler builds every vector ISA the CPU's flags
# report: six g++ builds of ATen's vector headers, about 8 s on 2 cores, serial before a process's first kernel (the
# compiled TP layout's ranks waited on it under inductor's file lock). The ISA is still the one the CPU's flags
# choose; only the build check is skipped (docs/testing.md, "Where the time goes"). Set here, before any test
# imports torch, so the fork server (tests/forking.py) and every launched process inherit it.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")
