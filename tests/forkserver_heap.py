"""Imported last by the fork server (tests/forking.py), after everything it preloads: moves every object the server
holds into the garbage collector's permanent generation. A child's collections then skip them: a full collection in
a forked rank took 0.25 s with the preloaded modules in it and 0.03 s without (the memory estimator's accuracy ranks
collect after each layout), and the children no longer write to those objects' pages, which they share with the
server until written."""

import gc

gc.collect()
gc.freeze()
